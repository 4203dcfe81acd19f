"""Qwen-Image. The protocol class is in `family.py`; this file holds what is known without torch:
the config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from typing import Any

from stages.families import checks

PIPELINE_MAX_SEQUENCE_LENGTH = 1024  # QwenImagePipeline.check_inputs refuses longer
DEMO_VARIANT = "qwen-image"
DEMO_CONFIG = "demo-qwen-image.toml"


# What QwenImagePipeline prints that is no news: the sample stage renders without a negative prompt, so
# the pipeline's true CFG is off by design.
LIBRARY_NOTICES = {"diffusers.pipelines.qwenimage.pipeline_qwenimage":
                   ("but classifier-free guidance is not enabled since no negative_prompt",)}

def config_errors(cfg: Any) -> list[str]:
    return (checks.max_tokens(cfg, PIPELINE_MAX_SEQUENCE_LENGTH, "QwenImagePipeline's limit after the 34 template "
                              "tokens are dropped")
            + checks.bucket_step_multiple(cfg, 2, "latents are packed in 2x2 patches"))
