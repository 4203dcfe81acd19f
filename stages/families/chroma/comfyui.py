"""Chroma as ComfyUI loads it: its model class `Chroma` subclasses `Flux` (`comfy/model_base.py`), so
`model_lora_keys_unet` maps diffusers names through FLUX.1's table (`comfy/utils.py` `flux_to_diffusers`,
`stages.families.common.bfl.FLUX1`); the modules Chroma lacks (modulation, pooled-text and guidance
embedders, final adaLN) simply never match. The approximator (`comfy/ldm/chroma/layers.py` `Approximator`,
diffusers' `distilled_guidance_layer`) is outside that table: only ComfyUI's own names reach it, where each
`PixArtAlphaTextProjection`'s linear_1 / linear_2 is an `MLPEmbedder`'s in_layer / out_layer."""

from __future__ import annotations

from stages.core.comfyui import ComfyLayout, Rule
from stages.families.common.bfl import FLUX1

A = r"distilled_guidance_layer\."

LAYOUT = ComfyLayout("flux", (
    *FLUX1.rules,
    Rule(rf"{A}(in_proj|out_proj)", r"distilled_guidance_layer.\1", mapped=False),
    Rule(rf"{A}layers\.(\d+)\.linear_1", r"distilled_guidance_layer.layers.\1.in_layer", mapped=False),
    Rule(rf"{A}layers\.(\d+)\.linear_2", r"distilled_guidance_layer.layers.\1.out_layer", mapped=False),
))
