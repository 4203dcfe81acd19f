"""Tiny random-weight models of the real architectures, saved as ordinary diffusers pipelines.

:func:`build_tiny_pipeline` builds every component from the real diffusers / transformers class
with a tiny config (at least one block of each block type, widths of 16-64), assembles the real
pipeline class and ``save_pretrained``s it, so that offline (``HF_HUB_OFFLINE=1``)::

    FluxPipeline.from_pretrained(folder)                      # the whole pipeline
    FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    AutoencoderKL.from_pretrained(folder, subfolder="vae")
    CLIPTextModel.from_pretrained(folder, subfolder="text_encoder")

all work like they do for the real checkpoints.  Weights are float32 and random
(``torch.manual_seed(seed)`` before each component, so a folder is a pure function of
``(variant, seed)``); the images they generate are noise, but every shape, config relation and
code path is the real one.

Variants and what they end up with (:data:`TINY_DIMS` holds the same numbers):

=============  ======  =========  =====================================  ==========================
variant        latent  VAE scale  text encoders (hidden size)            image sides must divide by
=============  ======  =========  =====================================  ==========================
flux-dev       16      2          CLIP 32 (pooled, 77 tok), T5 32 (512)  4  (scale x 2x2 packing)
flux-schnell   16      2          CLIP 32 (pooled, 77 tok), T5 32 (512)  4
qwen-image     16      2          Qwen2.5-VL 32 (<=1024 after 34 drop)   4
z-image        16      2          Qwen3 32 (hidden_states[-2], <=512)    4
sdxl           4       2          CLIP 32 + CLIP-proj 64 (77 tok)        2  (UNet needs 4: 2 levels)
=============  ======  =========  =====================================  ==========================

VAE scale factor: AutoencoderKL with 2 down blocks downsamples by ``2 ** (2 - 1) = 2``;
AutoencoderKLQwenImage with ``dim_mult=[1, 2]`` has one ``temperal_downsample`` entry, and the
Qwen-Image pipeline computes ``2 ** len(temperal_downsample) = 2``.  A 64x64 image is a 32x32
latent, i.e. 256 packed 2x2 tokens for the three transformers.  SDXL's 2-level UNet halves the
32x32 latent once, so SDXL image sides must be multiples of 4 as well; 64x64 is valid everywhere.

Real config values kept: FLUX VAE ``scaling_factor=0.3611, shift_factor=0.1159`` (also Z-Image,
which uses the FLUX VAE) without quant convs; SDXL VAE ``scaling_factor=0.13025`` with quant convs;
Qwen-Image (Wan 2.1) per-channel ``latents_mean`` / ``latents_std``; the schedulers' configs of
the real checkpoints (see ``_scheduler``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "VARIANTS",
    "PIPELINE_CLASS_NAMES",
    "TINY_DIMS",
    "build_tiny_components",
    "build_tiny_pipeline",
]

VARIANTS: tuple[str, ...] = ("flux-dev", "flux-schnell", "qwen-image", "z-image", "sdxl")

PIPELINE_CLASS_NAMES: dict[str, str] = {
    "flux-dev": "FluxPipeline",
    "flux-schnell": "FluxPipeline",
    "qwen-image": "QwenImagePipeline",
    "z-image": "ZImagePipeline",
    "sdxl": "StableDiffusionXLPipeline",
}

# Widths of the tiny models.
_CLIP_HIDDEN = 32  # CLIP ViT-L text encoder (real 768): FLUX `text_encoder`, SDXL `text_encoder`
_CLIP2_HIDDEN = 64  # OpenCLIP bigG text encoder with projection (real 1280): SDXL `text_encoder_2`
_T5_DMODEL = 32  # T5-v1.1-XXL encoder (real 4096)
_QWEN_HIDDEN = 32  # Qwen2.5-VL-7B (real 3584) / Qwen3-4B (real 2560)
_HEAD_DIM = 16  # transformer attention head dim (real 128)
_HEADS = 2
_ROPE_AXES = (4, 6, 6)  # real (16, 56, 56) for FLUX / Qwen-Image, (32, 48, 48) for Z-Image; sums to _HEAD_DIM
_VAE_BLOCKS = (32, 32)  # 2 down blocks -> VAE scale factor 2
_SDXL_TIME_EMBED = 8  # addition_time_embed_dim (real 256)

FLUX_VAE_SCALING_FACTOR = 0.3611
FLUX_VAE_SHIFT_FACTOR = 0.1159
SDXL_VAE_SCALING_FACTOR = 0.13025
# Wan 2.1 VAE statistics, used by Qwen-Image's AutoencoderKLQwenImage.
QWEN_IMAGE_LATENTS_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]
QWEN_IMAGE_LATENTS_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
]

TINY_DIMS: dict[str, dict[str, Any]] = {
    "flux-dev": {
        "latent_channels": 16, "vae_scale_factor": 2, "image_multiple": 4,
        "text_hidden": {"text_encoder": _CLIP_HIDDEN, "text_encoder_2": _T5_DMODEL},
        "max_sequence_length": {"tokenizer": 77, "tokenizer_2": 512},
        "transformer_in_channels": 64, "guidance_embeds": True,
    },
    "flux-schnell": {
        "latent_channels": 16, "vae_scale_factor": 2, "image_multiple": 4,
        "text_hidden": {"text_encoder": _CLIP_HIDDEN, "text_encoder_2": _T5_DMODEL},
        "max_sequence_length": {"tokenizer": 77, "tokenizer_2": 512},
        "transformer_in_channels": 64, "guidance_embeds": False,
    },
    "qwen-image": {
        "latent_channels": 16, "vae_scale_factor": 2, "image_multiple": 4,
        "text_hidden": {"text_encoder": _QWEN_HIDDEN},
        "max_sequence_length": {"tokenizer": 1024},  # after the 34 template tokens are dropped
        "transformer_in_channels": 64,
    },
    "z-image": {
        "latent_channels": 16, "vae_scale_factor": 2, "image_multiple": 4,
        "text_hidden": {"text_encoder": _QWEN_HIDDEN},
        "max_sequence_length": {"tokenizer": 512},  # pipeline default; chat template included
        "transformer_in_channels": 16,
    },
    "sdxl": {
        "latent_channels": 4, "vae_scale_factor": 2, "image_multiple": 4,
        "text_hidden": {"text_encoder": _CLIP_HIDDEN, "text_encoder_2": _CLIP2_HIDDEN},
        "max_sequence_length": {"tokenizer": 77, "tokenizer_2": 77},
        "cross_attention_dim": _CLIP_HIDDEN + _CLIP2_HIDDEN,
        "unet_in_channels": 4,
    },
}


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


# ------------------------------------------------------------------------------------ components
def _clip_text(tokenizer, hidden: int, with_projection: bool, hidden_act: str):
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


def _t5_encoder(tokenizer):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=_T5_DMODEL,
        d_kv=8,
        d_ff=_T5_DMODEL * 2,
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


def _qwen2_5_vl(tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": _QWEN_HIDDEN,
            "intermediate_size": _QWEN_HIDDEN * 2,
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
            "out_hidden_size": _QWEN_HIDDEN,
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


def _qwen3(tokenizer):
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=_QWEN_HIDDEN,
        intermediate_size=_QWEN_HIDDEN * 2,
        num_hidden_layers=2,  # Z-Image reads hidden_states[-2]: keep it a layer output
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
    return Qwen3Model(config).eval()


def _vae_kl(latent_channels: int, scaling_factor: float, shift_factor: float | None, quant_convs: bool):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(_VAE_BLOCKS),
        up_block_types=("UpDecoderBlock2D",) * len(_VAE_BLOCKS),
        block_out_channels=_VAE_BLOCKS,
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


def _scheduler(variant: str):
    """The schedulers of the real checkpoints' ``scheduler/scheduler_config.json``."""
    from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

    if variant == "flux-dev":
        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
            max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
        )
    if variant == "flux-schnell":
        # FLUX.1-schnell ships shift=1.0 without dynamic shifting (timestep-distilled, 1-4 steps).
        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, base_shift=0.5,
            max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
        )
    if variant == "qwen-image":
        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
            max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
            time_shift_type="exponential",
        )
    if variant == "z-image":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    if variant == "sdxl":
        return EulerDiscreteScheduler(
            num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            prediction_type="epsilon", interpolation_type="linear", timestep_spacing="leading",
            steps_offset=1, use_karras_sigmas=False,
        )
    raise AssertionError(variant)


