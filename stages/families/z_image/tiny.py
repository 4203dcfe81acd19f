"""Z-Image's tiny random-weight pipeline, "z-image" (stages.tiny builds and saves it).

FLUX's VAE (scaling_factor 0.3611, shift_factor 0.1159); `cap_feat_dim` = the Qwen3 hidden size;
the tokenizer carries a chat template (the pipeline calls apply_chat_template(enable_thinking=True)).
"""

from __future__ import annotations

from typing import Any

from stages.tiny.parts import (FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, HEAD_DIM, HEADS, QWEN_HIDDEN,
                               ROPE_AXES, qwen3_text, seeded, vae_kl)

PIPELINE_CLASS = "ZImagePipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
TINY_DIMS: dict[str, dict[str, Any]] = {"z-image": {
    "latent_channels": 16, "vae_scale_factor": 2, "image_multiple": 4,
    "text_hidden": {"text_encoder": QWEN_HIDDEN},
    "max_sequence_length": {"tokenizer": 512},  # pipeline default; chat template included
    "transformer_in_channels": 16,
}}


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    from stages.tiny.tokenizers import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer("qwen3")
    vae = seeded(seed, lambda: vae_kl(16, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, quant_convs=False))
    transformer = seeded(seed, lambda: ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=vae.config.latent_channels,
        dim=HEADS * HEAD_DIM,
        n_layers=1,
        n_refiner_layers=1,  # noise and context refiners: one block each
        n_heads=HEADS,
        n_kv_heads=HEADS,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=QWEN_HIDDEN,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=list(ROPE_AXES),
        axes_lens=[1536, 512, 512],
    ).eval())
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
        "vae": vae,
        # Z-Image reads hidden_states[-2]: 2 layers keep it a layer output
        "text_encoder": seeded(seed, lambda: qwen3_text(tokenizer, 2, causal_lm=False)),
        "tokenizer": tokenizer,
        "transformer": transformer,
    }
