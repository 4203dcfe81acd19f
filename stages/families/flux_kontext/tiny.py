"""FLUX.1 Kontext's tiny pipelines in a FluxKontextPipeline, as FLUX.1-Kontext-dev ships FLUX.1-dev's
architecture (guidance embedding, same VAE and text encoders): "flux-kontext", the tests' model, is
FLUX.1-dev's tiny random-weight components (stages/families/flux/tiny.py); "flux-kontext-edit", the
edit demo's model, keeps its text encoders and scheduler, with two changes so that the demo can learn
its edit in a couple of CPU minutes:

- The VAE is the real AutoencoderKL class with its weights set, not drawn: the encoder is an exact
  2x2 pixel-unshuffle (12 of the 16 latent channels carry the pixels, scaled by `PIXEL_GAIN`) with a
  logvar of `LOGVAR` (posterior std 5e-5: a trained VAE's posterior is near-deterministic too), and
  the decoder renders each latent pixel's 2x2 mean back. A random tiny VAE's posterior has std ~1
  around means of std 0.39, so the training target was mostly noise (the first edit demo's finding).
- The transformer is wider (8 heads x 16 = 128 > a packed token's 64 channels), so it can carry its
  input through; at 32 it could not.

How the VAE stays linear through its nonlinear layers: every signal travels as a (+x, -x) channel
pair beside a (+C, -C) constant pair, and the residual branches (resnets' conv2, attention's to_out)
are zero. The one-group GroupNorm then has mean exactly 0 and a std of C/4 up to (pixel / C)^2, and
SiLU's odd part is exact: silu(d) - silu(-d) = d. The other weights stay the seeded random ones.
"""

from __future__ import annotations

from typing import Any

from stages.families.flux import tiny as flux_tiny
from stages.tiny.parts import (CLIP_HIDDEN, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, HEAD_DIM, ROPE_AXES,
                               T5_DMODEL, seeded)

PIPELINE_CLASS = "FluxKontextPipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
# "flux-kontext": the tests' tiny random-weight model (FLUX.1-dev's tiny components); "flux-kontext-edit":
# the edit demo's model below (weights set so that the base reproduces the control)
TINY_DIMS: dict[str, dict[str, Any]] = {"flux-kontext": flux_tiny.TINY_DIMS["flux-dev"],
                                        "flux-kontext-edit": flux_tiny.TINY_DIMS["flux-dev"]}

HEADS = 8  # inner width 128: above a 2x2-packed token's 64 channels
VAE_WIDTH = 32  # channels inside the VAE: 12 signal pairs + a constant pair fit
PIXEL_GAIN = 2.5  # latent = 2.5 x pixel in [-1, 1]: normalized by FLUX.1's 0.3611 it has std ~0.5-1
CONST = 100.0  # the constant pair: GroupNorm's std is C/4 to within 6 / C^2
LOGVAR = -20.0  # posterior std exp(-10) = 4.5e-5
TOKEN_CONST = 100.0  # the transformer's constant pair: LayerNorm's std is C / 8 to within ~0.3 %
PIXEL_TOKEN = 48  # a packed token's channels that carry pixels: 12 latent channels x 2 x 2
MLP_GAIN = 50.0  # LayerNorm divides the control's pixels by 12.5: the MLP's first layer x 50
ROUTE = 400.0  # attention logit scale per RoPE pair weight: 900 at the match, >= 9 lower at any other token


def _clear(module: Any) -> None:
    for p in module.parameters():
        p.zero_()


def _pairs(conv: Any, out_first: int, weight: Any, tap: tuple[int, int]) -> None:
    """Out channels out_first + 2j (+) and + 2j + 1 (-) get `weight[j]` (a row over in-channels) at `tap`."""
    for j, row in enumerate(weight):
        conv.weight[out_first + 2 * j, :, tap[0], tap[1]] = row
        conv.weight[out_first + 2 * j + 1, :, tap[0], tap[1]] = -row


def _const_pair(conv: Any, channel: int, from_channel: int | None) -> None:
    """Channels `channel`, +1 carry (+C, -C): from the bias, or passed on from `from_channel` (centre tap)."""
    if from_channel is None:
        conv.bias[channel], conv.bias[channel + 1] = CONST, -CONST
    else:
        conv.weight[channel, from_channel, 0 if conv.stride[0] == 2 else 1, 0 if conv.stride[0] == 2 else 1] = 1.0
        conv.weight[channel + 1, from_channel + 1, 0 if conv.stride[0] == 2 else 1, 0 if conv.stride[0] == 2 else 1] = 1.0


