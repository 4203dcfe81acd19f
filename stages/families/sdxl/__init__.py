"""SDXL. The protocol class is in `family.py`; this file holds what is known without torch: the
config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from typing import Any

from stages.families import checks

CLIP_TOKENS = 77  # both CLIP tokenizers' model_max_length
DEMO_VARIANT = "sdxl"
DEMO_CONFIG = "demo-sdxl.toml"


def config_errors(cfg: Any) -> list[str]:
    # The UNet attends to all 77 positions (no mask), so captions must be padded exactly as the
    # pipeline pads them at inference; a different length would train on other inputs.
    return (checks.exact_tokens(cfg, CLIP_TOKENS, "its CLIP encoders; longer captions are truncated")
            + checks.no_nf4_text_encoder(cfg, "its two CLIP encoders need ~1.6 GB in bf16")
            + checks.flow_only_defaults(cfg, "trains DDPM timesteps (min-SNR weighted by train.snr_gamma)"))
