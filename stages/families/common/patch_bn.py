"""Latents normalized per 2x2-patchified channel by the VAE's batch-norm statistics, as FLUX.2's, ERNIE-Image's
and Ideogram 4's pipelines apply them: a (B, C, H, W) latent viewed (B, C, H/2, 2, W/2, 2) minus running_mean,
over sqrt(running_var + eps). A family mixes this in before FamilyTraits."""

from __future__ import annotations

from typing import Any

from stages.core.lazy import lazy_module

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch


def _patch_stats(x: torch.Tensor, values: list[float]) -> torch.Tensor:
    """Per-patchified-channel statistics (4C,) shaped to broadcast over x viewed (B, C, h/2, 2, w/2, 2)."""
    return torch.tensor(values, device=x.device, dtype=x.dtype).view(1, -1, 1, 2, 1, 2)


class PatchBatchNormalized:
    """`bn_eps` is the epsilon the pipeline's decode adds to running_var (the VAE config's batch_norm_eps
    unless the family's pipeline hard-codes another); `patch_stats` shapes the (4C,) statistics in the order
    the VAE's batch norm lists the patchified channels (channel-major: c, row, col)."""

    def bn_eps(self, vae: torch.nn.Module) -> float:
        return vae.config.batch_norm_eps

    def patch_stats(self, x: torch.Tensor, values: list[float]) -> torch.Tensor:
        return _patch_stats(x, values)

    def latent_normalization(self, vae: torch.nn.Module) -> dict[str, Any]:
        var = vae.bn.running_var.double() + self.bn_eps(vae)
        return {"bn_mean": vae.bn.running_mean.double().tolist(), "bn_std": var.sqrt().tolist()}

    def normalize_latents(self, z: torch.Tensor, norm: dict[str, Any]) -> torch.Tensor:
        b, c, h, w = z.shape
        x = (z.view(b, c, h // 2, 2, w // 2, 2) - self.patch_stats(z, norm["bn_mean"])) / self.patch_stats(z, norm["bn_std"])
        return x.view(b, c, h, w)

    def denormalize_latents(self, x: torch.Tensor, norm: dict[str, Any]) -> torch.Tensor:
        b, c, h, w = x.shape
        z = x.view(b, c, h // 2, 2, w // 2, 2) * self.patch_stats(x, norm["bn_std"]) + self.patch_stats(x, norm["bn_mean"])
        return z.view(b, c, h, w)
