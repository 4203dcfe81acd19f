"""Chroma1-HD at full size for bench/ (bench/full_configs.py builds it): the released architecture, what
the bench runs with, and the denoiser's attention FLOPs and meta-device call.

Where the numbers come from (no download is possible here): ChromaTransformer2DModel's defaults in
diffusers 0.42.1 (`transformer_chroma.py`, whose docstring names Chroma1-HD): FLUX.1's 19 double and
38 single blocks of 24 x 128 heads, T5 width 4096, an approximator 64 -> 5120 x 5 layers; ComfyUI's
checkpoint detection (`comfy/model_detection.py`) sets the same numbers for a Chroma file. T5-XXL and
FLUX.1's VAE, as FLUX.1's full.py.
"""

from __future__ import annotations

from typing import Any

from stages.families.common import flux1_full
from stages.families.full_parts import FLUX_VAE, diffusers_model

PRESET = "configs/chroma.toml"
TEXT_PRECISION = flux1_full.TEXT_PRECISION
BUILD_SECONDS = 60  # estimate: 8.9B transformer + T5-XXL, below FLUX.1's 57-68 s (12B + T5-XXL + CLIP)
TRAIN_SECONDS = 70  # a compiled 512 px b1 train item on the H200 (load, regional compile, 8 steps): FLUX.1 took 65-94 s
TEXT_IN_SEQUENCE = True

TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56),
                   approximator_num_channels=64, approximator_hidden_dim=5120, approximator_layers=5)

COMPONENTS = {
    "transformer": diffusers_model("ChromaTransformer2DModel", TRANSFORMER),
    "vae": diffusers_model("AutoencoderKL", FLUX_VAE),
    "text_encoder": lambda c: flux1_full.t5(c["tokenizer"]),
}
attention_flops = flux1_full.attention_flops  # the same joint attention over image + text tokens


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    cfg, img = model.config, (h // 2) * (w // 2)
    return model(hidden_states=empty(b, img, cfg.in_channels),
                 encoder_hidden_states=empty(b, txt, cfg.joint_attention_dim), timestep=empty(b),
                 img_ids=empty(img, 3), txt_ids=empty(txt, 3), return_dict=False)
