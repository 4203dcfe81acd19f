"""Qwen-Image's tiny random-weight pipeline, "qwen-image" (stages.tiny builds and saves it through
`stages/families/qwen_image/tiny.py`); Qwen-Image-Edit's tiny test model and Krea 2's VAE statistics
are its.

Real config values kept: the Wan 2.1 VAE's per-channel latents_mean / latents_std, the scheduler of
Qwen/Qwen-Image's scheduler_config.json. AutoencoderKLQwenImage with dim_mult [1, 2] has one
temperal_downsample entry, and the pipeline's vae_scale_factor is 2 ** len(temperal_downsample) = 2.
The Qwen2.5-VL config's vision token ids are set to the tokenizer's special tokens.
"""

from __future__ import annotations

from typing import Any

from stages.tiny.parts import HEAD_DIM, HEADS, QWEN_HIDDEN, ROPE_AXES, seeded

PIPELINE_CLASS = "QwenImagePipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
TINY_DIMS: dict[str, dict[str, Any]] = {"qwen-image": {
    "latent_channels": 16, "vae_scale_factor": 2, "image_multiple": 4,
    "text_hidden": {"text_encoder": QWEN_HIDDEN},
    "max_sequence_length": {"tokenizer": 1024},  # after the 34 template tokens are dropped
    "transformer_in_channels": 64,
}}
# Wan 2.1 VAE statistics, used by Qwen-Image's AutoencoderKLQwenImage.
LATENTS_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]
LATENTS_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
]


def _qwen2_5_vl(tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": QWEN_HIDDEN,
            "intermediate_size": QWEN_HIDDEN * 2,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 128000,
            "rms_norm_eps": 1e-6,
            # mrope_section sums to head_dim / 2 (real [16, 24, 24] of 128)
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": QWEN_HIDDEN,
            "fullatt_block_indexes": [1],
            "window_size": 112,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    from stages.tiny.tokenizers import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer("qwen2.5-vl")
    vae = seeded(seed, lambda: AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=16,
        dim_mult=[1, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False],  # -> vae_scale_factor 2 ** 1
        dropout=0.0,
        latents_mean=list(LATENTS_MEAN),
        latents_std=list(LATENTS_STD),
    ).eval())
    transformer = seeded(seed, lambda: QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * vae.config.z_dim,
        out_channels=vae.config.z_dim,
        num_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=QWEN_HIDDEN,
        guidance_embeds=False,
        axes_dims_rope=ROPE_AXES,
    ).eval())
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
        max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return {
        "scheduler": scheduler,
        "vae": vae,
        "text_encoder": seeded(seed, lambda: _qwen2_5_vl(tokenizer)),
        "tokenizer": tokenizer,
        "transformer": transformer,
    }
