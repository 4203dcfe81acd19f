"""FLUX.1 Kontext's tiny pipelines in a FluxKontextPipeline, as FLUX.1-Kontext-dev ships FLUX.1-dev's
architecture (guidance embedding, same VAE and text encoders): "flux-kontext", the tests' model, is
FLUX.1-dev's tiny random-weight components (stages/families/common/flux1_tiny.py); "flux-kontext-edit", the
edit demo's model, keeps its text encoders and scheduler, with two changes so that the demo can learn
its edit in a couple of CPU minutes:

- The VAE is the real AutoencoderKL class with its weights set, not drawn: the encoder is an exact
  2x2 pixel-unshuffle (12 of the 16 latent channels carry the pixels, scaled by `PIXEL_GAIN`) with a
  logvar of `LOGVAR` (posterior std 5e-5: a trained VAE's posterior is near-deterministic too), and
  the decoder renders each latent pixel's 2x2 mean back. A random tiny VAE's posterior has std ~1
  around means of std 0.39, so the training target was mostly noise (the first edit demo's finding).
- The transformer is wider (8 heads x 16 = 128 > a packed token's 64 channels) and set to reproduce
  the control (stages/tiny/copy_edit.py, shared with Qwen-Image-Edit-Plus's demo model).

The VAE's signals travel as (+x, -x) pairs beside a (+C, -C) constant pair (stages/tiny/copy_edit.py
says why that keeps it linear); the one-group GroupNorm then has mean exactly 0 and a std of C/4 up
to (pixel / C)^2. The other weights stay the seeded random ones.
"""

from __future__ import annotations

from typing import Any

from stages.families.common import flux1_tiny as flux_tiny
from stages.tiny import copy_edit
from stages.tiny.parts import (CLIP_HIDDEN, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, HEAD_DIM, ROPE_AXES,
                               T5_DMODEL, seeded)

PIPELINE_CLASS = "FluxKontextPipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
# "flux-kontext": the tests' tiny random-weight model (FLUX.1-dev's tiny components); "flux-kontext-edit":
# the edit demo's model below (weights set so that the base reproduces the control)
TINY_DIMS: dict[str, dict[str, Any]] = {"flux-kontext": flux_tiny.TINY_DIMS["flux-dev"],
                                        "flux-kontext-edit": flux_tiny.TINY_DIMS["flux-dev"]}

VAE_WIDTH = 32  # channels inside the VAE: 12 signal pairs + a constant pair fit
PIXEL_GAIN = 2.5  # latent = 2.5 x pixel in [-1, 1]: normalized by FLUX.1's 0.3611 it has std ~0.5-1
CONST = 100.0  # the constant pair: GroupNorm's std is C/4 to within 6 / C^2
LOGVAR = -20.0  # posterior std exp(-10) = 4.5e-5


def _silence_residuals(half: Any) -> None:
    """Resnets and attention add nothing: their last layers are zero, so each is the identity."""
    import torch

    for m in half.modules():
        if hasattr(m, "conv2") and hasattr(m, "norm1"):  # ResnetBlock2D
            copy_edit.clear(m.conv2)
        if hasattr(m, "to_out") and isinstance(m.to_out, torch.nn.ModuleList):  # Attention
            copy_edit.clear(m.to_out[0])


def _set_encoder(enc: Any, latent_channels: int) -> None:
    """conv_in: (+p, -p) for the 3 colours and the constant pair; the downsampler's stride-2 conv
    pixel-unshuffles (colour k, sub-pixel a, b) from tap (a, b); conv_out takes the pairs' SiLU
    difference back to 2.5 x pixel, and sets the logvar."""
    import torch

    copy_edit.pairs_in(enc.conv_in, torch.eye(3), (1, 1), CONST)
    copy_edit.unshuffle_conv(enc.down_blocks[0].downsamplers[0].conv)
    # normalized pair (+x/std, -x/std), std = C/4
    copy_edit.pair_differences(enc.conv_out, 12, PIXEL_GAIN * CONST / 4, (1, 1))
    enc.conv_out.bias[latent_channels:] = LOGVAR


def _set_decoder(dec: Any) -> None:
    """conv_in: the 12 pixel channels as pairs (1 / 2.5) and the constant pair; the upsampler's conv
    (after nearest x2) averages each colour's 4 sub-pixels; conv_out: SiLU differences to pixels."""
    import torch

    copy_edit.pairs_in(dec.conv_in, torch.eye(12, 16) / PIXEL_GAIN, (1, 1), CONST)
    copy_edit.average_conv(dec.up_blocks[0].upsamplers[0].conv)
    copy_edit.pair_differences(dec.conv_out, 3, CONST / 4, (1, 1))


def unshuffle_vae() -> Any:
    """The tiny KL VAE (scale factor 2, FLUX.1's normalization) as a fixed pixel-unshuffle."""
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(VAE_WIDTH, VAE_WIDTH), layers_per_block=1,
        latent_channels=16, norm_num_groups=1, sample_size=64, scaling_factor=FLUX_VAE_SCALING_FACTOR,
        shift_factor=FLUX_VAE_SHIFT_FACTOR, use_quant_conv=False, use_post_quant_conv=False, force_upcast=True,
    ).eval()
    with torch.no_grad():
        for half in (vae.encoder, vae.decoder):
            _silence_residuals(half)
        _set_encoder(vae.encoder, 16)
        _set_decoder(vae.decoder)
    return vae


def copy_transformer(m: Any) -> Any:
    """The seeded FluxTransformer2DModel set to reproduce the control (stages/tiny/copy_edit.py); the
    guidance and pooled-text embeddings and the single block add nothing."""
    block, te = m.transformer_blocks[0], m.time_text_embed
    copy_edit.copy_transformer(copy_edit.MMDiTParts(
        inner_dim=m.inner_dim, embedder=m.x_embedder, timestep=te.timestep_embedder,
        image_modulation=block.norm1.linear, text_modulation=block.norm1_context.linear, attn=block.attn,
        mlp=block.ff, norm_out=m.norm_out.linear, proj_out=m.proj_out,
        silenced=(te.guidance_embedder.linear_2, te.text_embedder.linear_2, m.single_transformer_blocks[0].proj_out)))
    return m


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import FluxTransformer2DModel

    components = flux_tiny.build_components("flux-dev", seed)
    if variant == "flux-kontext":  # the tests' random-weight model
        return components
    components["vae"] = seeded(seed, unshuffle_vae)
    components["transformer"] = seeded(seed, lambda: copy_transformer(FluxTransformer2DModel(
        patch_size=1, in_channels=64, out_channels=None, num_layers=1, num_single_layers=1,
        attention_head_dim=HEAD_DIM, num_attention_heads=copy_edit.HEADS, joint_attention_dim=T5_DMODEL,
        pooled_projection_dim=CLIP_HIDDEN, guidance_embeds=True, axes_dims_rope=ROPE_AXES,
    ).eval()))
    return components
