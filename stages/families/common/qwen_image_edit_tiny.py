"""Qwen-Image-Edit-Plus's tiny pipelines in a QwenImageEditPlusPipeline (Qwen-Image-Edit-2509 and
-2511 ship Qwen-Image's architecture, 2511 with the transformer's `zero_cond_t` set), which the
families `qwen-image-edit` and `qwen-image-edit-2511` build (their `tiny.py`), each with the Qwen2-VL
processor the Plus pipeline feeds the control images through (the video-less stand-in of
`qwen_image_edit_processor.py`, see there why; its image processor keeps Qwen2-VL's defaults, patch
14, merge 2, temporal patch 2, which the tiny vision tower matches):

- the tests' model ("qwen-image-edit"): the tiny random-weight Qwen-Image components
  (stages/families/common/qwen_image_tiny.py); with `zero_cond_t`, the same weights in a transformer
  whose config sets it.
- the edit demo's model ("qwen-image-edit-edit"): the same text encoder, processor and scheduler; the
  VAE is the real AutoencoderKLQwenImage with its weights set to an exact 2x2 pixel-unshuffle (12 of
  the 16 latent channels carry the pixels; normalized by the Wan statistics it keeps, a latent is
  `LATENT_GAIN` x pixel) with a logvar of `LOGVAR`, decoding each latent pixel's 2x2 mean back; the
  transformer is 8 heads wide and set to reproduce the control (stages/tiny/copy_edit.py, shared
  with FLUX.1 Kontext's demo model), so the LoRA has an edit to learn.

How the VAE stays linear: (+x, -x) pairs beside a (+C, -C) constant pair (stages/tiny/copy_edit.py);
its RMS norms (no mean, F.normalize over channels x sqrt(channels)) then divide by sqrt(2) C to within
(pixel / C)^2. The causal 3-D convs read a single frame at their last time tap (2 zero frames pad it).
Residual branches (conv2) and the mid-block attention (proj) are zero; the other weights stay seeded.
"""

from __future__ import annotations

from typing import Any

from stages.families.common import qwen_image_tiny as qwen_tiny
from stages.tiny import copy_edit
from stages.tiny.parts import HEAD_DIM, QWEN_HIDDEN, ROPE_AXES, seeded

PIPELINE_CLASS = "QwenImageEditPlusPipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
DIMS = qwen_tiny.TINY_DIMS["qwen-image"]

BASE_DIM = 32  # encoder 32 -> 64 channels, decoder 64 -> 32: 12 signal pairs + the constant pair fit after the unshuffle
CONST = 1000.0  # the constant pair: the RMS norms' divisor is sqrt(2) C to within 6 / C^2
LATENT_GAIN = 0.9  # normalized latent = 0.9 x pixel in [-1, 1], as the Kontext demo's (2.5 x 0.3611)
LOGVAR = -20.0  # posterior std exp(-10) = 4.5e-5
FRAME_TAP = (2, 1, 1)  # a causal 3x3x3 conv's tap on the current frame's centre pixel


def _silence_residuals(half: Any) -> None:
    """Residual blocks and the mid-block attention add nothing: each is its shortcut."""
    for m in half.modules():
        if hasattr(m, "conv2") and hasattr(m, "conv_shortcut"):  # QwenImageResidualBlock
            copy_edit.clear(m.conv2)
        if hasattr(m, "to_qkv"):  # QwenImageAttentionBlock
            copy_edit.clear(m.proj)


def _rms_gain(channels: int) -> float:
    """What undoes the RMS norm over `channels` of a pair stream: it gives x sqrt(channels) / (sqrt(2) C)."""
    return CONST * (2 / channels) ** 0.5


def _set_encoder(vae: Any) -> None:
    """conv_in: (+p, -p) for the 3 colours and the constant pair; the downsampler's stride-2 conv
    pixel-unshuffles from tap (a, b); the widening block's shortcut passes the 32 channels on;
    conv_out takes the pairs' SiLU difference back to pixels; quant_conv scales them by each
    channel's std (and adds its mean) so the normalized latent is LATENT_GAIN x pixel, and sets the logvar."""
    import torch

    enc, z = vae.encoder, vae.config.z_dim
    copy_edit.pairs_in(enc.conv_in, torch.eye(3), FRAME_TAP, CONST)
    copy_edit.unshuffle_conv(enc.down_blocks[1].resample[1])
    widen = enc.down_blocks[2].conv_shortcut
    copy_edit.clear(widen)
    widen.weight[:BASE_DIM, :, 0, 0, 0] = torch.eye(BASE_DIM)
    copy_edit.pair_differences(enc.conv_out, 12, _rms_gain(2 * BASE_DIM), FRAME_TAP)
    mean, std = torch.tensor(vae.config.latents_mean), torch.tensor(vae.config.latents_std)
    copy_edit.clear(vae.quant_conv)
    vae.quant_conv.weight[:12, :12, 0, 0, 0] = torch.diag(LATENT_GAIN * std[:12])
    vae.quant_conv.bias[:z] = mean
    vae.quant_conv.bias[z:] = LOGVAR


