"""Qwen-Image-Edit-Plus's tiny random-weight pipeline, "qwen-image-edit": the tiny Qwen-Image
components (stages/families/qwen_image/tiny.py; Qwen-Image-Edit-2509 ships Qwen-Image's
architecture) plus the Qwen2-VL processor the Plus pipeline feeds the control images through.
The processor is the video-less stand-in of `processor.py` (see there why); its image processor
keeps Qwen2-VL's defaults (patch 14, merge 2, temporal patch 2), which the tiny vision tower matches."""

from __future__ import annotations

from typing import Any

from stages.families.qwen_image import tiny as qwen_tiny

PIPELINE_CLASS = "QwenImageEditPlusPipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
TINY_DIMS: dict[str, dict[str, Any]] = {"qwen-image-edit": qwen_tiny.TINY_DIMS["qwen-image"]}


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from transformers import Qwen2VLImageProcessorPil

    from stages.families.qwen_image_edit.processor import Qwen2VLImageProcessorOnly

    components = qwen_tiny.build_components("qwen-image", seed)
    components["processor"] = Qwen2VLImageProcessorOnly(Qwen2VLImageProcessorPil(), components["tokenizer"])
    return components
