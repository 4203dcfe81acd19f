"""Flow-matching math shared by the DiT families (FLUX, Qwen-Image, Z-Image), and the loss every family reduces with.

As in diffusers' training examples: x_t = (1 - s) * x0 + s * noise, target noise - x0; timesteps
from a density (logit-normal, mode, uniform, as `compute_density_for_timestep_sampling`), mapped to
the scheduler's discrete sigma table by vectorized indexing (no per-sample Python search).

`draw_u` adds what the diffusers examples lack: train.timestep_min/max (the density squeezed into a
range of timesteps) and train.timestep_buckets (stratified draws). `per_sample_loss` is the one place
where train.loss (mse, pseudo-Huber, smooth L1) and train.weighting_scheme apply, for every family.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator

from stages.core.lazy import lazy_module

torch = lazy_module("torch")  # imported at first use: `status` and a no-op `run` need no torch

NUM_TRAIN_TIMESTEPS = 1000


def sample_density(n: int, generator: torch.Generator, density: str, logit_mean: float = 0.0,
                   logit_std: float = 1.0, mode_scale: float = 1.29) -> torch.Tensor:
    """u in [0, 1), as diffusers' compute_density_for_timestep_sampling (SD3 paper, sec. 3.1)."""
    if density == "logit_normal":
        u = torch.normal(logit_mean, logit_std, size=(n,), generator=generator)
        return torch.sigmoid(u)
    return from_uniform(torch.rand(n, generator=generator), density, logit_mean, logit_std, mode_scale)


def from_uniform(v: torch.Tensor, density: str, logit_mean: float = 0.0, logit_std: float = 1.0,
                 mode_scale: float = 1.29) -> torch.Tensor:
    """The density's u from a uniform variate v, monotone in v: logit-normal through the normal's inverse
    CDF and the sigmoid; mode through its own map (monotone for mode_scale < 1.75); uniform as it is."""
    if density == "logit_normal":
        return torch.sigmoid(logit_mean + logit_std * torch.special.ndtri(v))
    if density == "mode":
        return 1 - v - mode_scale * (torch.cos(math.pi * v / 2) ** 2 - 1 + v)
    if density == "uniform":
        return v
    raise ValueError(f"unknown timestep density {density!r}")


def stratified_density(n: int, generator: torch.Generator, density: str, first: int, buckets: int,
                       logit_mean: float = 0.0, logit_std: float = 1.0, mode_scale: float = 1.29) -> torch.Tensor:
    """u in [0, 1) with draw j of the run (j = first, first + 1, ...) in stratum (j mod buckets) of the
    density: the uniform variate v = (stratum + r) / buckets, r ~ U[0, 1) from `generator`, goes through
    `from_uniform`. Each of the `buckets` strata holds 1/buckets of the density's mass, and consecutive
    draws visit them in turn."""
    strata = (first + torch.arange(n)) % buckets
    v = (strata + torch.rand(n, generator=generator)) / buckets
    return from_uniform(v, density, logit_mean, logit_std, mode_scale)


def draw_u(n: int, generator: torch.Generator, tcfg, first: int | None = None) -> torch.Tensor:
    """The n draws of u in [0, 1) that pick training timesteps (u -> timestep 1 - u, before the shift).

    train.timestep_buckets > 0 stratifies them (`stratified_density`) where `first`, the run's index
    of the first draw, is given; validation (first None) draws from the plain density. Then
    train.timestep_min/max squeeze the density, shape kept, into timesteps [min, max] before the shift:
    u' = (1 - max) + (max - min) * u. The defaults draw exactly what `sample_density` draws."""
    density = (tcfg.timestep_density, tcfg.logit_mean, tcfg.logit_std, tcfg.mode_scale)
    if tcfg.timestep_buckets and first is not None:
        u = stratified_density(n, generator, density[0], first, tcfg.timestep_buckets, *density[1:])
    else:
        u = sample_density(n, generator, *density)
    low, high = tcfg.timestep_min, tcfg.timestep_max
    if (low, high) != (0.0, 1.0):
        u = (1 - high) + (high - low) * u
    return u


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


def sample_flow_sigmas(n: int, image_seq_len: int, generator: torch.Generator, tcfg,
                       first: int | None = None) -> torch.Tensor:
    u = draw_u(n, generator, tcfg, first)
    shift = math.exp(dynamic_shift_mu(image_seq_len)) if tcfg.dynamic_shift else tcfg.shift
    return lookup_sigmas(u, sigma_table(shift))


