"""Config checks that families share, made from the config alone (no torch, no model loaded).

Each returns a list of messages naming the key, its value and the valid range; a family's
`config_errors` adds up the ones that apply to it.
"""

from __future__ import annotations

from typing import Any


def max_tokens(cfg: Any, limit: int, why: str) -> list[str]:
    """captions.max_sequence_length must not exceed what the family's pipeline accepts."""
    n = cfg.captions.max_sequence_length
    if n > limit:
        return [f"'captions.max_sequence_length' = {n} is above {cfg.family}'s limit of {limit} ({why}); "
                f"set it to 1..{limit}"]
    return []


def exact_tokens(cfg: Any, length: int, why: str) -> list[str]:
    """captions.max_sequence_length must be exactly the length the encoders always read."""
    n = cfg.captions.max_sequence_length
    if n != length:
        return [f"'captions.max_sequence_length' = {n}, but {cfg.family} always reads {length} tokens ({why}); "
                f"set it to {length}"]
    return []


def bucket_step_multiple(cfg: Any, multiple: int, why: str) -> list[str]:
    """data.bucket_step (0 = the family's own) must be a multiple of what every model of the family needs."""
    step = cfg.data.bucket_step
    if step and step % multiple:
        return [f"'data.bucket_step' = {step} is not a multiple of {multiple} ({why}); set it to a multiple of "
                f"{multiple}, or 0 for the model's own"]
    return []


def no_nf4_text_encoder(cfg: Any, why: str) -> list[str]:
    if cfg.captions.text_encoder_precision == "nf4":
        return [f"'captions.text_encoder_precision' = 'nf4' is not offered for {cfg.family} ({why}); "
                f"use 'auto', 'fp32' or 'bf16'"]
    return []


# train keys that act on flow-matching sigmas, with their defaults (which a DDPM family trains as it always has)
FLOW_ONLY = {"timestep_min": 0.0, "timestep_max": 1.0, "timestep_buckets": 0, "weighting_scheme": "none"}


def flow_only_defaults(cfg: Any, why: str) -> list[str]:
    """A family that does not train flow matching refuses the flow-only train keys away from their defaults."""
    return [f"'train.{key}' = {getattr(cfg.train, key)!r} applies to flow-matching families only, and {cfg.family} "
            f"{why}; remove it (train.loss and train.huber_c do apply)"
            for key, default in FLOW_ONLY.items() if getattr(cfg.train, key) != default]


def clip_frames(cfg: Any, per_latent: int, vae: str) -> list[str]:
    """Each dataset's data.frames, and sample.frames where set, must be k x per_latent + 1: a causal video VAE
    encodes the first frame alone, then per_latent frames into each latent frame."""
    errors = []
    for i, data in enumerate(cfg.dataset_configs()):
        if data.frames % per_latent != 1:
            key = f"datasets[{i}].frames" if cfg.datasets else "data.frames"
            low = (data.frames - 1) // per_latent * per_latent + 1
            errors.append(f"{key} = {data.frames}: {vae} takes {per_latent}k + 1 frames (the first alone, then "
                          f"{per_latent} per latent frame); set it to {low} or {low + per_latent}")
    frames = cfg.sample.frames  # 0: data.frames; else what the pipeline would round down without a word
    if frames and frames % per_latent != 1:
        low = (frames - 1) // per_latent * per_latent + 1
        errors.append(f"sample.frames = {frames}: {vae} renders {per_latent}k + 1 frames; set it to {low} or "
                      f"{low + per_latent}, or 0 for data.frames")
    return errors
