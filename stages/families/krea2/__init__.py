"""Krea 2. The protocol class is in `family.py`; this file holds what is known without torch: the
config checks run before any model loads, and the demo's hints.

Krea2Pipeline has no upper token limit (it checks only max_sequence_length > 0); its text block
ends with 5 template suffix tokens, so at least one caption token needs max_sequence_length >= 6."""

from __future__ import annotations

from typing import Any

from stages.families import checks

SUFFIX_TOKENS = 5  # Krea2Pipeline.prompt_template_encode_num_suffix_tokens
DEMO_VARIANT = "krea2"
DEMO_CONFIG = "demo-krea2.toml"


def config_errors(cfg: Any) -> list[str]:
    n = cfg.captions.max_sequence_length
    short = []
    if n <= SUFFIX_TOKENS:
        short = [f"'captions.max_sequence_length' = {n} leaves no caption token: Krea2Pipeline's text block ends "
                 f"with {SUFFIX_TOKENS} template tokens; set it to {SUFFIX_TOKENS + 1} or more (the pipeline uses 512)"]
    return short + checks.bucket_step_multiple(cfg, 2, "latents are packed in 2x2 patches")
