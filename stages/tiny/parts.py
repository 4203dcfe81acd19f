"""Tiny components that several families' tiny pipelines share: CLIP text encoders, the KL VAE,
the widths they agree on, and the seeding rule (each model built under `torch.manual_seed(seed)`
in a forked RNG, so a pipeline folder is a pure function of (variant, seed)).

The family-specific parts and each family's assembly live in `stages/families/<family>/tiny.py`.
"""

from __future__ import annotations

from typing import Any, Callable

# Widths of the tiny models.
CLIP_HIDDEN = 32  # CLIP ViT-L text encoder (real 768): FLUX `text_encoder`, SDXL `text_encoder`
CLIP2_HIDDEN = 64  # OpenCLIP bigG text encoder with projection (real 1280): SDXL `text_encoder_2`
T5_DMODEL = 32  # T5-v1.1-XXL encoder (real 4096)
QWEN_HIDDEN = 32  # Qwen2.5-VL-7B (real 3584) / Qwen3-4B (real 2560)
HEAD_DIM = 16  # transformer attention head dim (real 128)
HEADS = 2
ROPE_AXES = (4, 6, 6)  # real (16, 56, 56) for FLUX / Qwen-Image, (32, 48, 48) for Z-Image; sums to HEAD_DIM
VAE_BLOCKS = (32, 32)  # 2 down blocks -> VAE scale factor 2

# FLUX.1's VAE normalization (also Z-Image's, which uses the FLUX VAE).
FLUX_VAE_SCALING_FACTOR = 0.3611
FLUX_VAE_SHIFT_FACTOR = 0.1159


def seeded(seed: int, build: Callable[[], Any]) -> Any:
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def clip_text(tokenizer: Any, hidden: int, with_projection: bool, hidden_act: str) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        projection_dim=hidden,
        num_hidden_layers=2,  # 2 so SDXL's penultimate hidden state is a layer output
        num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        hidden_act=hidden_act,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(config).eval()


def vae_kl(latent_channels: int, scaling_factor: float, shift_factor: float | None, quant_convs: bool) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(VAE_BLOCKS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_BLOCKS),
        block_out_channels=VAE_BLOCKS,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=32,
        sample_size=64,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=quant_convs,
        use_post_quant_conv=quant_convs,
        force_upcast=True,
    ).eval()


def qwen3_text(tokenizer: Any, layers: int, causal_lm: bool) -> Any:
    """A tiny Qwen3 text model (real Qwen3-4B: hidden 2560, 36 layers, tied embeddings): Qwen3Model,
    or Qwen3ForCausalLM where the pipeline declares it (FLUX.2 klein)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=QWEN_HIDDEN,
        intermediate_size=QWEN_HIDDEN * 2,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config).eval()
