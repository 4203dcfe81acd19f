"""Ideogram 4 as ComfyUI loads it (`comfy/ldm/ideogram4/model.py`, model class `Ideogram4`): diffusers'
module names except the attention, whose q, k and v are one fused `attention.qkv` linear (rows q, k, v) and
whose output is `attention.o`. ComfyUI's `model_lora_keys_unet` has no table of diffusers names for this
model, so only its own names reach it (`diffusion_model.<name>`, `lora_unet_<name with _>`): q, k and v are
written as one fused LoRA on `attention.qkv` (`stages.core.comfyui_file`)."""

from __future__ import annotations

from stages.core.comfyui import ComfyLayout, Rule

BLOCK = r"layers\.(\d+)\."
TOP = r"input_proj|llm_cond_proj|adaln_proj|t_embedding\.mlp_(?:in|out)|final_layer\.(?:linear|adaln_modulation)"

LAYOUT = ComfyLayout("ideogram4", (
    *[Rule(rf"{BLOCK}attention\.to_{p}", r"layers.\1.attention.qkv", i, 3, mapped=False) for i, p in enumerate("qkv")],
    Rule(rf"{BLOCK}attention\.to_out\.0", r"layers.\1.attention.o", mapped=False),
    Rule(rf"({BLOCK}(?:feed_forward\.w[123]|adaln_modulation))", r"\1", mapped=False),
    Rule(rf"({TOP})", r"\1", mapped=False),
))
