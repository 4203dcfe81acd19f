"""ERNIE-Image as ComfyUI loads it (`comfy/ldm/ernie/model.py` `ErnieImageModel`, model class
`comfy.model_base.ErnieImage`): its module names are diffusers' own (`layers.N.self_attention.to_q`,
`mlp.gate_proj`, `x_embedder.proj`, `text_proj`, `final_linear`, ...), and `model_lora_keys_unet` maps
`transformer.<name>` to every weight `diffusion_model.<name>.weight` of the loaded model, besides its
generic `diffusion_model.<name>` and `lora_unet_<name with _>` for every model."""

from __future__ import annotations

from stages.core.comfyui import ComfyLayout

LAYOUT = ComfyLayout("ernie_image", same_names=True)
