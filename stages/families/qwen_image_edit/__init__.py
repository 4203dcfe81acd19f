"""Qwen-Image-Edit-Plus (2509: 1-3 control images). The protocol class is in `family.py`; this file
holds what is known without torch: the config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from typing import Any

from stages.families import checks

PIPELINE_MAX_SEQUENCE_LENGTH = 1024  # QwenImageEditPlusPipeline.check_inputs refuses longer
DEMO_VARIANT = "qwen-image-edit"
DEMO_CONFIG = "demo-qwen-image-edit.toml"
DEMO_DATA = "edit"


def config_errors(cfg: Any) -> list[str]:
    dropout = [f"'{key}.caption_dropout' = {d.caption_dropout}" for key, d in _datasets(cfg) if d.caption_dropout > 0]
    refused = [f"{', '.join(dropout)}: qwen-image-edit's text conditioning depends on each item's control images, "
               f"so an empty caption is a row per item, which is not cached yet; set it to 0"] if dropout else []
    return refused + (checks.max_tokens(cfg, PIPELINE_MAX_SEQUENCE_LENGTH, "QwenImageEditPlusPipeline's limit; the control "
                              "images' vision tokens count too")
            + checks.bucket_step_multiple(cfg, 2, "latents are packed in 2x2 patches"))


def _datasets(cfg: Any) -> list[tuple[str, Any]]:
    """(config key, DataConfig) of [data] or of each [[datasets]] table."""
    if getattr(cfg, "datasets", None):
        return [(f"datasets[{i}]", d) for i, d in enumerate(cfg.dataset_configs())]
    return [("data", cfg.data)]
