"""Tiny offline stand-ins for the real models and data: random-weight pipelines of the real
architectures (:mod:`.models`), tokenizers built from in-memory vocabularies (:mod:`.tokenizers`)
and a drawn-shapes caption data set (:mod:`.shapes`).

Importing this package is cheap: torch / diffusers / transformers load on first use.
"""

from __future__ import annotations

from typing import Any

from .models import build_tiny_components, build_tiny_pipeline
from .shapes import make_demo_dataset
from .tokenizers import build_clip_tokenizer, build_qwen_tokenizer, build_t5_tokenizer

__all__ = [
    "VARIANTS",
    "PIPELINE_CLASS_NAMES",
    "TINY_DIMS",
    "build_tiny_components",
    "build_tiny_pipeline",
    "make_demo_dataset",
    "build_clip_tokenizer",
    "build_t5_tokenizer",
    "build_qwen_tokenizer",
]


def __getattr__(name: str) -> Any:
    """VARIANTS, PIPELINE_CLASS_NAMES, TINY_DIMS: gathered from the family registry on first use."""
    from . import models

    return getattr(models, name)
