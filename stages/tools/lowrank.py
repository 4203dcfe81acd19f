"""The low-rank math of the LoRA tools: one module's LoRA factors, the exact SVD of a weighted sum of
LoRA deltas, truncation by rank or by kept energy, and the relative error of that truncation.

    from stages.tools.lowrank import Factors, svd_of_sum, truncate

A sum of k LoRAs, D = sum_i w_i s_i B_i A_i, has rank at most R = sum_i r_i. Its SVD comes from two
thin QRs, of [w_1 s_1 B_1, ...] (out, R) and of [A_1; ...]^T (in, R), and an SVD of the R x R core:
exact, and O((out + in) R^2) instead of the SVD of the full (out, in) matrix. By Eckart-Young the best
rank-r approximation keeps the r largest singular values, and its error is exactly
||D - D_r||_F / ||D||_F = sqrt(sum_{i>r} S_i^2 / sum_i S_i^2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOWRANK_FROM = 1024
"""extract: a difference matrix whose both sides exceed this is factored by torch.svd_lowrank (randomized)
when a fixed rank is asked; smaller ones, and --energy, by the full torch.linalg.svd."""


@dataclass
class Factors:
    """One module's LoRA: delta = scale * up @ down, in the weight's shape (conv: (out, in, k, k))."""

    down: torch.Tensor
    """(rank, in) for a linear layer; (rank, in, k, k) for a conv (kohya's LoCon)."""
    up: torch.Tensor
    """(out, rank), or (out, rank, 1, 1) for a conv."""
    scale: float = 1.0

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight the delta is added to."""
        return (self.up.shape[0], *self.down.shape[1:])

    def delta(self) -> torch.Tensor:
        d = (self.up.flatten(1).double() @ self.down.flatten(1).double()) * self.scale
        return d.reshape(self.shape)


@dataclass
class SVD:
    """D = u @ diag(s) @ vh, singular values in descending order, for a weight of `shape`."""

    u: torch.Tensor
    s: torch.Tensor
    vh: torch.Tensor
    shape: tuple[int, ...]
    measured: tuple[float, float] | None = None
    """(||D||_F^2, ||D - D_r||_F^2 at r = len(s)) where s holds only the leading values (randomized
    SVD): the error is then measured, not summed from the values; None: s is complete."""


@dataclass
class Truncated:
    factors: Factors
    rel_error: float
    """||D - D_r||_F / ||D||_F (0 for a zero delta)."""
    norm: float
    """||D||_F, to weigh the module in the overall error."""


def svd_of_sum(terms: list[tuple[float, Factors]]) -> SVD:
    """The exact thin SVD of sum_i w_i * delta_i for (w_i, factors_i) of one module (float64)."""
    shape = terms[0][1].shape
    ups = torch.cat([f.up.flatten(1).double() * (w * f.scale) for w, f in terms], dim=1)
    downs = torch.cat([f.down.flatten(1).double() for _, f in terms], dim=0)
    qu, ru = torch.linalg.qr(ups)
    qv, rv = torch.linalg.qr(downs.T)
    um, s, vmh = torch.linalg.svd(ru @ rv.T, full_matrices=False)
    return SVD(qu @ um, s, vmh @ qv.T, shape)


def svd_of_matrix(d: torch.Tensor, rank: int | None) -> SVD:
    """The SVD of a full difference matrix (float32): all of it, or with `rank` and both sides above
    LOWRANK_FROM the leading rank + 8 values by svd_lowrank (its residual then computed exactly)."""
    d = d.float()
    flat = d.flatten(1)
    if rank is not None and min(flat.shape) > LOWRANK_FROM:
        u, s, v = torch.svd_lowrank(flat, q=min(rank + 8, min(flat.shape)), niter=4)
        u, s, vh = u[:, :rank], s[:rank], v[:, :rank].T
        left = float((flat - (u * s) @ vh).double().pow(2).sum())
        return SVD(u, s, vh, tuple(d.shape), measured=(float(flat.double().pow(2).sum()), left))
    u, s, vh = torch.linalg.svd(flat, full_matrices=False)
    return SVD(u, s, vh, tuple(d.shape))


def rank_for(s: torch.Tensor, rank: int | None, energy: float | None) -> int:
    """The rank kept: `rank` (at most the number of values), or the smallest one keeping at least `energy`
    of the squared singular values; at least 1, so every module stays in the file."""
    if energy is not None:
        power = s.double().pow(2)
        total = float(power.sum())
        if total == 0.0:
            return 1
        kept = torch.cumsum(power, 0) / total
        return max(1, min(int((kept < energy - 1e-12).sum()) + 1, len(s)))
    return max(1, min(rank if rank is not None else len(s), len(s)))


def truncate(svd: SVD, rank: int | None = None, energy: float | None = None, dtype: torch.dtype = torch.float32) -> Truncated:
    """The best rank-r LoRA of the SVD's matrix, split evenly (up = U sqrt(S), down = sqrt(S) Vh, scale 1),
    and its relative error. `rank` None and `energy` None: every value kept."""
    r = rank_for(svd.s, rank, energy)
    s = svd.s.double()
    total, left = svd.measured or (float(s.pow(2).sum()), float(s[r:].pow(2).sum()))
    root = s[:r].sqrt()
    u, vh = svd.u.double()[:, :r] * root, svd.vh.double()[:r] * root[:, None]
    out, *rest = svd.shape
    down, up = vh.reshape(r, *rest), u.reshape(out, r, *([1] * (len(rest) - 1)))
    return Truncated(Factors(down.to(dtype).contiguous(), up.to(dtype).contiguous()),
                     math.sqrt(left / total) if total > 0 else 0.0, math.sqrt(total))


def overall_error(results: dict[str, Truncated]) -> dict[str, float | str | None]:
    """worst (and its module), median and overall relative error, the overall one over all modules as one
    matrix: sqrt(sum ||D - D_r||^2 / sum ||D||^2)."""
    if not results:
        return {"worst": None, "worst_module": None, "median": None, "overall": None}
    errors = sorted((t.rel_error, m) for m, t in results.items())
    total = sum(t.norm ** 2 for t in results.values())
    left = sum((t.rel_error * t.norm) ** 2 for t in results.values())
    return {"worst": errors[-1][0], "worst_module": errors[-1][1], "median": errors[len(errors) // 2][0],
            "overall": math.sqrt(left / total) if total > 0 else 0.0}
