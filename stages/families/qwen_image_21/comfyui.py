"""Qwen-Image 2.1 as ComfyUI loads it: diffusers' module paths, except that each block's SwiGLU gate and
up projections are one `img_mlp.gate_up` linear ([gate; up] rows), which ComfyUI's key map still reaches
by the diffusers names of its halves."""

from __future__ import annotations

from stages.core.comfyui import ComfyLayout, Rule

LAYOUT = ComfyLayout("qwen_image", (
    Rule(r"(transformer_blocks\.\d+\.img_mlp)\.gate_layer", r"\1.gate_up", 0, 2),
    Rule(r"(transformer_blocks\.\d+\.img_mlp)\.proj", r"\1.gate_up", 1, 2),
), same_names=True)
