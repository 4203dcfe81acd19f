"""The latent side shared by FLUX.1 and Z-Image: diffusers' AutoencoderKL (16 channels) normalized
with the config's shift_factor and scaling_factor, and latents patched 2x2 by the transformer, whose
token count sets the flow-matching sigma shift.

A mixin with the protocol's cache-latents methods and `sample_timesteps`: `class Flux(KLVAELatents)`.
"""

from __future__ import annotations

from typing import Any

from stages.core import flow
from stages.core.lazy import lazy_module, no_grad

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch


class KLVAELatents:
    vae_class = "AutoencoderKL"

    def load_vae(self, src: Any, rt: Any) -> torch.nn.Module:
        from diffusers import AutoencoderKL

        return src.load(AutoencoderKL, "vae", torch_dtype=rt.dtype).to(rt.device).eval()

    def pixel_multiple(self, src: Any) -> int:
        blocks = src.component_config("vae")["block_out_channels"]
        return 2 ** (len(blocks) - 1) * 2  # the pipeline's vae_scale_factor x the 2x2 latent patches

    @no_grad
    def encode_posterior(self, vae: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(vae.parameters())  # vae.device and vae.dtype walk every module: ~0.5 ms an image
        dist = vae.encode(pixels.to(weight.device, weight.dtype)).latent_dist
        return dist.mean, dist.logvar  # logvar already clamped to [-30, 20] by DiagonalGaussianDistribution

    def latent_normalization(self, vae: torch.nn.Module) -> dict[str, Any]:
        return {"shift_factor": float(vae.config.shift_factor or 0.0), "scaling_factor": float(vae.config.scaling_factor)}

    def normalize_latents(self, z: torch.Tensor, norm: dict[str, Any]) -> torch.Tensor:
        return (z - norm["shift_factor"]) * norm["scaling_factor"]

    def denormalize_latents(self, x: torch.Tensor, norm: dict[str, Any]) -> torch.Tensor:
        return x / norm["scaling_factor"] + norm["shift_factor"]

    def sample_timesteps(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator, tcfg: Any,
                         first: int | None = None) -> torch.Tensor:
        return flow.sample_flow_sigmas(n, (latent_hw[0] // 2) * (latent_hw[1] // 2), generator, tcfg, first)
