"""What a training batch carries beside its latents and conditioning, built by `stages.core.train_data`
and handed to the family's `loss` (`stages.families.base.Family`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class BatchMeta:
    """Per-sample geometry of a training batch, read from the latent cache (pixels, int64 (B, 2))."""

    original_size: "torch.Tensor"  # (height, width) of the source image
    crop_top_left: "torch.Tensor"  # (top, left) of the variant's crop in the resized image
    target_size: "torch.Tensor"  # (height, width) of the bucket
    loss_mask: "torch.Tensor | None" = None
    """(B, 1, h, w) loss weights at latent resolution on the loss's device (None: unmasked); the
    family hands it to `flow.per_sample_loss`, which averages the loss over it."""
    controls: tuple["torch.Tensor", ...] = ()
    """Edit families: each control image's normalized latents (B, C, h, w), in the item's control
    order (sampled from their cached posterior like the target); empty for text-to-image families."""
    text_multiple: int = 1
    """Families that cut a batch's captions to its longest: that length rounded up to a multiple of this many
    tokens (the padding masked), runtime.caption_tokens_multiple; 1 cuts to the longest."""
