"""Qwen-Image-Edit-Plus's config checks and demo geometry, which `qwen-image-edit` and
`qwen-image-edit-2511` share (no torch: run before any model loads)."""

from __future__ import annotations

from typing import Any

from stages.families import checks

PIPELINE_MAX_SEQUENCE_LENGTH = 1024  # QwenImageEditPlusPipeline.check_inputs refuses longer
# Square pairs: the pipeline sizes a control to its own aspect over the target's area in multiples of 32
# (calculate_dimensions), so at 64 px only a square control lines up token for token with its target,
# which the demo model's copy of the control needs.
DEMO_EDIT_SIZES = ((64, 64),)


def config_errors(cfg: Any) -> list[str]:
    # caption dropout is allowed: its empty caption is cached once per control set (the VL encoder
    # sees the controls), see encode_captions.dropout_rows
    return (checks.max_tokens(cfg, PIPELINE_MAX_SEQUENCE_LENGTH, "QwenImageEditPlusPipeline's limit; the control "
                              "images' vision tokens count too")
            + checks.bucket_step_multiple(cfg, 2, "latents are packed in 2x2 patches"))
