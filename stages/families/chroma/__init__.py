"""Chroma (Chroma1-HD, Chroma1-Base). The protocol class is in `family.py`; this file holds what is known
without torch: the config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from typing import Any

from stages.families import checks

T5_MAX_TOKENS = 512  # ChromaPipeline.check_inputs refuses max_sequence_length > 512
DEMO_VARIANT = "chroma"  # the tiny pipeline (stages/families/chroma/tiny.py) the demo and tests build
DEMO_CONFIG = "demo-chroma.toml"


# What diffusers prints that is no news: its own ChromaTransformer2DModel builds its RoPE through the
# import path it deprecates.
LIBRARY_WARNINGS = ((r"`FluxPosEmbed` is deprecated", "FutureWarning", r"diffusers\."),)

def config_errors(cfg: Any) -> list[str]:
    return (checks.max_tokens(cfg, T5_MAX_TOKENS, "ChromaPipeline's T5 limit")
            + checks.bucket_step_multiple(cfg, 2, "latents are packed in 2x2 patches"))
