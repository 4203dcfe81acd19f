"""FLUX.1's tiny random-weight pipelines, "flux-dev" and "flux-schnell" (stages.tiny builds and saves them
through `stages/families/flux/tiny.py`); FLUX.1 Kontext's tiny test model is "flux-dev"'s components.

Real config values kept: the VAE's scaling_factor 0.3611 and shift_factor 0.1159 without quant
convs; the schedulers of the released checkpoints' scheduler_config.json.
"""

from __future__ import annotations

from typing import Any

from stages.tiny.parts import (CLIP_HIDDEN, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, HEAD_DIM, HEADS,
                               ROPE_AXES, T5_DMODEL, clip_text, seeded, vae_kl)

PIPELINE_CLASS = "FluxPipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
_DIMS = {
    "latent_channels": 16, "vae_scale_factor": 2, "image_multiple": 4,
    "text_hidden": {"text_encoder": CLIP_HIDDEN, "text_encoder_2": T5_DMODEL},
    "max_sequence_length": {"tokenizer": 77, "tokenizer_2": 512},
    "transformer_in_channels": 64,
}
TINY_DIMS: dict[str, dict[str, Any]] = {"flux-dev": {**_DIMS, "guidance_embeds": True},
                                        "flux-schnell": {**_DIMS, "guidance_embeds": False}}


def t5_encoder(tokenizer: Any) -> Any:
    """A tiny T5 v1.1 encoder (gated GELU, as T5-XXL) with the tokenizer's special ids: FLUX.1's
    text_encoder_2, Chroma's text_encoder."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=T5_DMODEL,
        d_kv=8,
        d_ff=T5_DMODEL * 2,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",  # T5 v1.1, as FLUX's T5-XXL
        tie_word_embeddings=False,
        dropout_rate=0.1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5EncoderModel(config).eval()


def _scheduler(variant: str) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    if variant == "flux-dev":
        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
            max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
        )
    # FLUX.1-schnell ships shift=1.0 without dynamic shifting (timestep-distilled, 1-4 steps).
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, base_shift=0.5,
        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
    )


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import FluxTransformer2DModel

    from stages.tiny.tokenizers import build_clip_tokenizer, build_t5_tokenizer

    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer()
    vae = seeded(seed, lambda: vae_kl(16, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, quant_convs=False))
    transformer = seeded(seed, lambda: FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * vae.config.latent_channels,  # 2x2 packing
        out_channels=None,
        num_layers=1,  # double-stream (MM-DiT) blocks
        num_single_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=T5_DMODEL,
        pooled_projection_dim=CLIP_HIDDEN,
        guidance_embeds=TINY_DIMS[variant]["guidance_embeds"],
        axes_dims_rope=ROPE_AXES,
    ).eval())
    return {
        "scheduler": _scheduler(variant),
        "vae": vae,
        "text_encoder": seeded(seed, lambda: clip_text(tokenizer, CLIP_HIDDEN, False, "quick_gelu")),
        "tokenizer": tokenizer,
        "text_encoder_2": seeded(seed, lambda: t5_encoder(tokenizer_2)),
        "tokenizer_2": tokenizer_2,
        "transformer": transformer,
    }
