"""Wan 2.2 TI2V-5B's tiny random-weight pipeline, "wan2.2-5b" (stages.tiny builds and saves it): the
parts of `stages.families.common.wan_tiny` in a WanPipeline with `expand_timesteps` on, as the released
model_index.json sets it (TI2V: one timestep per latent token)."""

from __future__ import annotations

from typing import Any

from stages.tiny.parts import T5_DMODEL

PIPELINE_CLASS = "WanPipeline"
PIPELINE_EXTRA: dict[str, Any] = {"expand_timesteps": True, "transformer_2": None}
TINY_DIMS: dict[str, dict[str, Any]] = {"wan2.2-5b": {
    "latent_channels": 48, "vae_scale_factor": 8, "image_multiple": 16, "temporal_scale_factor": 4,
    "text_hidden": {"text_encoder": T5_DMODEL},
    "max_sequence_length": {"tokenizer": 512},
    "transformer_in_channels": 48,
}}


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import UniPCMultistepScheduler

    from stages.families.common.wan_tiny import WAN22_5B_SCHEDULER, umt5_encoder, wan22_vae, wan_transformer
    from stages.tiny.parts import seeded
    from stages.tiny.tokenizers import build_t5_tokenizer

    tokenizer = build_t5_tokenizer()
    vae = wan22_vae(seed)
    return {
        "tokenizer": tokenizer,
        "text_encoder": seeded(seed, lambda: umt5_encoder(tokenizer)),
        "vae": vae,
        "scheduler": UniPCMultistepScheduler(**WAN22_5B_SCHEDULER),
        "transformer": wan_transformer(seed, vae.config.z_dim),
    }
