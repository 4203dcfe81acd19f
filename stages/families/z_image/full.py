"""Z-Image-Turbo at full size for bench/ (bench/full_configs.py builds it): the released config.json
values, what the bench runs with, and the denoiser's attention FLOPs and meta-device call."""

from __future__ import annotations

from typing import Any

from stages.families.full_parts import FLUX_VAE, QWEN3_4B, diffusers_model, qwen3

PRESET = "configs/z-image.toml"
TEXT_PRECISION = "nf4"
BUILD_SECONDS = 55
TEXT_IN_SEQUENCE = True

TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                   n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True,
                   cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48],
                   axes_lens=[1536, 512, 512])


COMPONENTS = {
    "transformer": diffusers_model("ZImageTransformer2DModel", TRANSFORMER),
    "vae": diffusers_model("AutoencoderKL", FLUX_VAE),
    "text_encoder": lambda c: qwen3(c["tokenizer"], QWEN3_4B, causal_lm=False),
}


def attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    """Joint layers over image + text tokens; the noise and context refiners over each stream alone."""
    s = img + txt
    return 4.0 * cfg.dim * batch * (s ** 2 * cfg.n_layers + (img ** 2 + txt ** 2) * cfg.n_refiner_layers)


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    cfg = model.config
    return model([empty(cfg.in_channels, 1, h, w) for _ in range(b)], empty(b, fp32=True),
                 [empty(txt, cfg.cap_feat_dim) for _ in range(b)], return_dict=False)