def _set_decoder(vae: Any) -> None:
    """post_quant_conv normalizes per channel; conv_in: the 12 pixel channels as pairs (1 / LATENT_GAIN)
    and the constant pair; the upsampler's conv (after nearest x2) averages each colour's 4
    sub-pixels; conv_out: SiLU differences to pixels."""
    import torch

    dec, z = vae.decoder, vae.config.z_dim
    mean, std = torch.tensor(vae.config.latents_mean), torch.tensor(vae.config.latents_std)
    copy_edit.clear(vae.post_quant_conv)
    vae.post_quant_conv.weight[:, :, 0, 0, 0] = torch.diag(1 / std)
    vae.post_quant_conv.bias.copy_(-mean / std)
    copy_edit.pairs_in(dec.conv_in, torch.eye(12, z) / LATENT_GAIN, FRAME_TAP, CONST)
    copy_edit.average_conv(dec.up_blocks[0].upsamplers[0].resample[1])
    copy_edit.pair_differences(dec.conv_out, 3, _rms_gain(BASE_DIM), FRAME_TAP)


def unshuffle_vae() -> Any:
    """The tiny AutoencoderKLQwenImage (scale factor 2, the Wan statistics) as a fixed pixel-unshuffle."""
    import torch
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage(
        base_dim=BASE_DIM, z_dim=16, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False],
        dropout=0.0, latents_mean=list(qwen_tiny.LATENTS_MEAN), latents_std=list(qwen_tiny.LATENTS_STD),
    ).eval()
    with torch.no_grad():
        for half in (vae.encoder, vae.decoder):
            _silence_residuals(half)
        _set_encoder(vae)
        _set_decoder(vae)
    return vae


def copy_transformer(m: Any) -> Any:
    """The seeded QwenImageTransformer2DModel set to reproduce the control (stages/tiny/copy_edit.py)."""
    block = m.transformer_blocks[0]
    copy_edit.copy_transformer(copy_edit.MMDiTParts(
        inner_dim=m.inner_dim, embedder=m.img_in, timestep=m.time_text_embed.timestep_embedder,
        image_modulation=block.img_mod[1], text_modulation=block.txt_mod[1], attn=block.attn, mlp=block.img_mlp,
        norm_out=m.norm_out.linear, proj_out=m.proj_out))
    return m


def build_components(demo: bool, seed: int, zero_cond_t: bool = False) -> dict[str, Any]:
    """The tests' random-weight model, or (`demo`) the edit demo's; `zero_cond_t` sets the transformer's
    flag of that name (Qwen-Image-Edit-2511), its weights unchanged."""
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2VLImageProcessorPil

    from stages.families.common.qwen_image_edit_processor import Qwen2VLImageProcessorOnly

    components = qwen_tiny.build_components("qwen-image", seed)
    components["processor"] = Qwen2VLImageProcessorOnly(Qwen2VLImageProcessorPil(), components["tokenizer"])
    if not demo:
        if zero_cond_t:
            base = components["transformer"]
            init = {k: v for k, v in base.config.items() if not k.startswith("_")}  # not _use_default_values
            flagged = QwenImageTransformer2DModel(**{**init, "zero_cond_t": True})
            flagged.load_state_dict(base.state_dict())
            components["transformer"] = flagged.eval()
        return components
    components["vae"] = seeded(seed, unshuffle_vae)
    components["transformer"] = seeded(seed, lambda: copy_transformer(QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=HEAD_DIM,
        num_attention_heads=copy_edit.HEADS, joint_attention_dim=QWEN_HIDDEN, guidance_embeds=False,
        axes_dims_rope=ROPE_AXES, zero_cond_t=zero_cond_t,
    ).eval()))
    return components
