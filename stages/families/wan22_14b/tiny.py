"""Wan 2.2 T2V-A14B's tiny random-weight pipeline, "wan2.2-14b" (stages.tiny builds and saves it): the parts of
`stages.families.common.wan_tiny` in a WanPipeline with two experts (`transformer` for high noise, `transformer_2`
for low noise, different weights), `boundary_ratio` 0.875 and one timestep per sample, as the release's
model_index.json sets them, over the Wan 2.1 VAE's 16 channels."""

from __future__ import annotations

from typing import Any

from stages.tiny.parts import T5_DMODEL

PIPELINE_CLASS = "WanPipeline"
PIPELINE_EXTRA: dict[str, Any] = {"expand_timesteps": False, "boundary_ratio": 0.875}
TINY_DIMS: dict[str, dict[str, Any]] = {"wan2.2-14b": {
    "latent_channels": 16, "vae_scale_factor": 8, "image_multiple": 16, "temporal_scale_factor": 4,
    "text_hidden": {"text_encoder": T5_DMODEL},
    "max_sequence_length": {"tokenizer": 512},
    "transformer_in_channels": 16,
}}


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import UniPCMultistepScheduler

    from stages.families.common.wan_tiny import WAN22_A14B_SCHEDULER, umt5_encoder, wan21_vae, wan_transformer
    from stages.tiny.parts import seeded
    from stages.tiny.tokenizers import build_t5_tokenizer

    tokenizer = build_t5_tokenizer()
    return {
        "tokenizer": tokenizer,
        "text_encoder": seeded(seed, lambda: umt5_encoder(tokenizer)),
        "vae": wan21_vae(seed),
        "scheduler": UniPCMultistepScheduler(**WAN22_A14B_SCHEDULER),
        "transformer": wan_transformer(seed, 16),
        "transformer_2": wan_transformer(seed + 1, 16),
    }