def _silence_residuals(half: Any) -> None:
    """Resnets and attention add nothing: their last layers are zero, so each is the identity."""
    import torch

    for m in half.modules():
        if hasattr(m, "conv2") and hasattr(m, "norm1"):  # ResnetBlock2D
            _clear(m.conv2)
        if hasattr(m, "to_out") and isinstance(m.to_out, torch.nn.ModuleList):  # Attention
            _clear(m.to_out[0])


def _set_encoder(enc: Any, latent_channels: int) -> None:
    """conv_in: (+p, -p) for the 3 colours and the constant pair; the downsampler's stride-2 conv
    pixel-unshuffles (colour k, sub-pixel a, b) from tap (a, b); conv_out takes the pairs' SiLU
    difference back to 2.5 x pixel, and sets the logvar."""
    import torch

    eye3 = torch.eye(3)
    _clear(enc.conv_in)
    _pairs(enc.conv_in, 0, eye3, (1, 1))
    _const_pair(enc.conv_in, 6, None)
    down = enc.down_blocks[0].downsamplers[0].conv
    _clear(down)
    for k in range(3):
        for a in range(2):
            for b in range(2):
                s = 2 * (k * 4 + a * 2 + b)
                down.weight[s, 2 * k, a, b] = 1.0
                down.weight[s + 1, 2 * k + 1, a, b] = 1.0
    _const_pair(down, 24, 6)
    _clear(enc.conv_out)
    scale = PIXEL_GAIN * CONST / 4  # normalized pair (+x/std, -x/std), std = C/4
    for j in range(12):
        enc.conv_out.weight[j, 2 * j, 1, 1] = scale
        enc.conv_out.weight[j, 2 * j + 1, 1, 1] = -scale
    enc.conv_out.bias[latent_channels:] = LOGVAR


def _set_decoder(dec: Any) -> None:
    """conv_in: the 12 pixel channels as pairs (1 / 2.5) and the constant pair; the upsampler's conv
    (after nearest x2) averages each colour's 4 sub-pixels; conv_out: SiLU differences to pixels."""
    import torch

    _clear(dec.conv_in)
    _pairs(dec.conv_in, 0, torch.eye(12, 16) / PIXEL_GAIN, (1, 1))
    _const_pair(dec.conv_in, 24, None)
    up = dec.up_blocks[0].upsamplers[0].conv
    _clear(up)
    for k in range(3):
        for sub in range(4):
            up.weight[2 * k, 2 * (k * 4 + sub), 1, 1] = 0.25
            up.weight[2 * k + 1, 2 * (k * 4 + sub) + 1, 1, 1] = 0.25
    _const_pair(up, 6, 24)
    _clear(dec.conv_out)
    for k in range(3):
        dec.conv_out.weight[k, 2 * k, 1, 1] = CONST / 4
        dec.conv_out.weight[k, 2 * k + 1, 1, 1] = -CONST / 4


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


def _inverse_sigma_weights() -> Any:
    """Weights w over the 256 sinusoidal features of the timestep (diffusers' Timesteps(256) of
    1000 sigma) with w . features ~ 1 / sigma: least squares on sigma in [0, 1] (1 / sigma capped at
    50, relative error weighted), features up to 120 rad only so float32 timesteps stay exact enough.
    Relative error at most 4.7 % for sigma >= 0.05 (rcond 1e-4 keeps |w| at 72, so float32 sums agree
    batched and single to ~1e-5; rcond 1e-6 fits to 1.3 % but |w| is 1400)."""
    import math

    import torch
    from diffusers.models.embeddings import get_timestep_embedding

    s = torch.linspace(0.0, 1.0, 8001, dtype=torch.float64)
    features = get_timestep_embedding(s * 1000, 256, flip_sin_to_cos=True, downscale_freq_shift=0).double()
    freqs = 1000 * torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float64) / 128)
    keep = torch.cat([freqs <= 120, freqs <= 120])
    target = torch.clamp(1 / s.clamp_min(1e-9), max=50.0)
    w = torch.zeros(256, dtype=torch.float64)
    w[keep] = torch.linalg.lstsq(features[:, keep] / target[:, None], torch.ones_like(s), rcond=1e-4,
                                 driver="gelsd").solution
    return w.float()


def _rope_query_key(heads: int) -> tuple[Any, Any]:
    """One head's query and key (16 dims, RoPE pairs: id0 x2, row x3, col x3) whose rotated score is
    highest for the key token at the query's (row, col) with id0 one more: a target token attends
    to the control token at its own place. Logits: ~`ROUTE` at the match, >= 20 lower elsewhere."""
    import math

    import torch

    q, k = torch.zeros(16), torch.zeros(16)
    amp = {0: 2.0, 2: 0.0, 4: 1.0, 6: 1.5, 8: 1.0, 10: 1.0, 12: 1.5, 14: 1.0}  # pair start -> weight
    for i, a in amp.items():
        k[i], q[i] = math.sqrt(ROUTE * a), math.sqrt(ROUTE * a)
    # id0 pair (frequency 1): the query turned by +1 rad, so the score peaks at id0_k = id0_q + 1
    q[0], q[1] = math.sqrt(ROUTE * 2.0) * math.cos(1.0), math.sqrt(ROUTE * 2.0) * math.sin(1.0)
    return q.repeat(heads), k.repeat(heads)


