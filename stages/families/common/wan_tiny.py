"""The Wan families' tiny parts (stages.tiny builds and saves them through each family's `tiny.py`): a
umT5 text encoder on the tiny T5 tokenizer, the Wan 2.2 and Wan 2.1 VAEs and the transformer at tiny widths.

Real config values kept: Wan 2.2's VAE shape rules (`is_residual`, `patch_size` 2 folded into the
channels before the encoder, `scale_factor_spatial` = 2 ** (len(dim_mult) - 1) x patch, the causal
temporal downsampling by 4 = 2 ** (temperal_downsample.count(True))), its 48 channels' latents_mean and
latents_std (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json), and the scheduler config of that repo.
"""

from __future__ import annotations

from typing import Any

from stages.tiny.parts import T5_DMODEL, seeded

# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: the 48 channels' statistics.
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.157, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.052, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]
# Wan-AI/Wan2.2-TI2V-5B-Diffusers scheduler/scheduler_config.json (UniPC over shifted flow sigmas).
WAN22_5B_SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                          flow_shift=5.0, solver_order=2, solver_type="bh2", predict_x0=True, lower_order_final=True,
                          final_sigmas_type="zero", timestep_spacing="linspace")


def umt5_encoder(tokenizer: Any) -> Any:
    """UMT5EncoderModel, 2 layers of width T5_DMODEL (real umt5-xxl: 24 x 4096, 64 heads)."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=T5_DMODEL, d_kv=8, d_ff=64, num_layers=2,
                                       num_heads=4, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                                       pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()


def wan22_vae(seed: int) -> Any:
    """AutoencoderKLWan as Wan 2.2's (residual, 2x2 patchified input, 48 channels), at a tiny width: three
    levels (real four), two downsampling (x 4, times the 2x2 patch: 8 px a latent cell; real 16), both in time
    too (4 frames a latent frame after the first, as real). A residual level must double its width (the
    average-pool shortcut folds 4-8 cells into channels), hence dim_mult [1, 2, 2]."""
    import torch
    from diffusers import AutoencoderKLWan

    vae = seeded(seed, lambda: AutoencoderKLWan(
        base_dim=16, decoder_base_dim=16, z_dim=48, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[True, True], dropout=0.0, is_residual=True, in_channels=12, out_channels=12,
        patch_size=2, scale_factor_temporal=4, scale_factor_spatial=8,
        latents_mean=list(WAN22_LATENTS_MEAN), latents_std=list(WAN22_LATENTS_STD)).eval())
    # A trained VAE's posterior is narrow; a random one's logvar is ~0 (std ~1, ten times its means' spread), which
    # buries the data under sampling noise. The logvar half of quant_conv's bias set to -6 (std 0.05) keeps the
    # posterior's shape and clamping while the means carry the clip, as in the released VAE.
    with torch.no_grad():
        vae.quant_conv.bias[vae.config.z_dim:] = -6.0
    return vae


def wan_transformer(seed: int, in_channels: int) -> Any:
    """WanTransformer3DModel with the released block structure at tiny widths: 2 heads of 16 (real 24 x 128;
    the 3-axis RoPE splits a head 8 / 4 / 4), 2 blocks (real 30), text width T5_DMODEL (real 4096)."""
    from diffusers import WanTransformer3DModel

    return seeded(seed, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=in_channels,
        out_channels=in_channels, text_dim=T5_DMODEL, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024).eval())


# Wan-AI/Wan2.2-T2V-A14B-Diffusers scheduler: UniPC as TI2V-5B's with the repo's flow_shift 3.0.
WAN22_A14B_SCHEDULER = {**WAN22_5B_SCHEDULER, "flow_shift": 3.0}


def wan21_vae(seed: int) -> Any:
    """AutoencoderKLWan as Wan 2.1's, which Wan 2.2 A14B uses (not residual, no patchifying, 16 channels, the
    class defaults' latents_mean / latents_std: the released statistics), at a tiny width: four levels as real,
    three spatial downsamplings (8 px a latent cell, as real), the last two in time too (4 frames a latent frame
    after the first, as real). The logvar bias set to -6 as in `wan22_vae`, a trained VAE's narrow posterior."""
    import torch
    from diffusers import AutoencoderKLWan

    vae = seeded(seed, lambda: AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[False, True, True], dropout=0.0).eval())
    with torch.no_grad():
        vae.quant_conv.bias[vae.config.z_dim:] = -6.0
    return vae

