"""Ideogram 4. The protocol class is in `family.py`; this file holds what is known without torch: the
config checks run before any model loads, and the demo's hints.

Ideogram4Pipeline refuses a prompt longer than its max_sequence_length (2048 by default) rather than cutting
it; 2048 is the longest caption the model was released to read, so it is the limit here too. Captions are
used as written: the pipeline's optional prompt enhancer (`upsample_prompt`) is never loaded or run."""

from __future__ import annotations

from typing import Any

from stages.families import checks

PIPELINE_MAX_SEQUENCE_LENGTH = 2048  # Ideogram4Pipeline.__call__'s default max_sequence_length
DEMO_VARIANT = "ideogram4"  # the tiny pipeline (stages/families/ideogram4/tiny.py) the demo and tests build
DEMO_CONFIG = "demo-ideogram4.toml"

# What the libraries print that is no news: the pipeline's text encoding calls transformers' causal-mask helper
# and decoder layers with the `past_key_values` keyword that transformers deprecates.
LIBRARY_WARNINGS = ((r"`past_key_values` is deprecated", "FutureWarning", r"(diffusers|transformers)\."),)


def config_errors(cfg: Any) -> list[str]:
    return (checks.max_tokens(cfg, PIPELINE_MAX_SEQUENCE_LENGTH, "Ideogram4Pipeline's default max_sequence_length, "
                              "chat template included")
            + checks.bucket_step_multiple(cfg, 2, "latents are patchified 2x2"))
