"""Qwen-Image-Edit-Plus's tiny pipelines (stages/families/common/qwen_image_edit_tiny.py): "qwen-image-edit",
the tests' random-weight model, and "qwen-image-edit-edit", the edit demo's (its base reproduces the control)."""

from __future__ import annotations

from typing import Any

from stages.families.common import qwen_image_edit_tiny as edit_tiny

PIPELINE_CLASS = edit_tiny.PIPELINE_CLASS
PIPELINE_EXTRA = edit_tiny.PIPELINE_EXTRA
TINY_DIMS: dict[str, dict[str, Any]] = {"qwen-image-edit": edit_tiny.DIMS, "qwen-image-edit-edit": edit_tiny.DIMS}


def build_components(variant: str, seed: int) -> dict[str, Any]:
    return edit_tiny.build_components(variant == "qwen-image-edit-edit", seed)
