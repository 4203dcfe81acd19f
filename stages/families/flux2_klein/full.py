"""FLUX.2 [klein] 4B at full size for bench/ (bench/full_configs.py builds it): the released config
values, what the bench runs with, and the denoiser's attention FLOPs and meta-device call.

Where the numbers come from (no download possible here):
- TRANSFORMER: FLUX.2-klein-4B's transformer/config.json as quoted in public code (a
  `Flux2Transformer2DModel.from_single_file` test config and DiffSynth-Studio's model table:
  5 double / 20 single blocks, 24 heads x 128, joint_attention_dim 7680 = 3 x 2560, no guidance
  embedding); the remaining keys are Flux2Transformer2DModel's defaults in diffusers 0.42.1.
- VAE: AutoencoderKLFlux2's defaults in diffusers 0.42.1 (the class is FLUX.2's VAE: 32 latent
  channels, 4 blocks 128-512, batch norm over 128 patchified channels).
- text encoder: Qwen3-4B's config.json, the same values as Z-Image's (stages/families/full_parts.py).
"""

from __future__ import annotations

from typing import Any

from stages.families.common.flux1_full import attention_flops  # noqa: F401 - the same double/single-block layout
from stages.families.common.flux2_full import VAE
from stages.families.full_parts import QWEN3_4B, diffusers_model, qwen3

PRESET = "configs/flux2-klein.toml"
TEXT_PRECISION = "nf4"
BUILD_SECONDS = 50  # estimate: 16 GB of bf16 safetensors (3.9B transformer + 4.0B Qwen3); Z-Image's 20.5 GB took 38-54 s
TRAIN_SECONDS = 60  # a compiled 512 px b1 train item on the H200 (load, regional compile, 8 steps): estimate from FLUX.1's 65-94 s, Z-Image's 66-84 s
TEXT_IN_SEQUENCE = True

TRANSFORMER = dict(patch_size=1, in_channels=128, out_channels=None, num_layers=5, num_single_layers=20,
                   attention_head_dim=128, num_attention_heads=24, joint_attention_dim=7680,
                   timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000,
                   eps=1e-6, guidance_embeds=False)


COMPONENTS = {
    "transformer": diffusers_model("Flux2Transformer2DModel", TRANSFORMER),
    "vae": diffusers_model("AutoencoderKLFlux2", VAE),
    "text_encoder": lambda c: qwen3(c["tokenizer"], QWEN3_4B, causal_lm=True),
}


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    cfg, img = model.config, (h // 2) * (w // 2)
    return model(hidden_states=empty(b, img, cfg.in_channels), encoder_hidden_states=empty(b, txt, cfg.joint_attention_dim),
                 timestep=empty(b), img_ids=empty(img, 4), txt_ids=empty(txt, 4), guidance=None, return_dict=False)
