"""HiDream-I1's transformer with its repeated blocks named, a MoE feed-forward a compiled or graphed step can
run, and its output as a latent grid in either mode.

diffusers 0.42.1's `HiDreamImageTransformer2DModel` names no `_repeated_blocks`, which gradient checkpointing
per block, block swap, the fp8 base and regional compile find the blocks by (stages/core/blockswap.py); its
blocks are `HiDreamBlock` wrappers in `double_stream_blocks` and `single_stream_blocks`, run in that order.

In training mode the model runs its MoE feed-forward through the differentiable routed path (eval mode's
`moe_infer` runs under `torch.no_grad`, so the routed experts would pass no gradient to the blocks before them)
and returns its output unpatchified per token, (B, C, tokens, p x p); `latent_grid` turns either output into
the (B, C, h, w) grid the pipeline steps with.

Two parts of that training forward wait on the GPU, which neither a CUDA graph can capture nor a compiled
block can run without breaking its graph:
- the routed path picks each expert's tokens by a boolean mask (`x[flat_topk_idx == i]`), whose size the host
  must read back: 8 syncs per feed-forward, 384 per forward of the 48 blocks. Compiled or captured, the
  feed-forward runs `DenseRoutedMoE.dense` instead: every routed expert on every token, weighted by the
  router (0 for the two of four it did not choose). The same output (the same products, summed in fp32 as
  the routed path sums its two), the same gradients up to their summation order, twice the routed experts'
  arithmetic (1.5x the block's Linear work at HiDream-I1's widths); eager steps keep the routed path.
- `patchify` makes its image sizes with `torch.tensor([h, w], device=...)`, a host-to-device copy; the
  layout beside the patches (sizes, ids, mask) depends on the shape alone and is made once per shape.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers import HiDreamImageTransformer2DModel
from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU


def traced() -> bool:
    """Whether this forward is being compiled (dynamo tracing a block) or captured into a CUDA graph."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class DenseRoutedMoE(MOEFeedForwardSwiGLU):
    """diffusers' MoE feed-forward whose training forward, when compiled or captured, is `dense`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not self._force_inference_output and traced():
            return self.dense(x)
        return super().forward(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The routed path's output with no shape that depends on the routing: the gate's softmax and top-k as
        `MoEGate` computes them (its auxiliary loss, which diffusers discards, left out), each expert's output
        times its weight, zero for the experts a token did not choose."""
        gate, dtype = self.gate, x.dtype
        flat = x.view(-1, x.shape[-1])
        scores = F.linear(flat, gate.weight, None).softmax(dim=-1)
        top_weight, top_idx = torch.topk(scores, k=gate.top_k, dim=-1, sorted=False)
        weights = torch.zeros_like(scores).scatter(1, top_idx, top_weight)  # (tokens, experts)
        outs = torch.stack([expert(flat).to(dtype) for expert in self.experts], dim=1)  # (tokens, experts, D)
        routed = (outs * weights.unsqueeze(-1)).sum(dim=1).view(x.shape).to(dtype)
        return routed + self.shared_experts(x)


class HiDreamTrainable(HiDreamImageTransformer2DModel):
    """The diffusers transformer (same config, weights, forward and LoRA names) with its repeated blocks named,
    its MoE feed-forwards `DenseRoutedMoE` and its patch layout made once per shape."""

    _repeated_blocks = ["HiDreamBlock"]

    def dense_moe(self) -> "HiDreamTrainable":
        """Each MoE feed-forward made a `DenseRoutedMoE` (same weights and names); after loading."""
        for module in self.modules():
            if type(module) is MOEFeedForwardSwiGLU:
                gate = module.gate
                if gate.scoring_func != "softmax" or gate.norm_topk_prob:  # what `dense` computes
                    raise NotImplementedError(f"HiDream's MoE gate with scoring {gate.scoring_func!r} and "
                                              f"norm_topk_prob={gate.norm_topk_prob}")
                module.__class__ = DenseRoutedMoE
        return self

    def patchify(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, Any, Any, Any]:
        """diffusers' patchify: the patches (B, tokens, p x p x C), padded to max_seq tokens for a non-square
        latent, and beside them the padding mask, image sizes and ids, which diffusers' own makes once per shape
        here (the first step of a shape runs eager, before the trainer captures it)."""
        b, c, h, w = hidden_states.shape
        key = (b, c, h, w, hidden_states.device, hidden_states.dtype)
        layouts = self.__dict__.setdefault("_patch_layouts", {})
        if key not in layouts:
            layouts[key] = super().patchify(hidden_states)[1:]
        masks, sizes, ids = layouts[key]
        p = self.config.patch_size
        patches = hidden_states.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
        patches = patches.reshape(b, (h // p) * (w // p), p * p * c)
        if h != w:  # the real tokens first, then zeros up to max_seq
            patches = F.pad(patches, (0, 0, 0, self.max_seq - patches.shape[1]))
        return patches, masks, sizes, ids


def latent_grid(out: torch.Tensor, training: bool, h: int, w: int, patch: int) -> torch.Tensor:
    """The transformer's output as (B, C, h, w): as returned in eval mode; in training mode (B, C, tokens, p x p)
    with each token's p x p cells row-major, padded tokens after the h/p x w/p real ones."""
    if not training:
        return out
    b, c = out.shape[:2]
    ph, pw = h // patch, w // patch
    grid = out[:, :, :ph * pw].reshape(b, c, ph, pw, patch, patch)
    return grid.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)
