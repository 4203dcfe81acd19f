"""Qwen-Image 2.1's tiny random-weight pipeline, "qwen-image-2.1" (stages.tiny builds and saves it).

Real config values kept: AutoencoderKLQwenImage21's 64 per-channel latents_mean / latents_std and its
4 input channels (RGBA); a 16x spatial downsampling (QwenImage21Pipeline hard-codes
`vae_scale_factor = 16`, so the tiny VAE keeps the 4 downsampling levels of dim_mult [1, 2, 4, 8, 8]);
the transformer's unpatched latents (patch_size 1, in_channels = z_dim). The Qwen3-VL config's vision
token ids are the tokenizer's special tokens. The processor stands in for Qwen3VLProcessor (see
`_processor`); the pipeline asks it for the system prefix's token count and tokenizes with it.
A 64x64 image is a 4x4 latent: 16 image tokens in 4 slots of the joint sequence.
"""

from __future__ import annotations

from typing import Any

from stages.tiny.parts import HEAD_DIM, HEADS, QWEN_HIDDEN, ROPE_AXES, seeded

PIPELINE_CLASS = "QwenImage21Pipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
LATENT_CHANNELS = 8  # real 64: the tiny VAE's z_dim (its statistics are the first 8 real ones)
TINY_DIMS: dict[str, dict[str, Any]] = {"qwen-image-2.1": {
    "latent_channels": LATENT_CHANNELS, "vae_scale_factor": 16, "image_multiple": 32,
    "image_channels": 4,  # the VAE decodes RGBA and the pipeline returns it
    "text_hidden": {"text_encoder": QWEN_HIDDEN},
    "max_sequence_length": {"processor": 8192},  # no limit in the pipeline; the transformer's RoPE has 8192
    "transformer_in_channels": LATENT_CHANNELS,
}}


def _qwen3_vl(tokenizer: Any) -> Any:
    from stages.families.qwen_image_21.full import qwen3_vl

    text = {"hidden_size": QWEN_HIDDEN, "intermediate_size": QWEN_HIDDEN * 2, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            # mrope_section sums to head_dim / 2 (real [24, 20, 20] of 128), interleaved as Qwen3-VL's
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2],
                                "mrope_interleaved": True}}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": QWEN_HIDDEN,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
              "deepstack_visual_indexes": [1]}
    return qwen3_vl(tokenizer, text, vision).eval()


def _processor() -> Any:
    from transformers import LlavaProcessor, Qwen2VLImageProcessorPil

    from stages.tiny.tokenizers import QWEN3_CHAT_TEMPLATE, build_qwen_tokenizer

    # Qwen3VLProcessor cannot be built here: its video processor needs torchvision, which has no CPU
    # build for torch 2.13 on these machines. LlavaProcessor (a tokenizer and Qwen2-VL's PIL image
    # processor) runs the same text path: ProcessorMixin's apply_chat_template, and for text-only
    # prompts the tokenizer call with the pipeline's padding arguments.
    return LlavaProcessor(image_processor=Qwen2VLImageProcessorPil(patch_size=16, merge_size=2),
                          tokenizer=build_qwen_tokenizer("qwen3"), chat_template=QWEN3_CHAT_TEMPLATE)


def _vae() -> Any:
    from diffusers import AutoencoderKLQwenImage21

    from stages.families.qwen_image_21.full import released_vae_statistics

    mean, std = released_vae_statistics()
    return AutoencoderKLQwenImage21(
        base_dim=4, decoder_base_dim=4, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
        attn_scales=[], temperal_downsample=[False, False, False, False], dropout=0.0,
        latents_mean=mean[:LATENT_CHANNELS], latents_std=std[:LATENT_CHANNELS],
    ).eval()


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

    processor = _processor()
    transformer = seeded(seed, lambda: QwenImage21Transformer2DModel(
        patch_size=1, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=1,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, context_in_dim=QWEN_HIDDEN, mlp_ratio=3,
        axes_dims_rope=ROPE_AXES,
    ).eval())
    return {
        # The pipeline reads base/max image_seq_len and base/max shift from the scheduler config, with
        # calculate_shift's own defaults when absent; these are those defaults.
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                                     base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                     max_image_seq_len=4096),
        "vae": seeded(seed, _vae),
        "text_encoder": seeded(seed, lambda: _qwen3_vl(processor.tokenizer)),
        "processor": processor,
        "transformer": transformer,
    }
