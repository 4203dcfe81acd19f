"""Qwen-Image's tiny random-weight pipeline, "qwen-image": `stages.families.common.qwen_image_tiny`."""

from __future__ import annotations

from stages.families.common.qwen_image_tiny import (LATENTS_MEAN, LATENTS_STD, PIPELINE_CLASS,  # noqa: F401
                                                    PIPELINE_EXTRA, TINY_DIMS, build_components)
