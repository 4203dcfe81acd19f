"""Qwen-Image-Edit-2511's tiny pipelines (stages/families/common/qwen_image_edit_tiny.py), Qwen-Image-Edit's
with the transformer's `zero_cond_t` set: "qwen-image-edit-2511", the tests' random-weight model (the same
weights as "qwen-image-edit"'s), and "qwen-image-edit-2511-edit", the edit demo's (its base reproduces the
control)."""

from __future__ import annotations

from typing import Any

from stages.families.common import qwen_image_edit_tiny as edit_tiny

PIPELINE_CLASS = edit_tiny.PIPELINE_CLASS
PIPELINE_EXTRA = edit_tiny.PIPELINE_EXTRA
TINY_DIMS: dict[str, dict[str, Any]] = {"qwen-image-edit-2511": edit_tiny.DIMS,
                                        "qwen-image-edit-2511-edit": edit_tiny.DIMS}


def build_components(variant: str, seed: int) -> dict[str, Any]:
    return edit_tiny.build_components(variant == "qwen-image-edit-2511-edit", seed, zero_cond_t=True)
