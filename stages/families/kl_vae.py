"""The latent side shared by FLUX.1 and Z-Image: diffusers' AutoencoderKL (16 channels) normalized
with the config's shift_factor and scaling_factor, and latents patched 2x2 by the transformer.

Plain functions with the protocol's method signatures: a family that uses this VAE assigns them
in its class body (`load_vae = kl_vae.load_vae`), with no base class in between.
"""

from __future__ import annotations

from typing import Any

import torch


def load_vae(_family: Any, src: Any, rt: Any) -> torch.nn.Module:
    from diffusers import AutoencoderKL

    return src.load(AutoencoderKL, "vae", torch_dtype=rt.dtype).to(rt.device).eval()


def pixel_multiple(_family: Any, src: Any) -> int:
    blocks = src.component_config("vae")["block_out_channels"]
    return 2 ** (len(blocks) - 1) * 2  # the pipeline's vae_scale_factor x the 2x2 latent patches


@torch.no_grad()
def encode_posterior(_family: Any, vae: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
    return dist.mean, dist.logvar  # logvar already clamped to [-30, 20] by DiagonalGaussianDistribution


def latent_normalization(_family: Any, vae: torch.nn.Module) -> dict[str, Any]:
    return {"shift_factor": float(vae.config.shift_factor or 0.0), "scaling_factor": float(vae.config.scaling_factor)}


def normalize_latents(_family: Any, z: torch.Tensor, norm: dict[str, Any]) -> torch.Tensor:
    return (z - norm["shift_factor"]) * norm["scaling_factor"]


def denormalize_latents(_family: Any, x: torch.Tensor, norm: dict[str, Any]) -> torch.Tensor:
    return x / norm["scaling_factor"] + norm["shift_factor"]