def copy_transformer(seed_model: Any) -> Any:
    """Sets the seeded FluxTransformer2DModel's weights so that it predicts the velocity that lands on
    the control: v = (x_t - control) / sigma per target token, i.e. an edit model that reproduces
    its input (what a trained Kontext does for an edit it does not know). The LoRA learns the edit.

    The residual stream holds the 64 token channels and a (+C, -C) pair (LayerNorm then only divides
    by a fixed C / sqrt(64) and subtracts the channel mean, which a zero channel reads back); the
    double block's attention routes the control token at the target's place (constant query and
    key, RoPE decides) and subtracts its latent; the timestep embedding carries 100 + 1 / sigma (in
    SiLU's linear range) into norm_out's scale; the single block and every MLP add nothing."""
    import torch

    m, d = seed_model, seed_model.inner_dim
    big, zero_ch = TOKEN_CONST, d - 1
    std = big * (2 / d) ** 0.5  # LayerNorm's std over the d channels, the pair dominating
    with torch.no_grad():
        te = m.time_text_embed
        for lin in (te.timestep_embedder.linear_2, te.guidance_embedder.linear_2, te.text_embedder.linear_2):
            _clear(lin)
        te.timestep_embedder.linear_1.weight[0] = _inverse_sigma_weights()
        te.timestep_embedder.linear_1.bias[0] = 100.0
        te.timestep_embedder.linear_2.weight[0, 0] = 1.0  # temb[0] = 100 + 1 / sigma, the rest 0
        _clear(m.x_embedder)
        m.x_embedder.weight[:64, :64] = torch.eye(64)
        m.x_embedder.bias[64], m.x_embedder.bias[65] = big, -big
        block = m.transformer_blocks[0]
        for norm in (block.norm1.linear, block.norm1_context.linear):
            _clear(norm)
        block.norm1.linear.bias[2 * d:3 * d] = 1.0  # gate_msa 1
        block.norm1.linear.bias[5 * d:] = 1.0  # gate_mlp 1 (its output layer is 0)
        at = block.attn
        q, k = _rope_query_key(d // 16)
        for lin, vec, norm in ((at.to_q, q, at.norm_q), (at.to_k, k, at.norm_k)):
            _clear(lin)
            lin.bias.copy_(vec)
            norm.weight.copy_(vec[:16].pow(2).mean().sqrt())  # RMSNorm gives the vector back
        _clear(at.add_k_proj)  # text keys 0: logit 0 against ~ROUTE
        _clear(at.to_v)
        for j in range(64):
            at.to_v.weight[j, j], at.to_v.weight[j, zero_ch] = std, -std  # the control's latent
        _clear(at.to_out[0])
        at.to_out[0].weight[:64, :64] = -torch.eye(64)  # x_t - control
        at.to_out[0].weight[66:66 + PIXEL_TOKEN, :PIXEL_TOKEN] = torch.eye(PIXEL_TOKEN)  # and the control's pixels beside
        ff_in = block.ff.net[0].proj.weight
        ff_in[:, :66] = 0.0  # the MLP reads only the control's pixels: random features of the colours there
        ff_in[:, 66 + PIXEL_TOKEN:] = 0.0
        ff_in *= MLP_GAIN  # pre-activations of std ~1 (GELU's bend), the constant pair not amplified
        _clear(block.ff.net[2])  # ... which the LoRA learns to read out: the edit
        _clear(m.single_transformer_blocks[0].proj_out)
        _clear(m.norm_out.linear)
        m.norm_out.linear.weight[:d, 0] = 1.0
        m.norm_out.linear.bias[:d] = -101.0  # 1 + scale = 1 / sigma, shift 0
        _clear(m.proj_out)
        for j in range(64):
            m.proj_out.weight[j, j], m.proj_out.weight[j, zero_ch] = std, -std
    return m


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import FluxTransformer2DModel

    components = flux_tiny.build_components("flux-dev", seed)
    if variant == "flux-kontext":  # the tests' random-weight model
        return components
    components["vae"] = seeded(seed, unshuffle_vae)
    components["transformer"] = seeded(seed, lambda: copy_transformer(FluxTransformer2DModel(
        patch_size=1, in_channels=64, out_channels=None, num_layers=1, num_single_layers=1,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=T5_DMODEL,
        pooled_projection_dim=CLIP_HIDDEN, guidance_embeds=True, axes_dims_rope=ROPE_AXES,
    ).eval()))
    return components
