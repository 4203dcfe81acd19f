"""FLUX.2 [klein] (4B and 9B). The protocol class is in `family.py`; this file holds what is known
without torch: the config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from typing import Any

from stages.families import checks

# Flux2KleinPipeline.tokenizer_max_length: its default max_sequence_length, chat template included.
# Every caption is padded to this length and the transformer attends to the padding (no text mask).
PIPELINE_MAX_SEQUENCE_LENGTH = 512
DEMO_VARIANT = "flux2-klein"  # the tiny pipeline (stages/families/flux2_klein/tiny.py) the demo and tests build
DEMO_CONFIG = "demo-flux2-klein.toml"


def config_errors(cfg: Any) -> list[str]:
    return (checks.max_tokens(cfg, PIPELINE_MAX_SEQUENCE_LENGTH, "Flux2KleinPipeline's tokenizer_max_length, "
                              "chat template included")
            + checks.bucket_step_multiple(cfg, 2, "latents are patchified 2x2"))
