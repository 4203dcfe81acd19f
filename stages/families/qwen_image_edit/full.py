"""Qwen-Image-Edit-2509 at full size for bench/: Qwen-Image's released architecture; a step's image
sequence is the target's tokens plus one control's (at the target's area)."""

from __future__ import annotations

from stages.families.common import qwen_image_full as qwen_full

PRESET = "configs/qwen-image-edit.toml"
TEXT_PRECISION = qwen_full.TEXT_PRECISION
BUILD_SECONDS = qwen_full.BUILD_SECONDS
TRAIN_SECONDS = 90  # a compiled 512 px b1 item (Qwen-Image's took 60-73 s), its sequence twice Qwen-Image's image tokens
ENCODE_SECONDS = 35  # the Qwen2.5-VL encoder reads each control image too
TEXT_IN_SEQUENCE = True
IMAGES_IN_SEQUENCE = 2  # target + one control (the bench data's), for the 4·P·T rule
TRANSFORMER = qwen_full.TRANSFORMER
COMPONENTS = qwen_full.COMPONENTS

attention_flops = qwen_full.edit_attention_flops  # target + one control
meta_forward = qwen_full.edit_meta_forward
