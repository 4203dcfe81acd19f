"""Z-Image (Turbo and base). The protocol class is in `family.py`; this file holds what is known
without torch: the config checks run before any model loads, and the demo's hints.

No token limit is checked: ZImagePipeline has none (512 is its default, chat template included)."""

from __future__ import annotations

from typing import Any

from stages.families import checks

DEMO_VARIANT = "z-image"
DEMO_CONFIG = "demo-z-image.toml"


def config_errors(cfg: Any) -> list[str]:
    return checks.bucket_step_multiple(cfg, 2, "the transformer patches latents 2x2")
