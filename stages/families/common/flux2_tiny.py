"""FLUX.2's tiny VAE, which the tiny FLUX.2 [klein] and [dev] pipelines share.

Real config values kept: 32 latent channels and batch-norm eps 1e-4 of AutoencoderKLFlux2's defaults.
The batch-norm running statistics are drawn at random (away from 0 and 1) so that a missing or
misplaced normalization shows in the tests.
"""

from __future__ import annotations

from typing import Any

from stages.tiny.parts import VAE_BLOCKS

LATENT_CHANNELS = 32


def flux2_vae() -> Any:
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * len(VAE_BLOCKS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_BLOCKS),
        block_out_channels=VAE_BLOCKS,
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=32,
        sample_size=64,
    ).eval()
    channels = vae.bn.running_mean.shape[0]
    vae.bn.running_mean.copy_(0.5 * torch.randn(channels))
    vae.bn.running_var.copy_(0.5 + torch.rand(channels) * 2)
    return vae
