"""Qwen-Image-Edit-2511 at full size for bench/: Qwen-Image's released architecture with the transformer's
`zero_cond_t` set; a step's image sequence is the target's tokens plus one control's (at the target's area)."""

from __future__ import annotations

from stages.families.common import qwen_image_full as qwen_full
from stages.families.full_parts import diffusers_model

PRESET = "configs/qwen-image-edit-2511.toml"
TEXT_PRECISION = qwen_full.TEXT_PRECISION
BUILD_SECONDS = qwen_full.BUILD_SECONDS
TRAIN_SECONDS = 90  # as Qwen-Image-Edit-2509's: the same transformer and sequence
ENCODE_SECONDS = 35  # the Qwen2.5-VL encoder reads each control image too
TEXT_IN_SEQUENCE = True
IMAGES_IN_SEQUENCE = 2  # target + one control (the bench data's), for the 4·P·T rule
TRANSFORMER = {**qwen_full.TRANSFORMER, "zero_cond_t": True}
COMPONENTS = {**qwen_full.COMPONENTS, "transformer": diffusers_model("QwenImageTransformer2DModel", TRANSFORMER)}
attention_flops = qwen_full.edit_attention_flops  # target + one control
meta_forward = qwen_full.edit_meta_forward
