"""Wan 2.2 T2V-A14B at full size for bench/ (bench/full_configs.py builds it): the released architecture, what the
bench runs with, and the denoiser's attention FLOPs and meta-device call.

Where the numbers come from (no download is possible here): Wan-AI/Wan2.2-T2V-A14B-Diffusers, transformer/config.json
and transformer_2/config.json (the same architecture, each expert its own weights: 40 blocks of 40 x 128 heads, ffn
13824, 16 in/out channels, patch (1, 2, 2), text_dim 4096, freq_dim 256; Wan's own t2v_A14B config: dim 5120,
num_heads 40, num_layers 40, ffn_dim 13824), vae/config.json (AutoencoderKLWan, the Wan 2.1 VAE: base_dim 96, z_dim 16,
dim_mult [1, 2, 4, 4], temperal_downsample [False, True, True], the class defaults' latents_mean / latents_std),
text_encoder/config.json (google umt5-xxl's encoder, as TI2V-5B's), model_index.json (boundary_ratio 0.875) and the
scheduler (UniPC, flow_shift 3.0). Each row's tokens are one clip's: (frames - 1) / 4 + 1 latent frames of
(H / 16) x (W / 16) tokens, with the 512 caption tokens in cross-attention only (not in the sequence). The saved
pipeline is ~69 GB in bf16 (two 28.6 GB experts and the 11.4 GB text encoder): more than the one-GPU machine's disk.
"""

from __future__ import annotations

from typing import Any

from stages.families.full_parts import diffusers_model

PRESET = "configs/wan2.2-14b.toml"
TEXT_PRECISION = "bf16"  # umT5-XXL encoder: 5.7B parameters, 11.4 GB in bf16
BUILD_SECONDS = 150  # estimate: two 14B experts + umT5-XXL, about 2.5x TI2V-5B's estimated build
TRAIN_SECONDS = 150  # estimate: a compiled 480p 33-frame item on the H200 with one 14B expert (load, compile, 8 steps)
TEXT_IN_SEQUENCE = False  # cross-attention: the caption is not part of the self-attention sequence
BASE_PRECISIONS = ("nf4", "fp8")

TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
                   text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
           temperal_downsample=[False, True, True], dropout=0.0)
UMT5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, relative_attention_num_buckets=32,
                relative_attention_max_distance=128, feed_forward_proj="gated-gelu", vocab_size=256384,
                layer_norm_epsilon=1e-6, tie_word_embeddings=False)


def _vae(_: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(**VAE)  # latents_mean / latents_std: the class defaults, Wan 2.1's statistics


def _umt5(tok: Any) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(**UMT5_XXL, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                       decoder_start_token_id=tok.pad_token_id))


COMPONENTS = {
    "transformer": diffusers_model("WanTransformer3DModel", TRANSFORMER),
    "transformer_2": diffusers_model("WanTransformer3DModel", TRANSFORMER),
    "vae": _vae,
    "text_encoder": lambda c: _umt5(c["tokenizer"]),
}


def attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    """Per block: 4 * S^2 * inner_dim of self-attention over the S clip tokens, plus 4 * S * txt * inner_dim of
    cross-attention to the caption (one expert: each step runs one)."""
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    return 4.0 * (img * img + img * txt) * inner * cfg.num_layers * batch


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    """One latent frame of an h x w latent (the bench's image rows), one timestep per sample."""
    cfg = model.config
    return model(hidden_states=empty(b, cfg.in_channels, 1, h, w), timestep=empty(b),
                 encoder_hidden_states=empty(b, txt, cfg.text_dim), return_dict=False)
