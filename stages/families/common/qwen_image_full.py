"""Qwen-Image at full size for bench/, which `qwen-image` and the Qwen-Image-Edit families share (their `full.py`;
Krea 2 takes its VAE): the released config.json values, what the bench runs with, and the denoiser's
attention FLOPs and meta-device call."""

from __future__ import annotations

from typing import Any

from stages.families.full_parts import diffusers_model

TEXT_PRECISION = "nf4"
BUILD_SECONDS = 100
TEXT_IN_SEQUENCE = True

TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                   axes_dims_rope=(16, 56, 56))
VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
           temperal_downsample=[False, True, True], dropout=0.0)
QWEN2_5_VL_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                          num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                          rms_norm_eps=1e-6, tie_word_embeddings=False,
                          rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0})
QWEN2_5_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                            fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14,
                            spatial_merge_size=2, temporal_patch_size=2, in_chans=3, hidden_act="silu")


def _qwen2_5_vl(tok: Any) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tok.convert_tokens_to_ids
    special = {"bos_token_id": ids("<|endoftext|>"), "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={**QWEN2_5_VL_7B_TEXT, **special}, vision_config=QWEN2_5_VL_7B_VISION,
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False, **special))


def _vae(_: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKLQwenImage

    from stages.families.common.qwen_image_tiny import LATENTS_MEAN, LATENTS_STD

    return AutoencoderKLQwenImage(**VAE, latents_mean=list(LATENTS_MEAN), latents_std=list(LATENTS_STD))


COMPONENTS = {
    "transformer": diffusers_model("QwenImageTransformer2DModel", TRANSFORMER),
    "vae": _vae,
    "text_encoder": lambda c: _qwen2_5_vl(c["tokenizer"]),
}


def attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    """4 * S^2 * inner_dim per joint-attention layer, S = image + text tokens."""
    return 4.0 * (img + txt) ** 2 * cfg.num_attention_heads * cfg.attention_head_dim * cfg.num_layers * batch


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    cfg = model.config
    return model(hidden_states=empty(b, (h // 2) * (w // 2), cfg.in_channels),
                 encoder_hidden_states=empty(b, txt, cfg.joint_attention_dim), encoder_hidden_states_mask=None,
                 timestep=empty(b), img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False)


def edit_attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    """The edit families' (`qwen-image-edit`, `qwen-image-edit-2511`): target + one control in the sequence."""
    return attention_flops(cfg, batch, 2 * img, txt)


def edit_meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    """The edit families' call: the target's tokens, then one control's at the target's size."""
    cfg = model.config
    return model(hidden_states=empty(b, 2 * (h // 2) * (w // 2), cfg.in_channels),
                 encoder_hidden_states=empty(b, txt, cfg.joint_attention_dim), encoder_hidden_states_mask=None,
                 timestep=empty(b), img_shapes=[[(1, h // 2, w // 2)] * 2] * b, return_dict=False)
