"""HiDream-I1's transformer with its repeated blocks named, and its output as a latent grid in either mode.

diffusers 0.42.1's `HiDreamImageTransformer2DModel` names no `_repeated_blocks`, which gradient checkpointing
per block, block swap, the fp8 base and regional compile find the blocks by (stages/core/blockswap.py); its
blocks are `HiDreamBlock` wrappers in `double_stream_blocks` and `single_stream_blocks`, run in that order.

In training mode the model runs its MoE feed-forward through the differentiable routed path (eval mode's
`moe_infer` runs under `torch.no_grad`, so the routed experts would pass no gradient to the blocks before them)
and returns its output unpatchified per token, (B, C, tokens, p x p); `latent_grid` turns either output into
the (B, C, h, w) grid the pipeline steps with.
"""

from __future__ import annotations

import torch
from diffusers import HiDreamImageTransformer2DModel


class HiDreamTrainable(HiDreamImageTransformer2DModel):
    """The diffusers transformer (same config, weights, forward and LoRA names) with its repeated blocks named."""

    _repeated_blocks = ["HiDreamBlock"]


def latent_grid(out: torch.Tensor, training: bool, h: int, w: int, patch: int) -> torch.Tensor:
    """The transformer's output as (B, C, h, w): as returned in eval mode; in training mode (B, C, tokens, p x p)
    with each token's p x p cells row-major, padded tokens after the h/p x w/p real ones."""
    if not training:
        return out
    b, c = out.shape[:2]
    ph, pw = h // patch, w // patch
    grid = out[:, :, :ph * pw].reshape(b, c, ph, pw, patch, patch)
    return grid.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)
