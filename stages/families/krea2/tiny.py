"""Krea 2's tiny random-weight pipeline, "krea2" (stages.tiny builds and saves it).

Real config values kept: the Qwen-Image VAE's per-channel latents_mean / latents_std (Krea2Pipeline
decodes with the Qwen-Image VAE), and the scheduler settings the Krea2Pipeline docstring asks for
(`use_dynamic_shifting=True`, base_shift 0.5, max_shift 1.15, base_image_seq_len 256,
max_image_seq_len 6400). The Qwen3-VL text encoder has 3 decoder layers and the pipeline taps
hidden_states (1, 3) (real: 12 of Qwen3-VL-4B's 37, `(2, 5, ..., 35)`), so the transformer's
`num_text_layers` is 2 and a wrong tap shows. Its vision token ids are the tokenizer's special tokens.
"""

from __future__ import annotations

from typing import Any

from stages.tiny.parts import HEAD_DIM, HEADS, QWEN_HIDDEN, ROPE_AXES, seeded

SELECT_LAYERS = (1, 3)  # Krea2Pipeline(text_encoder_select_layers=...): indices into hidden_states
PIPELINE_CLASS = "Krea2Pipeline"
PIPELINE_EXTRA: dict[str, Any] = {"text_encoder_select_layers": SELECT_LAYERS, "is_distilled": False}
TINY_DIMS: dict[str, dict[str, Any]] = {"krea2": {
    "latent_channels": 16, "vae_scale_factor": 2, "image_multiple": 4,
    "text_hidden": {"text_encoder": QWEN_HIDDEN},
    "max_sequence_length": {"tokenizer": 512},  # Krea2Pipeline's fixed text length, after the 34 dropped
    "transformer_in_channels": 64,
}}


def _qwen3_vl(tokenizer: Any) -> Any:
    from transformers import Qwen3VLConfig, Qwen3VLModel

    ids = tokenizer.convert_tokens_to_ids
    special = {"bos_token_id": ids("<|endoftext|>"), "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": QWEN_HIDDEN,
            "intermediate_size": QWEN_HIDDEN * 2,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            # mrope_section sums to head_dim / 2 (real [24, 20, 20] of 128, interleaved)
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2],
                                "mrope_interleaved": True},
            "tie_word_embeddings": True,
            **special,
        },
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": QWEN_HIDDEN, "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    return Qwen3VLModel(config).eval()


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Transformer2DModel

    from stages.families.common.qwen_image_tiny import LATENTS_MEAN, LATENTS_STD
    from stages.tiny.tokenizers import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer("qwen3")
    vae = seeded(seed, lambda: AutoencoderKLQwenImage(
        base_dim=16, z_dim=16, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[False],  # -> vae_scale_factor 2 ** 1
        dropout=0.0, latents_mean=list(LATENTS_MEAN), latents_std=list(LATENTS_STD),
    ).eval())
    transformer = seeded(seed, lambda: Krea2Transformer2DModel(
        in_channels=4 * vae.config.z_dim,  # patch_size 2
        num_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=1,  # grouped-query attention, as the real 48 / 12
        intermediate_size=64,
        timestep_embed_dim=32,
        text_hidden_dim=QWEN_HIDDEN,
        num_text_layers=len(SELECT_LAYERS),
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=64,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=ROPE_AXES,
    ).eval())
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=6400, time_shift_type="exponential",
    )
    return {
        "scheduler": scheduler,
        "vae": vae,
        "text_encoder": seeded(seed, lambda: _qwen3_vl(tokenizer)),
        "tokenizer": tokenizer,
        "transformer": transformer,
    }
