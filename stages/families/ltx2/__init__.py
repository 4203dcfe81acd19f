"""LTX-2 (Lightricks), text-to-video. The protocol class is in `family.py`; this file holds what is known
without torch: the config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from typing import Any

from stages.families import checks

GEMMA_MAX_TOKENS = 1024  # LTX2Pipeline's max_sequence_length default, what LTX-2 was trained with
FRAMES_PER_LATENT = 8  # the VAE's temporal_compression_ratio: clips are 8k + 1 frames
FRAME_RATE = 24.0  # LTX2Pipeline's frame_rate default: the rate the video positions are scaled by, here and in sample
DEMO_VARIANT = "ltx2"
DEMO_CONFIG = "demo-ltx2.toml"
DEMO_DATA = "clips"  # drawn moving-shape clips (stages/tiny/shapes.py make_clip_dataset)


def config_errors(cfg: Any) -> list[str]:
    errors = checks.max_tokens(cfg, GEMMA_MAX_TOKENS, "LTX2Pipeline's caption length")
    errors += checks.bucket_step_multiple(cfg, 32, "the VAE's latent cell is 32 px")
    errors += checks.clip_frames(cfg, FRAMES_PER_LATENT, "LTX-2's VAE")
    for i, data in enumerate(cfg.dataset_configs()):
        key = f"datasets[{i}]" if cfg.datasets else "data"
        if data.fps not in (0, FRAME_RATE):
            errors.append(f"{key}.fps = {data.fps:g}: LTX-2 trains here at {FRAME_RATE:g} fps, the rate LTX2Pipeline "
                          f"samples at; set it to {FRAME_RATE:g} (or 0: the clips' own frames)")
    if not cfg.train.dynamic_shift:
        errors.append("train.dynamic_shift = false: LTX-2's scheduler shifts its sigmas by the clip's token count "
                      "(use_dynamic_shifting); set train.dynamic_shift = true to train at the noise levels it samples")
    return errors
