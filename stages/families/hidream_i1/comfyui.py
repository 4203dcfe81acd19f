"""HiDream-I1 as ComfyUI loads it: `comfy/ldm/hidream/model.py` keeps the original HiDream module names,
which are diffusers' (`double_stream_blocks.N.block.attn1.to_q`, `ff_i.shared_experts.w1`, `caption_projection.N.linear`,
`final_layer.adaLN_modulation.1`, ...), and `comfy/lora.py` `model_lora_keys_unet` maps, for its `HiDream` model
class, `transformer.<name>` and `lycoris_<name with _>` of each of its own weights to that weight: every
diffusers module lands on the module of the same path, none fused, none with swapped halves."""

from __future__ import annotations

from stages.core.comfyui import ComfyLayout

LAYOUT = ComfyLayout("hidream", same_names=True)
