"""Wan 2.2 TI2V-5B. The protocol class is in `family.py`; this file holds what is known without torch: the
config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from typing import Any

from stages.families import checks

UMT5_MAX_TOKENS = 512  # Wan's text_len; the pipeline's own default is 226
FRAMES_PER_LATENT = 4  # the VAE's scale_factor_temporal: clips are 4k + 1 frames
DEMO_VARIANT = "wan2.2-5b"
DEMO_CONFIG = "demo-wan2.2-5b.toml"
DEMO_DATA = "clips"  # drawn moving-shape clips (stages/tiny/shapes.py make_clip_dataset)


def config_errors(cfg: Any) -> list[str]:
    errors = checks.max_tokens(cfg, UMT5_MAX_TOKENS, "Wan's umT5 text length")
    errors += checks.bucket_step_multiple(cfg, 2, "latents are patched 2x2 by the transformer")
    errors += checks.clip_frames(cfg, FRAMES_PER_LATENT, "Wan's VAE")
    if cfg.train.dynamic_shift:
        errors.append("train.dynamic_shift = true: Wan's scheduler has a fixed flow_shift (5.0 for TI2V-5B); set "
                      "train.dynamic_shift = false and train.shift to the shift you sample with")
    return errors
