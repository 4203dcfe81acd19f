"""FLUX.2 [dev] at full size for bench/ (bench/full_configs.py builds it): the released config
values, what the bench runs with, and the denoiser's attention FLOPs and meta-device call.

Where the numbers come from (no download possible here):
- TRANSFORMER: diffusers' scripts/convert_flux2_to_diffusers.py, `get_flux2_transformer_config
  ("flux2-dev")` (model_id black-forest-labs/FLUX.2-dev): 8 double / 48 single blocks, 48 heads x
  128, joint_attention_dim 15360 = 3 x 5120; `guidance_embeds` left at its default, true. These are
  also Flux2Transformer2DModel's defaults in diffusers 0.42.1.
- VAE: FLUX.2's one VAE, AutoencoderKLFlux2's defaults (the same script builds it with
  `AutoencoderKLFlux2()`), as klein's.
- text encoder: the same script takes mistralai/Mistral-Small-3.2-24B-Instruct-2506 as
  Mistral3ForConditionalGeneration; its sizes are transformers 5.x Mistral3Config's defaults (the
  Mistral Small 3.1 configuration, which 3.2 keeps), with an untied lm_head (the published 23.57B
  parameters count embedding and lm_head separately: 40 x 555.7M + 2 x 671M).
"""

from __future__ import annotations

from typing import Any

from stages.families.common.flux1_full import attention_flops  # noqa: F401 - the same double/single-block layout
from stages.families.common.flux2_full import VAE
from stages.families.flux2.tiny import mistral3
from stages.families.full_parts import diffusers_model

PRESET = "configs/flux2.toml"
TEXT_PRECISION = "nf4"
BUILD_SECONDS = 180  # estimate: 112.6 GB of bf16 safetensors (FLUX.1's 34 GB took 57-68 s); never built
TRAIN_SECONDS = 120  # estimate: a compiled nf4 512 px b1 item, 2.7x FLUX.1's weights to load and quantize
# nf4 first (the preset's); bf16 fits one H200: 61.8 GB planned at 512 px b1, 64.6 at 1024 px (`python
# bench/memory.py plan --families flux2 --budgets 139 --res 512,1024 --set train.base_precision=bf16`)
BASE_PRECISIONS = ("nf4", "bf16")
# Its bf16 safetensors are 112.6 GB (parameter counts from a meta-device build of COMPONENTS): the
# 32.2B transformer's 64.4 GB and the 24.0B Mistral's 48.0 GB. The 1-GPU bench host has a 64 GB disk,
# and /dev/shm is RAM (128 GB tmpfs over 125 GB), so the whole folder fits nowhere there. Each stage
# reads only its own components, so bench/bench.py builds the folder one stage at a time
# (bench/staged.py): Mistral for encode-captions, then the VAE, then the transformer, each big one
# alone in /dev/shm. The stages' loads stream shard by shard: transformers' and diffusers' nf4 loads
# quantize each 5 GB shard on the GPU as they read it, and bench/verify_export.py reads the bf16
# denoiser straight to the GPU, so the host holds one component's files plus about one shard.
STAGED = True
# estimates, never measured: random init on the GPU (seconds) + a sharded save at ~1.5 GB/s to /dev/shm
COMPONENT_BUILD_SECONDS = {"text_encoder": 45, "vae": 10, "transformer": 60}
ENCODE_SECONDS = 75  # estimate: reading and quantizing 48 GB of Mistral to nf4, then 8 captions
# Its fp8 row was skipped while train's fp8 load read the 64.4 GB bf16 transformer into host memory beside
# its 64.4 GB of files in /dev/shm (125 GB of RAM); that load now streams the shards tensor by tensor.
TEXT_IN_SEQUENCE = True

TRANSFORMER = dict(patch_size=1, in_channels=128, out_channels=None, num_layers=8, num_single_layers=48,
                   attention_head_dim=128, num_attention_heads=48, joint_attention_dim=15360,
                   timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000,
                   eps=1e-6, guidance_embeds=True)
MISTRAL_SMALL_3_TEXT = dict(vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                            max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None,
                            tie_word_embeddings=False)
PIXTRAL_VISION = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                      head_dim=64, patch_size=14, image_size=1540, hidden_act="gelu")

COMPONENTS = {
    "transformer": diffusers_model("Flux2Transformer2DModel", TRANSFORMER),
    "vae": diffusers_model("AutoencoderKLFlux2", VAE),
    "text_encoder": lambda c: mistral3(c["tokenizer"].tokenizer, MISTRAL_SMALL_3_TEXT, PIXTRAL_VISION),
}


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    cfg, img = model.config, (h // 2) * (w // 2)
    return model(hidden_states=empty(b, img, cfg.in_channels), encoder_hidden_states=empty(b, txt, cfg.joint_attention_dim),
                 timestep=empty(b), img_ids=empty(img, 4), txt_ids=empty(txt, 4), guidance=empty(b, fp32=True),
                 return_dict=False)
