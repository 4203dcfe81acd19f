"""FLUX.1's config checks, which `flux` and `flux-kontext` share (no torch: run before any model loads)."""

from __future__ import annotations

from typing import Any

from stages.families import checks

T5_MAX_TOKENS = 512  # FluxPipeline.check_inputs refuses max_sequence_length > 512 (FluxKontextPipeline too)


def config_errors(cfg: Any) -> list[str]:
    return (checks.max_tokens(cfg, T5_MAX_TOKENS, "FluxPipeline's T5 limit")
            + checks.bucket_step_multiple(cfg, 2, "latents are packed in 2x2 patches"))
