"""Latents normalized per channel by the VAE's own statistics, (z - latents_mean) / latents_std, as the Wan
VAE's pipelines (Qwen-Image, Wan 2.2) and LTX-2 apply them; a family mixes this in before FamilyTraits."""

from __future__ import annotations

from typing import Any

from stages.core.lazy import lazy_module

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch


class ChannelNormalized:
    """`latent_normalization` reads latents_mean / latents_std from the VAE's config; a family whose VAE keeps
    them elsewhere, or divides by a further scaling factor, overrides it and `channel_stats`."""

    def latent_normalization(self, vae: torch.nn.Module) -> dict[str, Any]:
        return {"latents_mean": [float(v) for v in vae.config.latents_mean],
                "latents_std": [float(v) for v in vae.config.latents_std]}

    def channel_stats(self, x: torch.Tensor, norm: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean and std shaped to broadcast over x's channel axis (dim 1), in x's device and dtype."""
        shape = (1, -1) + (1,) * (x.dim() - 2)
        mean = torch.tensor(norm["latents_mean"], device=x.device, dtype=x.dtype).view(shape)
        std = torch.tensor(norm["latents_std"], device=x.device, dtype=x.dtype).view(shape)
        return mean, std

    def normalize_latents(self, z: torch.Tensor, norm: dict[str, Any]) -> torch.Tensor:
        mean, std = self.channel_stats(z, norm)
        return (z - mean) / std

    def denormalize_latents(self, x: torch.Tensor, norm: dict[str, Any]) -> torch.Tensor:
        mean, std = self.channel_stats(x, norm)
        return x * std + mean
