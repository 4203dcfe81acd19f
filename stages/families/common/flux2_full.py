"""FLUX.2's one VAE at full size, which FLUX.2 [klein] and [dev] share (their `full.py`, for bench/).

AutoencoderKLFlux2's defaults in diffusers 0.42.1 (diffusers' scripts/convert_flux2_to_diffusers.py
builds it with `AutoencoderKLFlux2()`): 32 latent channels, 4 blocks 128-512, batch norm over 128
patchified channels.
"""

from __future__ import annotations

VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
           up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
           act_fn="silu", latent_channels=32, norm_num_groups=32, sample_size=1024, use_quant_conv=True,
           use_post_quant_conv=True, mid_block_add_attention=True, batch_norm_eps=1e-4, batch_norm_momentum=0.1,
           patch_size=(2, 2))
