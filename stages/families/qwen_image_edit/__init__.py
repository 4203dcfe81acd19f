"""Qwen-Image-Edit-Plus (2509: 1-3 control images). The protocol class is in `family.py`; this file
holds what is known without torch: the config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from stages.families.common.qwen_image_edit_checks import (  # noqa: F401 - the family's torch-free facts
    DEMO_EDIT_SIZES, PIPELINE_MAX_SEQUENCE_LENGTH, config_errors)

DEMO_VARIANT = "qwen-image-edit"  # the tiny random-weight pipeline (stages/families/qwen_image_edit/tiny.py) the tests build
DEMO_MODEL_VARIANT = "qwen-image-edit-edit"  # the demo's: its base reproduces the control, so the LoRA visibly learns the edit
DEMO_CONFIG = "demo-qwen-image-edit.toml"
DEMO_DATA = "edit"

# What QwenImageEditPlusPipeline prints that is no news (qwen-image-edit-2511 renders through it too): the
# sample stage renders without a negative prompt, so the pipeline's true CFG is off by design.
LIBRARY_NOTICES = {"diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus":
                   ("but classifier-free guidance is not enabled since no negative_prompt",)}
