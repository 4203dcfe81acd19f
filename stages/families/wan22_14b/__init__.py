"""Wan 2.2 T2V-A14B. The protocol class is in `family.py`; this file holds what is known without torch: the
config checks run before any model loads, the experts and their boundary, and the demo's hints."""

from __future__ import annotations

from typing import Any

from stages.families import checks

UMT5_MAX_TOKENS = 512  # Wan's text_len; the pipeline's own default is 226
FRAMES_PER_LATENT = 4  # the Wan 2.1 VAE's scale_factor_temporal: clips are 4k + 1 frames
BOUNDARY_RATIO = 0.875  # model_index.json boundary_ratio: t >= 875 runs `transformer`, below it `transformer_2`
EXPERTS = ("high", "low")  # train.expert: the high-noise `transformer`, the low-noise `transformer_2` ("both": in this order)
DEMO_VARIANT = "wan2.2-14b"
DEMO_CONFIG = "demo-wan2.2-14b.toml"
DEMO_DATA = "clips"  # drawn moving-shape clips (stages/tiny/shapes.py make_clip_dataset)


def config_errors(cfg: Any) -> list[str]:
    errors = checks.max_tokens(cfg, UMT5_MAX_TOKENS, "Wan's umT5 text length")
    errors += checks.bucket_step_multiple(cfg, 2, "latents are patched 2x2 by the transformer")
    errors += checks.clip_frames(cfg, FRAMES_PER_LATENT, "Wan's VAE")
    t = cfg.train
    if t.expert not in (*EXPERTS, "both"):
        errors.append(f"train.expert = '{t.expert}': Wan 2.2 A14B has two experts; set train.expert = 'both' (one "
                      f"adapter each, in one run), 'high' (the high-noise transformer, sigma >= {BOUNDARY_RATIO}) or "
                      f"'low' (transformer_2, below it)")
    if t.dynamic_shift:
        errors.append("train.dynamic_shift = true: Wan's scheduler has a fixed flow_shift; set train.dynamic_shift = "
                      "false and train.shift to the shift you sample with")
    if (t.timestep_min, t.timestep_max) != (0.0, 1.0):
        errors.append(f"train.timestep_min/max = {t.timestep_min}/{t.timestep_max}: with Wan 2.2 A14B train.expert "
                      f"sets the timestep range (the expert's side of boundary {BOUNDARY_RATIO}); leave them 0 and 1")
    return errors
