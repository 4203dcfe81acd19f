"""SDXL's tiny random-weight pipeline, "sdxl" (stages.tiny builds and saves it).

Real config values kept: the VAE's scaling_factor 0.13025 with quant convs, SDXL base 1.0's
EulerDiscreteScheduler config. `projection_class_embeddings_input_dim` = 6 x
`addition_time_embed_dim` + text_encoder_2's projection size. The 2-level UNet halves the 32x32
latent of a 64x64 image once, so image sides must be multiples of 4.
"""

from __future__ import annotations

from typing import Any

from stages.tiny.parts import CLIP2_HIDDEN, CLIP_HIDDEN, clip_text, seeded, vae_kl

PIPELINE_CLASS = "StableDiffusionXLPipeline"
PIPELINE_EXTRA: dict[str, Any] = {"add_watermarker": False, "force_zeros_for_empty_prompt": True}
VAE_SCALING_FACTOR = 0.13025
TIME_EMBED = 8  # addition_time_embed_dim (real 256)
TINY_DIMS: dict[str, dict[str, Any]] = {"sdxl": {
    "latent_channels": 4, "vae_scale_factor": 2, "image_multiple": 4,
    "text_hidden": {"text_encoder": CLIP_HIDDEN, "text_encoder_2": CLIP2_HIDDEN},
    "max_sequence_length": {"tokenizer": 77, "tokenizer_2": 77},
    "cross_attention_dim": CLIP_HIDDEN + CLIP2_HIDDEN,
    "unet_in_channels": 4,
}}


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel

    from stages.tiny.tokenizers import build_clip_tokenizer

    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_clip_tokenizer(pad_token="!")  # as OpenCLIP bigG's tokenizer_2
    text_encoder_2 = seeded(seed, lambda: clip_text(tokenizer_2, CLIP2_HIDDEN, True, "gelu"))
    proj = text_encoder_2.config.projection_dim
    unet = seeded(seed, lambda: UNet2DConditionModel(
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
        cross_attention_dim=CLIP_HIDDEN + CLIP2_HIDDEN,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=TIME_EMBED,
        projection_class_embeddings_input_dim=6 * TIME_EMBED + proj,
        upcast_attention=False,
    ).eval())
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", interpolation_type="linear", timestep_spacing="leading",
        steps_offset=1, use_karras_sigmas=False,
    )
    return {
        "vae": seeded(seed, lambda: vae_kl(4, VAE_SCALING_FACTOR, None, quant_convs=True)),
        "text_encoder": seeded(seed, lambda: clip_text(tokenizer, CLIP_HIDDEN, False, "quick_gelu")),
        "text_encoder_2": text_encoder_2,
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        "unet": unet,
        "scheduler": scheduler,
    }
