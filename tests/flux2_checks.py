"""Checks of the FLUX.2 image side (stages/families/common/flux2_dit.py, shared by FLUX.2 dev and klein), each
run by both families' test files against their own pipeline: Flux2Pipeline and Flux2KleinPipeline."""

from __future__ import annotations

import math

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from stages.core import flow
from stages.core.config import TrainConfig
from stages.core.model_source import ModelSource


def latent_normalization_as_pipeline(family, folder, pipe) -> None:
    """Normalization equals the pipeline's `_encode_vae_image` (posterior mode, patchified,
    batch-normed), its inverse the decode in `__call__`, and the pixel multiple is the pipeline's."""
    vae = pipe.vae
    norm = family.latent_normalization(vae)
    pixels = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, _ = family.encode_posterior(vae, pixels)
    ours = family.normalize_latents(mean, norm)
    with torch.no_grad():  # the pipeline's reference-image encoding: posterior mode, patchified, batch-normed
        expected = pipe._encode_vae_image(pixels, generator=None)
    torch.testing.assert_close(pipe._patchify_latents(ours), expected, rtol=1e-5, atol=1e-5)
    # __call__'s decode: latents * sqrt(running_var + eps) + running_mean, then unpatchify
    std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, -1, 1, 1)
    decoded = pipe._unpatchify_latents(expected * std + vae.bn.running_mean.view(1, -1, 1, 1))
    torch.testing.assert_close(decoded, mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(family.denormalize_latents(ours, norm), mean, rtol=1e-5, atol=1e-5)
    assert (ours - mean).abs().max() > 0.1, "the tiny VAE's statistics must not be the identity"
    assert family.pixel_multiple(ModelSource(str(folder))) == pipe.vae_scale_factor * 2


def dynamic_shift_is_the_pipeline_schedule(family, folder, compute_empirical_mu) -> None:
    """dynamic_shift draws from the scheduler's sigmas as the pipeline sets them for this token count
    (exponential time shift by the pipeline module's own `compute_empirical_mu` at the default 50
    steps), indexed as the density says."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    assert scheduler.config.use_dynamic_shifting and scheduler.config.time_shift_type == "exponential"
    tokens, n = 64 * 64, flow.NUM_TRAIN_TIMESTEPS
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=compute_empirical_mu(tokens, 50))
    tcfg = TrainConfig(dynamic_shift=True, timestep_density="uniform")
    ours = family.sample_timesteps(256, (128, 128), torch.Generator().manual_seed(5), tcfg)
    u = flow.sample_density(256, torch.Generator().manual_seed(5), "uniform")
    torch.testing.assert_close(ours, scheduler.sigmas[(u * n).long()].float(), rtol=1e-5, atol=1e-6)
    plain = family.sample_timesteps(256, (128, 128), torch.Generator().manual_seed(5), TrainConfig(timestep_density="uniform"))
    assert (ours - plain).abs().max() > 0.1 and math.exp(compute_empirical_mu(tokens, 50)) > 5
