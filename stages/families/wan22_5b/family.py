"""Wan 2.2 TI2V-5B (Wan-AI/Wan2.2-TI2V-5B-Diffusers), text-to-video: the Wan family of
`stages.families.common.wan` (whose docstring says what was checked against diffusers) with Wan 2.2's
high-compression VAE (48 channels, 16 px and 4 frames a latent cell) and one timestep per latent token,
as WanPipeline runs it with `expand_timesteps` (model_index.json of the release)."""

from __future__ import annotations

from stages.families.common.wan import WanBase


class Wan22_5B(WanBase):
    name = "wan2.2-5b"
    title = "Wan 2.2 TI2V-5B"
    expand_timesteps = True
    frame_rate = 24.0  # Wan 2.2's wan/configs/wan_ti2v_5B.py: sample_fps = 24
    pixels_per_token = 32  # the VAE's 16 px a latent cell, then the transformer's 2x2 patches
    outside_rows_per_token = 8.0  # timestep_proj (6 rows), temb and time_embedder's hidden, fp32, per latent token
    # fitted to the H200 row at 640 px and 33 frames (nf4, every block checkpointed): its eager step worked in 1.86 GB
    # of activations (the LoRA's gradients with them) where the default 24 units planned 1.59 (bench/results/wan2.2-5b/)
    block_work_units = 37.0
    vae_downsample = 16
