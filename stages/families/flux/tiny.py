"""FLUX.1's tiny random-weight pipelines, "flux-dev" and "flux-schnell": `stages.families.common.flux1_tiny`."""

from __future__ import annotations

from stages.families.common.flux1_tiny import PIPELINE_CLASS, PIPELINE_EXTRA, TINY_DIMS, build_components  # noqa: F401
