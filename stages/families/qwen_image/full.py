"""Qwen-Image at full size for bench/ (bench/full_configs.py builds it): `stages.families.common.qwen_image_full`
with the preset the bench runs."""

from __future__ import annotations

from stages.families.common.qwen_image_full import (BUILD_SECONDS, COMPONENTS, QWEN2_5_VL_7B_TEXT,  # noqa: F401
                                                    QWEN2_5_VL_7B_VISION, TEXT_IN_SEQUENCE, TEXT_PRECISION,
                                                    TRANSFORMER, VAE, attention_flops, meta_forward)

PRESET = "configs/qwen-image.toml"
