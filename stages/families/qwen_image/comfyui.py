"""Qwen-Image (and Qwen-Image-Edit) as ComfyUI loads it: its weights keep diffusers' module paths, and its
key map accepts each path bare, after `transformer.` and as `lycoris_<path with _>`."""

from __future__ import annotations

from stages.core.comfyui import ComfyLayout

LAYOUT = ComfyLayout("qwen_image", same_names=True)