def _seeded(seed: int, build):
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def build_tiny_components(variant: str, seed: int = 0) -> dict[str, Any]:
    """The keyword arguments of the variant's pipeline class: tiny random models (eval mode,
    float32, CPU), tokenizers and scheduler.  ``getattr(diffusers, PIPELINE_CLASS_NAMES[variant])
    (**build_tiny_components(variant))`` is a working in-memory pipeline.  Each model is built
    under ``torch.manual_seed(seed)`` in a forked RNG (the caller's RNG state is untouched)."""
    _check_variant(variant)
    from .tokenizers import build_clip_tokenizer, build_qwen_tokenizer, build_t5_tokenizer

    s = lambda build: _seeded(seed, build)  # noqa: E731

    if variant in ("flux-dev", "flux-schnell"):
        from diffusers import FluxTransformer2DModel

        tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer()
        vae = s(lambda: _vae_kl(16, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, quant_convs=False))
        transformer = s(lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * vae.config.latent_channels,  # 2x2 packing
            out_channels=None,
            num_layers=1,  # double-stream (MM-DiT) blocks
            num_single_layers=1,
            attention_head_dim=_HEAD_DIM,
            num_attention_heads=_HEADS,
            joint_attention_dim=_T5_DMODEL,
            pooled_projection_dim=_CLIP_HIDDEN,
            guidance_embeds=variant == "flux-dev",
            axes_dims_rope=_ROPE_AXES,
        ).eval())
        return {
            "scheduler": _scheduler(variant),
            "vae": vae,
            "text_encoder": s(lambda: _clip_text(tokenizer, _CLIP_HIDDEN, False, "quick_gelu")),
            "tokenizer": tokenizer,
            "text_encoder_2": s(lambda: _t5_encoder(tokenizer_2)),
            "tokenizer_2": tokenizer_2,
            "transformer": transformer,
        }

    if variant == "qwen-image":
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

        tokenizer = build_qwen_tokenizer("qwen2.5-vl")
        vae = s(lambda: AutoencoderKLQwenImage(
            base_dim=16,
            z_dim=16,
            dim_mult=[1, 2],
            num_res_blocks=1,
            attn_scales=[],
            temperal_downsample=[False],  # -> vae_scale_factor 2 ** 1
            dropout=0.0,
            latents_mean=list(QWEN_IMAGE_LATENTS_MEAN),
            latents_std=list(QWEN_IMAGE_LATENTS_STD),
        ).eval())
        transformer = s(lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * vae.config.z_dim,
            out_channels=vae.config.z_dim,
            num_layers=1,
            attention_head_dim=_HEAD_DIM,
            num_attention_heads=_HEADS,
            joint_attention_dim=_QWEN_HIDDEN,
            guidance_embeds=False,
            axes_dims_rope=_ROPE_AXES,
        ).eval())
        return {
            "scheduler": _scheduler(variant),
            "vae": vae,
            "text_encoder": s(lambda: _qwen2_5_vl(tokenizer)),
            "tokenizer": tokenizer,
            "transformer": transformer,
        }

    if variant == "z-image":
        from diffusers import ZImageTransformer2DModel

        tokenizer = build_qwen_tokenizer("qwen3")
        vae = s(lambda: _vae_kl(16, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, quant_convs=False))
        transformer = s(lambda: ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=vae.config.latent_channels,
            dim=_HEADS * _HEAD_DIM,
            n_layers=1,
            n_refiner_layers=1,  # noise and context refiners: one block each
            n_heads=_HEADS,
            n_kv_heads=_HEADS,
            norm_eps=1e-5,
            qk_norm=True,
            cap_feat_dim=_QWEN_HIDDEN,
            rope_theta=256.0,
            t_scale=1000.0,
            axes_dims=list(_ROPE_AXES),
            axes_lens=[1536, 512, 512],
        ).eval())
        return {
            "scheduler": _scheduler(variant),
            "vae": vae,
            "text_encoder": s(lambda: _qwen3(tokenizer)),
            "tokenizer": tokenizer,
            "transformer": transformer,
        }

    if variant == "sdxl":
        from diffusers import UNet2DConditionModel

        tokenizer = build_clip_tokenizer()
        tokenizer_2 = build_clip_tokenizer(pad_token="!")  # as OpenCLIP bigG's tokenizer_2
        text_encoder_2 = s(lambda: _clip_text(tokenizer_2, _CLIP2_HIDDEN, True, "gelu"))
        proj = text_encoder_2.config.projection_dim
        unet = s(lambda: UNet2DConditionModel(
            sample_size=32,
            in_channels=4,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(32, 64),
            layers_per_block=1,
            transformer_layers_per_block=(1, 1),
            attention_head_dim=(2, 4),  # SDXL convention: number of heads per level
            norm_num_groups=32,
            cross_attention_dim=_CLIP_HIDDEN + _CLIP2_HIDDEN,
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=_SDXL_TIME_EMBED,
            projection_class_embeddings_input_dim=6 * _SDXL_TIME_EMBED + proj,
            upcast_attention=False,
        ).eval())
        return {
            "vae": s(lambda: _vae_kl(4, SDXL_VAE_SCALING_FACTOR, None, quant_convs=True)),
            "text_encoder": s(lambda: _clip_text(tokenizer, _CLIP_HIDDEN, False, "quick_gelu")),
            "text_encoder_2": text_encoder_2,
            "tokenizer": tokenizer,
            "tokenizer_2": tokenizer_2,
            "unet": unet,
            "scheduler": _scheduler(variant),
        }

    raise AssertionError(variant)


def build_tiny_pipeline(variant: str, folder: str | Path, seed: int = 0) -> Path:
    """Build the tiny ``variant`` pipeline and ``save_pretrained`` it into ``folder`` (created if
    missing; files of an earlier save there are overwritten).  Returns the folder as a ``Path``.

    Load it back with the real class, offline:
    ``getattr(diffusers, PIPELINE_CLASS_NAMES[variant]).from_pretrained(folder)``.
    """
    import diffusers

    _check_variant(variant)
    folder = Path(folder)
    components = build_tiny_components(variant, seed=seed)
    pipeline_cls = getattr(diffusers, PIPELINE_CLASS_NAMES[variant])
    extra = {"add_watermarker": False, "force_zeros_for_empty_prompt": True} if variant == "sdxl" else {}
    pipe = pipeline_cls(**components, **extra)
    folder.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder
