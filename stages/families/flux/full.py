"""FLUX.1-dev at full size for bench/ (bench/full_configs.py builds it): `stages.families.common.flux1_full`
with the preset the bench runs."""

from __future__ import annotations

from stages.families.common.flux1_full import (BUILD_SECONDS, COMPONENTS, T5_XXL, TEXT_IN_SEQUENCE,  # noqa: F401
                                               TEXT_PRECISION, TRANSFORMER, attention_flops, meta_forward)

PRESET = "configs/flux-dev.toml"
