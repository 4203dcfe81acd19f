"""Chroma's tiny random-weight pipeline, "chroma" (stages.tiny builds and saves it).

FLUX.1's tiny T5 and VAE (scaling_factor 0.3611, shift_factor 0.1159, no quant convs) with a
ChromaTransformer2DModel of one double and one single block. Its "approximator" (the MLP that turns
the timestep into every block's modulation) is 16 wide: `approximator_num_channels` / 4 is the width
of each sinusoidal embedding (timestep, guidance 0, modulation index), so it must be a multiple of 4.
The scheduler is FLUX.1-schnell's (static shift 1.0), the checkpoint Chroma was trained from.
"""

from __future__ import annotations

from typing import Any

from stages.families.common.flux1_tiny import t5_encoder
from stages.tiny.parts import (FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, HEAD_DIM, HEADS, ROPE_AXES, T5_DMODEL,
                               seeded, vae_kl)

PIPELINE_CLASS = "ChromaPipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
TINY_DIMS: dict[str, dict[str, Any]] = {"chroma": {
    "latent_channels": 16, "vae_scale_factor": 2, "image_multiple": 4,
    "text_hidden": {"text_encoder": T5_DMODEL},
    "max_sequence_length": {"tokenizer": 512},
    "transformer_in_channels": 64,
}}


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    from stages.tiny.tokenizers import build_t5_tokenizer

    tokenizer = build_t5_tokenizer()
    vae = seeded(seed, lambda: vae_kl(16, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, quant_convs=False))
    transformer = seeded(seed, lambda: ChromaTransformer2DModel(
        patch_size=1,
        in_channels=4 * vae.config.latent_channels,  # 2x2 packing
        num_layers=1,  # double-stream blocks
        num_single_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=T5_DMODEL,
        axes_dims_rope=ROPE_AXES,
        approximator_num_channels=16,  # real 64
        approximator_hidden_dim=32,  # real 5120
        approximator_layers=1,  # real 5
    ).eval())
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False),
        "vae": vae,
        "text_encoder": seeded(seed, lambda: t5_encoder(tokenizer)),
        "tokenizer": tokenizer,
        "transformer": transformer,
    }
