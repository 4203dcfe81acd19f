"""FLUX.1 Kontext's tiny random-weight pipeline, "flux-kontext": the tiny FLUX.1-dev components
(stages/families/flux/tiny.py) in a FluxKontextPipeline, as FLUX.1-Kontext-dev ships FLUX.1-dev's
architecture (guidance embedding, same VAE and text encoders)."""

from __future__ import annotations

from typing import Any

from stages.families.flux import tiny as flux_tiny

PIPELINE_CLASS = "FluxKontextPipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
TINY_DIMS: dict[str, dict[str, Any]] = {"flux-kontext": flux_tiny.TINY_DIMS["flux-dev"]}


def build_components(variant: str, seed: int) -> dict[str, Any]:
    return flux_tiny.build_components("flux-dev", seed)
