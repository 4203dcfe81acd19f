"""Ideogram 4's tiny random-weight pipeline, "ideogram4" (stages.tiny builds and saves it).

Real config values kept: FLUX.2's tiny VAE (AutoencoderKLFlux2, 32 latent channels, batch-norm statistics
drawn away from 0 and 1: stages/families/common/flux2_tiny.py), `in_channels` = 4 x 32 (2x2 patches), MRoPE
over (t, h, w) with rope_theta 5e6, and a Qwen3-VL text encoder with 36 decoder layers, because
Ideogram4Pipeline taps the fixed layers (0, 3, ..., 33, 35) of Qwen3-VL-8B's 36: `llm_features_dim` is
13 x the tiny hidden size. Two transformers, as the pipeline has: the conditional one (trained) and the
unconditional one (frozen, sampling only), drawn from different seeds. The scheduler keeps shift 1.0 without
dynamic shifting: the pipeline hands it its own sigmas, which any other shift would bend.
"""

from __future__ import annotations

from typing import Any

from stages.families.common.flux2_tiny import LATENT_CHANNELS, flux2_vae
from stages.tiny.parts import HEAD_DIM, HEADS, QWEN_HIDDEN, seeded

PIPELINE_CLASS = "Ideogram4Pipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
TEXT_LAYERS = 36  # Qwen3-VL-8B's decoder layers; the pipeline reads 13 of them
TAPPED_LAYERS = 13  # len(QWEN3_VL_ACTIVATION_LAYERS)
TINY_DIMS: dict[str, dict[str, Any]] = {"ideogram4": {
    "latent_channels": LATENT_CHANNELS, "vae_scale_factor": 2, "image_multiple": 4,
    "text_hidden": {"text_encoder": QWEN_HIDDEN},
    "max_sequence_length": {"tokenizer": 2048},  # the pipeline's default; chat template included
    "transformer_in_channels": 4 * LATENT_CHANNELS,
}}


def qwen3_vl(tokenizer: Any) -> Any:
    from transformers import Qwen3VLConfig, Qwen3VLModel

    ids = tokenizer.convert_tokens_to_ids
    special = {"bos_token_id": ids("<|endoftext|>"), "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": QWEN_HIDDEN, "intermediate_size": QWEN_HIDDEN * 2,
            "num_hidden_layers": TEXT_LAYERS, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            # mrope_section sums to head_dim / 2 (real [24, 20, 20] of 128, interleaved)
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2],
                                "mrope_interleaved": True},
            **special,
        },
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": QWEN_HIDDEN, "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen3VLModel(config).eval()


def transformer() -> Any:
    from diffusers import Ideogram4Transformer2DModel

    return Ideogram4Transformer2DModel(
        in_channels=4 * LATENT_CHANNELS,  # 2x2 patches
        num_layers=2,  # real 34
        attention_head_dim=HEAD_DIM,  # real 256
        num_attention_heads=HEADS,  # real 18
        intermediate_size=64,  # real 12288
        adaln_dim=16,  # real 512
        llm_features_dim=TAPPED_LAYERS * QWEN_HIDDEN,  # real 13 x 4096 = 53248
        rope_theta=5_000_000,
        mrope_section=(4, 2, 2),  # sums to HEAD_DIM / 2; real (24, 20, 20) of 128
    ).eval()


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from stages.tiny.tokenizers import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer("qwen3")
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False),
        "vae": seeded(seed, flux2_vae),
        "text_encoder": seeded(seed, lambda: qwen3_vl(tokenizer)),
        "tokenizer": tokenizer,
        "transformer": seeded(seed, transformer),
        "unconditional_transformer": seeded(seed + 1, transformer),
    }
