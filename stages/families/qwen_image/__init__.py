"""Qwen-Image. The protocol class is in `family.py`; this file holds what is known without torch:
the config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from typing import Any

from stages.families import checks

PIPELINE_MAX_SEQUENCE_LENGTH = 1024  # QwenImagePipeline.check_inputs refuses longer
DEMO_VARIANT = "qwen-image"
DEMO_CONFIG = "demo-qwen-image.toml"


def config_errors(cfg: Any) -> list[str]:
    return (checks.max_tokens(cfg, PIPELINE_MAX_SEQUENCE_LENGTH, "QwenImagePipeline's limit after the 34 template "
                              "tokens are dropped")
            + checks.bucket_step_multiple(cfg, 2, "latents are packed in 2x2 patches"))
