"""Qwen-Image-Edit-2511: Qwen-Image-Edit-Plus whose transformer has `zero_cond_t` set. The protocol class
is in `family.py`; this file holds what is known without torch: the config checks and the demo's hints."""

from __future__ import annotations

from stages.families.common.qwen_image_edit_checks import (  # noqa: F401 - the family's torch-free facts
    DEMO_EDIT_SIZES, PIPELINE_MAX_SEQUENCE_LENGTH, config_errors)

DEMO_VARIANT = "qwen-image-edit-2511"  # the tiny random-weight pipeline (stages/families/qwen_image_edit_2511/tiny.py) the tests build
DEMO_MODEL_VARIANT = "qwen-image-edit-2511-edit"  # the demo's: its base reproduces the control, so the LoRA visibly learns the edit
DEMO_CONFIG = "demo-qwen-image-edit-2511.toml"
DEMO_DATA = "edit"
