"""Qwen-Image-Edit-Plus (2509): the family class of `stages.families.common.qwen_image_edit` (whose
docstring says what was checked against diffusers)."""

from __future__ import annotations

from stages.families.common.qwen_image_edit import QwenImageEdit

__all__ = ["QwenImageEdit"]
