"""Qwen-Image-Edit-Plus (2509: 1-3 control images). The protocol class is in `family.py`; this file
holds what is known without torch: the config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from typing import Any

from stages.families import checks

PIPELINE_MAX_SEQUENCE_LENGTH = 1024  # QwenImageEditPlusPipeline.check_inputs refuses longer
DEMO_VARIANT = "qwen-image-edit"  # the tiny random-weight pipeline (stages/families/qwen_image_edit/tiny.py) the tests build
DEMO_MODEL_VARIANT = "qwen-image-edit-edit"  # the demo's: its base reproduces the control, so the LoRA visibly learns the edit
DEMO_CONFIG = "demo-qwen-image-edit.toml"
DEMO_DATA = "edit"
# Square pairs: the pipeline sizes a control to its own aspect over the target's area in multiples of 32
# (calculate_dimensions), so at 64 px only a square control lines up token for token with its target,
# which the demo model's copy of the control needs.
DEMO_EDIT_SIZES = ((64, 64),)


# What QwenImageEditPlusPipeline prints that is no news: the sample stage renders without a negative
# prompt, so the pipeline's true CFG is off by design.
LIBRARY_NOTICES = {"diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus":
                   ("but classifier-free guidance is not enabled since no negative_prompt",)}

def config_errors(cfg: Any) -> list[str]:
    # caption dropout is allowed: its empty caption is cached once per control set (the VL encoder
    # sees the controls), see encode_captions.dropout_rows
    return (checks.max_tokens(cfg, PIPELINE_MAX_SEQUENCE_LENGTH, "QwenImageEditPlusPipeline's limit; the control "
                              "images' vision tokens count too")
            + checks.bucket_step_multiple(cfg, 2, "latents are packed in 2x2 patches"))
