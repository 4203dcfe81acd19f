"""Flow-matching math shared by the DiT families (FLUX, Qwen-Image, Z-Image).

As in diffusers' training examples: x_t = (1 - s) * x0 + s * noise, target noise - x0; timesteps
from a density (logit-normal, mode, uniform, as `compute_density_for_timestep_sampling`), mapped to
the scheduler's discrete sigma table by vectorized indexing (no per-sample Python search).
"""

from __future__ import annotations

import math

import torch

NUM_TRAIN_TIMESTEPS = 1000


def sample_density(n: int, generator: torch.Generator, density: str, logit_mean: float = 0.0,
                   logit_std: float = 1.0, mode_scale: float = 1.29) -> torch.Tensor:
    """u in [0, 1), as diffusers' compute_density_for_timestep_sampling (SD3 paper, sec. 3.1)."""
    if density == "logit_normal":
        u = torch.normal(logit_mean, logit_std, size=(n,), generator=generator)
        return torch.sigmoid(u)
    u = torch.rand(n, generator=generator)
    if density == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    if density == "uniform":
        return u
    raise ValueError(f"unknown timestep density {density!r}")


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler's static shift: s' = shift*s / (1 + (shift-1)*s)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def dynamic_shift_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                     base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX's resolution-dependent mu (diffusers `calculate_shift`); shift = exp(mu)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def sigma_table(shift: float) -> torch.Tensor:
    """The scheduler's training sigmas, highest first: linspace(1, 1/N, N) then shifted."""
    base = torch.linspace(1.0, 1.0 / NUM_TRAIN_TIMESTEPS, NUM_TRAIN_TIMESTEPS, dtype=torch.float64)
    return shift_sigmas(base, shift).float()


def lookup_sigmas(u: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Vectorized: index = floor(u * N) into the table, as diffusers' examples do per sample."""
    idx = (u * len(table)).long().clamp_(0, len(table) - 1)
    return table[idx]


def sample_flow_sigmas(n: int, image_seq_len: int, generator: torch.Generator, tcfg) -> torch.Tensor:
    u = sample_density(n, generator, tcfg.timestep_density, tcfg.logit_mean, tcfg.logit_std, tcfg.mode_scale)
    shift = math.exp(dynamic_shift_mu(image_seq_len)) if tcfg.dynamic_shift else tcfg.shift
    return lookup_sigmas(u, sigma_table(shift))


def noisy_latents(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    s = sigmas.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - x0


def per_sample_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error per sample; with a loss mask (B, 1, h, w) of weights in [0, 1], the
    weighted mean over the mask: sum(w * err) / (channels * sum(w)).

    Written as mean(w * err) * (h*w / sum(w)) so that an all-ones mask is bit-identical to no mask
    (w * err == err and h*w / sum(w) == 1.0 exactly), loss and gradients alike. A sample whose mask
    is all zero contributes 0, not NaN."""
    err = (pred.float() - target.float()) ** 2
    if mask is None:
        return err.flatten(1).mean(dim=1)
    m = mask.to(err.device, torch.float32)
    m = m.reshape(m.shape[0], *([1] * (err.dim() - 3)), *m.shape[-2:])  # (B, 1, [T,] h, w)
    area = float(m.shape[-2] * m.shape[-1])
    total = m.flatten(1).sum(dim=1)
    scale = torch.where(total > 0, area / total.clamp_min(1e-12), torch.zeros_like(total))
    return (err * m).flatten(1).mean(dim=1) * scale


# ---- 2x2 latent packing (FLUX and Qwen-Image) -------------------------------------------------


def pack_2x2(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, C*4), as FluxPipeline._pack_latents."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of pack_2x2 for latent height h and width w."""
    b, _, d = x.shape
    c = d // 4
    x = x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)
