"""FLUX.2 [dev]. The protocol class is in `family.py`; this file holds what is known without torch:
the config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from typing import Any

from stages.families import checks

# Flux2Pipeline.tokenizer_max_length and encode_prompt's default max_sequence_length, system message
# included. Every caption is padded to this length and the transformer attends to the padding.
PIPELINE_MAX_SEQUENCE_LENGTH = 512
DEMO_VARIANT = "flux2-dev"  # the tiny pipeline (stages/families/flux2/tiny.py) the demo and tests build
DEMO_CONFIG = "demo-flux2.toml"


def config_errors(cfg: Any) -> list[str]:
    return (checks.max_tokens(cfg, PIPELINE_MAX_SEQUENCE_LENGTH, "Flux2Pipeline's tokenizer_max_length, "
                              "system message included")
            + checks.bucket_step_multiple(cfg, 2, "latents are patchified 2x2"))
