"""Qwen-Image 2.1 at full size for bench/ (bench/full_configs.py builds it).

Sources of the numbers (no download is possible here):
- transformer: QwenImage21Transformer2DModel's constructor defaults in diffusers 0.42.1, which are the
  released configuration (32 single-stream blocks, 32 heads x 128, context_in_dim 4096 = Qwen3-VL-8B's
  hidden size, mlp_ratio 3, RoPE axes (16, 56, 56), unpatched 64-channel latents);
- VAE: AutoencoderKLQwenImage21's constructor defaults (z_dim 64, 16x spatial, RGBA in/out, and the
  64 per-channel latents_mean / latents_std, read from the signature rather than copied);
- text encoder: Qwen3-VL-8B-Instruct's published config.json (36 layers, hidden 4096, 32 heads,
  8 KV heads, head_dim 128, intermediate 12288, mrope_section [24, 20, 20] interleaved, theta 5e6;
  vision: 27 blocks of 1152, patch 16, deepstack at [8, 16, 24]).
"""

from __future__ import annotations

import inspect
from typing import Any

from stages.families.full_parts import diffusers_model

PRESET = "configs/qwen-image-2.1.toml"
TEXT_PRECISION = "nf4"
BUILD_SECONDS = 70  # estimate: 32 GB of bf16 safetensors (7.1B transformer + 8.8B Qwen3-VL); FLUX.1's 34 GB took 57-68 s
TRAIN_SECONDS = 65  # a compiled 512 px b1 train item on the H200 (load, regional compile, 8 steps): estimate from FLUX.1's 65-94 s, Z-Image's 66-84 s
TEXT_IN_SEQUENCE = True

TRANSFORMER = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
                   num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56),
                   causal_condition=True)
QWEN3_VL_8B_TEXT = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                            "mrope_section": [24, 20, 20], "mrope_interleaved": True})
QWEN3_VL_8B_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                          patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                          deepstack_visual_indexes=[8, 16, 24])


def released_vae_statistics() -> tuple[list[float], list[float]]:
    """AutoencoderKLQwenImage21's default latents_mean / latents_std (64 each): the released VAE's."""
    from diffusers import AutoencoderKLQwenImage21

    params = inspect.signature(AutoencoderKLQwenImage21.__init__).parameters
    return list(params["latents_mean"].default), list(params["latents_std"].default)


def qwen3_vl(tok: Any, text: dict[str, Any], vision: dict[str, Any]) -> Any:
    """A random-weight Qwen3VLForConditionalGeneration whose special ids are the tokenizer's."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = tok.convert_tokens_to_ids
    special = {"bos_token_id": ids("<|endoftext|>"), "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config={"vocab_size": len(tok), **text, **special}, vision_config=vision,
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False))


def _vae(_: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKLQwenImage21

    return AutoencoderKLQwenImage21()  # the constructor defaults are the released VAE


COMPONENTS = {
    "transformer": diffusers_model("QwenImage21Transformer2DModel", TRANSFORMER),
    "vae": _vae,
    "text_encoder": lambda c: qwen3_vl(c["processor"].tokenizer, QWEN3_VL_8B_TEXT, QWEN3_VL_8B_VISION),
}


def attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    """4 * S^2 * inner_dim per block over the joint sequence S = text + image tokens (an upper bound:
    the block-causal mask skips about half of the text-text products)."""
    return 4.0 * (img + txt) ** 2 * cfg.num_attention_heads * cfg.attention_head_dim * cfg.num_layers * batch


def image_tokens(h: int, w: int) -> int:
    """One token per latent pixel (16x VAE, no 2x2 packing): bench/full_configs.denoiser_flops' count."""
    return h * w


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    """The image-slot mask stays on the CPU (the model expands it by slot, which a meta tensor cannot
    size), so the per-token modulation rows it selects are picked on the meta device with it moved
    there: the FLOPs are the same."""
    from unittest import mock

    import torch
    from diffusers.models.transformers import transformer_qwenimage21 as module

    cfg = model.config
    img_mask = torch.cat([torch.zeros(b, txt, dtype=torch.bool), torch.ones(b, h * w // 4, dtype=torch.bool)], 1)
    select = module._select_modulation_rows
    with mock.patch.object(module, "_select_modulation_rows",
                           lambda params, mask: select(params, None if mask is None else mask.to(params.device))):
        return model(hidden_states=empty(b, h * w, cfg.in_channels), encoder_hidden_states=empty(b, txt, cfg.context_in_dim),
                     timestep=empty(b), img_shapes=[[(1, h, w)]] * b, img_mask=img_mask, return_dict=False)
