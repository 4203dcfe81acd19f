"""FLUX.1 Kontext (edit pairs). The protocol class is in `family.py`; this file holds what is known
without torch: the config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from stages.families.common.flux1_checks import config_errors  # noqa: F401 - FLUX.1's T5 limit and 2x2 packing

DEMO_VARIANT = "flux-kontext"  # the tiny random-weight pipeline (stages/families/flux_kontext/tiny.py) the tests build
DEMO_MODEL_VARIANT = "flux-kontext-edit"  # the demo's: its base reproduces the control, so the LoRA visibly learns the edit
DEMO_CONFIG = "demo-flux-kontext.toml"
DEMO_DATA = "edit"  # the demo draws edit pairs (stages.tiny.shapes.make_edit_dataset)
