"""FLUX.1-dev at full size for bench/, which `flux` and `flux-kontext` share (their `full.py`): the
released config.json values, what the bench runs with, and the denoiser's attention FLOPs and
meta-device call. FLUX.2's double/single-block layout has the same attention FLOPs."""

from __future__ import annotations

from typing import Any

from stages.families.full_parts import CLIP_L, FLUX_VAE, clip, diffusers_model

TEXT_PRECISION = "nf4"  # of the captions every bench train run reads
BUILD_SECONDS = 70  # build + save on the H200 (measured)
TEXT_IN_SEQUENCE = True  # text tokens join the image tokens in the denoiser's sequence

TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                   guidance_embeds=True, axes_dims_rope=(16, 56, 56))
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
              layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu", tie_word_embeddings=False)


def t5(tok: Any) -> Any:
    """A full-size T5-XXL encoder with the tokenizer's special ids: FLUX.1's text_encoder_2, Chroma's text_encoder."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**T5_XXL, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                   decoder_start_token_id=tok.pad_token_id))


COMPONENTS = {
    "transformer": diffusers_model("FluxTransformer2DModel", TRANSFORMER),
    "vae": diffusers_model("AutoencoderKL", FLUX_VAE),
    "text_encoder": lambda c: clip(c["tokenizer"], CLIP_L, projection=False),
    "text_encoder_2": lambda c: t5(c["tokenizer_2"]),
}


def attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    """4 * S^2 * inner_dim per joint-attention layer (double and single blocks), S = image + text tokens."""
    layers, inner = cfg.num_layers + cfg.num_single_layers, cfg.num_attention_heads * cfg.attention_head_dim
    return 4.0 * (img + txt) ** 2 * inner * layers * batch


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    cfg, img = model.config, (h // 2) * (w // 2)
    return model(hidden_states=empty(b, img, cfg.in_channels), encoder_hidden_states=empty(b, txt, cfg.joint_attention_dim),
                 pooled_projections=empty(b, cfg.pooled_projection_dim), timestep=empty(b), img_ids=empty(img, 3),
                 txt_ids=empty(txt, 3), guidance=empty(b, fp32=True), return_dict=False)
