"""SDXL base 1.0 at full size for bench/ (bench/full_configs.py builds it): the released config.json
values, what the bench runs with, and the UNet's meta-device call."""

from __future__ import annotations

from typing import Any

from stages.families.full_parts import CLIP_L, FLUX_VAE, clip, diffusers_model

PRESET = "configs/sdxl.toml"
TEXT_PRECISION = "bf16"  # SDXL's CLIPs are not offered in nf4
BUILD_SECONDS = 40
TEXT_IN_SEQUENCE = False  # the UNet cross-attends to the text; its tokens are image positions only

UNET = dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(320, 640, 1280), transformer_layers_per_block=(1, 2, 10),
            attention_head_dim=(5, 10, 20), cross_attention_dim=2048, use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816, norm_num_groups=32, upcast_attention=False)
VAE = dict(FLUX_VAE, latent_channels=4, scaling_factor=0.13025, shift_factor=None, use_quant_conv=True,
           use_post_quant_conv=True, mid_block_add_attention=True)
CLIP_BIGG = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, projection_dim=1280,
                 num_hidden_layers=32, num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu",
                 layer_norm_eps=1e-5)

COMPONENTS = {
    "unet": diffusers_model("UNet2DConditionModel", UNET),
    "vae": diffusers_model("AutoencoderKL", VAE),
    "text_encoder": lambda c: clip(c["tokenizer"], CLIP_L, projection=False),
    "text_encoder_2": lambda c: clip(c["tokenizer_2"], CLIP_BIGG, projection=True),
}


def attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    return 0.0  # not counted for the UNet (its attention runs at several resolutions)


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    cfg = model.config
    return model(empty(b, cfg.in_channels, h, w), empty(b, long=True), encoder_hidden_states=empty(b, 77, cfg.cross_attention_dim),
                 added_cond_kwargs={"text_embeds": empty(b, 1280), "time_ids": empty(b, 6)}, return_dict=False)
