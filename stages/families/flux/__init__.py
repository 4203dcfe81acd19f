"""FLUX.1 (dev and schnell). The protocol class is in `family.py`; this file holds what is known
without torch: the config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from stages.families.common.flux1_checks import T5_MAX_TOKENS, config_errors  # noqa: F401 - FLUX.1's, as Kontext's

DEMO_VARIANT = "flux-dev"  # the tiny pipeline (stages/families/flux/tiny.py) the demo and tests build
DEMO_CONFIG = "demo.toml"