def noisy_latents(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    s = sigmas.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - x0


def elementwise_loss(pred: torch.Tensor, target: torch.Tensor, kind: str = "mse", huber_c: float = 0.1) -> torch.Tensor:
    """train.loss per element, in float32, with d = pred - target and c = train.huber_c, as sd-scripts'
    `conditional_loss`: mse d^2; huber (pseudo-Huber) 2c * (sqrt(d^2 + c^2) - c), which is ~d^2 for
    |d| << c and ~2c|d| beyond; smooth_l1 2 * (sqrt(d^2 + c^2) - c), the same curve / c (~d^2 / c, then ~2|d|)."""
    err = (pred.float() - target.float()) ** 2
    if kind == "mse":
        return err
    if kind == "huber":
        return 2 * huber_c * (torch.sqrt(err + huber_c ** 2) - huber_c)
    if kind == "smooth_l1":
        return 2 * (torch.sqrt(err + huber_c ** 2) - huber_c)
    raise ValueError(f"unknown loss {kind!r}")


def loss_weights(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """train.weighting_scheme per sample, as diffusers' compute_loss_weighting_for_sd3: sigma_sqrt
    1 / sigma^2, cosmap 2 / (pi * (1 - 2 sigma + 2 sigma^2)), none 1."""
    sigmas = sigmas.float()
    if scheme == "sigma_sqrt":
        return sigmas ** -2.0
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
    if scheme == "none":
        return torch.ones_like(sigmas)
    raise ValueError(f"unknown weighting scheme {scheme!r}")


# train.preservation: what `per_sample_loss` does with a family's prediction besides the loss (None: nothing)
_PRESERVE: contextvars.ContextVar[tuple[str, object] | None] = contextvars.ContextVar("preserve", default=None)


@contextlib.contextmanager
def captured_prediction() -> Iterator[list[torch.Tensor]]:
    """Inside, `per_sample_loss` records the prediction it is given (detached), in the space of the family's
    target (unpacked latents, negated where the family negates): the base model's prediction for preservation."""
    box: list[torch.Tensor] = []
    token = _PRESERVE.set(("capture", box))
    try:
        yield box
    finally:
        _PRESERVE.reset(token)


@contextlib.contextmanager
def prediction_target(target: torch.Tensor, rows: torch.Tensor | None = None) -> Iterator[None]:
    """Inside, `per_sample_loss` trains toward `target` (a captured prediction) instead of the family's own
    target: for every sample, or only where the bool (B,) `rows` is true."""
    token = _PRESERVE.set(("target", (target, rows)))
    try:
        yield
    finally:
        _PRESERVE.reset(token)


def per_sample_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None, tcfg,
                    sigmas: torch.Tensor | None = None) -> torch.Tensor:
    """The training loss per sample, as every family computes it: train.loss per element, averaged
    over the loss mask (`masked_mean`), times train.weighting_scheme's weight of each sample's sigma
    (flow families pass `sigmas`; DDPM families weigh their own way). mse without weighting is
    exactly `per_sample_mse`. Under `captured_prediction` / `prediction_target` (train.preservation)
    it also records `pred`, or trains toward the given prediction."""
    preserve = _PRESERVE.get()
    if preserve is not None and preserve[0] == "capture":
        preserve[1].append(pred.detach())  # type: ignore[union-attr]
    elif preserve is not None:
        base, rows = preserve[1]  # type: ignore[misc]
        base = base.to(target.device, target.dtype)
        target = base if rows is None else torch.where(rows.to(target.device).view(-1, *([1] * (target.dim() - 1))),
                                                       base, target)
    loss = masked_mean(elementwise_loss(pred, target, tcfg.loss, tcfg.huber_c), mask)
    if sigmas is not None and tcfg.weighting_scheme != "none":
        loss = loss * loss_weights(tcfg.weighting_scheme, sigmas).to(loss.device)
    return loss


def per_sample_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error per sample (`masked_mean` of the squared error)."""
    return masked_mean((pred.float() - target.float()) ** 2, mask)


def masked_mean(err: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of a per-element loss per sample; with a loss mask (B, 1, h, w) of weights in [0, 1],
    the weighted mean over the mask: sum(w * err) / (channels * sum(w)).

    Written as mean(w * err) * (h*w / sum(w)) so that an all-ones mask is bit-identical to no mask
    (w * err == err and h*w / sum(w) == 1.0 exactly), loss and gradients alike. A sample whose mask
    is all zero contributes 0, not NaN."""
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
