"""FLUX.2 klein against its own diffusers pipeline (Flux2KleinPipeline), on the tiny real architecture.

    .venv/bin/python -m pytest tests/families/test_family_flux2_klein.py -q

- caption encoding equals the pipeline's `encode_prompt` (chat template, layers 9/18/27, padding
  kept, truncation);
- latent normalization equals `_encode_vae_image` (patchify, batch-norm statistics) and its
  inverse the decode in `__call__`;
- packing and position ids equal `_pack_latents(_patchify_latents(.))`, `_prepare_latent_ids`,
  `_prepare_text_ids`;
- one training loss equals what the pipeline's own denoising step implies;
- `train.dynamic_shift` sigmas are the scheduler's, shifted by `compute_empirical_mu`;
- the config checks.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

import flux2_checks
from conftest import FAMILIES, ROOT, tiny_model
from stages.core import flow
from stages.core.config import CaptionsConfig, TrainConfig, load_config
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import config_errors, get_family
from stages.families.base import BatchMeta

NAME = "flux2-klein"
CAPTIONS = ["a red circle", "a large blue square on a white background at the top left corner of the picture"]
CPU = make_runtime("cpu", "fp32")


@pytest.fixture(scope="module")
def klein(assets):
    """(family, model folder, pipeline loaded by its real class)."""
    folder = tiny_model(assets, FAMILIES[NAME])
    pipe = Flux2KleinPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return get_family(NAME), folder, pipe


def _encoder(family, folder, max_len: int):
    return family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=max_len), CPU)


@pytest.mark.parametrize("max_len", [64, 12])  # 12 cuts both captions: truncation must match too
def test_text_encoding_matches_pipeline(klein, max_len):
    family, folder, pipe = klein
    ours = _encoder(family, folder, max_len).encode(CAPTIONS)["prompt_embeds"]
    expected, text_ids = pipe.encode_prompt(list(CAPTIONS), device="cpu", max_sequence_length=max_len)
    assert ours.shape == (2, max_len, 3 * pipe.text_encoder.config.hidden_size)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(family.position_ids("text", 1, max_len, torch.device("cpu")), text_ids[0])


def test_token_counts_report_untruncated_length(klein):
    family, folder, pipe = klein
    counts = _encoder(family, folder, 12).token_counts(CAPTIONS)
    templated = [pipe.tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=False) for c in CAPTIONS]
    assert counts == [len(pipe.tokenizer(t).input_ids) for t in templated]
    assert 12 < counts[0] < counts[1]


def test_latent_normalization_as_pipeline(klein):
    flux2_checks.latent_normalization_as_pipeline(*klein)


def test_packing_and_image_ids_as_pipeline(klein):
    family, _, pipe = klein
    x = torch.randn(2, 32, 6, 10, generator=torch.Generator().manual_seed(4))
    patched = pipe._patchify_latents(x)
    torch.testing.assert_close(flow.pack_2x2(x), pipe._pack_latents(patched))
    ids = family.position_ids("image", 3, 5, torch.device("cpu"))
    torch.testing.assert_close(ids, pipe._prepare_latent_ids(patched)[0])


def _pipeline_velocity(pipe, latents: torch.Tensor, sigma: float, norm, family) -> torch.Tensor:
    """The velocity the pipeline steps with at `latents` (normalized, unpatchified), from one Euler
    step to sigma = 0: out = latents - sigma * v. The scheduler gets shift 1 so sigma is as asked."""
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    _, _, h, w = latents.shape
    out = pipe(prompt=list(CAPTIONS), height=h * pipe.vae_scale_factor, width=w * pipe.vae_scale_factor,
               num_inference_steps=1, sigmas=[sigma], latents=pipe._patchify_latents(latents), max_sequence_length=64,
               output_type="latent").images  # denormalized and unpatchified by the pipeline
    return (latents - family.normalize_latents(out, norm)) / sigma


def test_training_loss_matches_pipeline_step(klein):
    family, folder, pipe = klein
    norm = family.latent_normalization(pipe.vae)
    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(2, 32, 8, 8, generator=g), torch.randn(2, 32, 8, 8, generator=g)
    sigma = 0.6
    with torch.no_grad():
        velocity = _pipeline_velocity(pipe, latents, sigma, norm, family)
        x0 = (latents - sigma * noise) / (1 - sigma)  # so that (1 - sigma) x0 + sigma noise = latents
        cond = _encoder(family, folder, 64).encode(CAPTIONS)
        size = torch.tensor([[16, 16]] * 2)
        meta = BatchMeta(original_size=size, crop_top_left=torch.zeros(2, 2, dtype=torch.long), target_size=size)
        ours = family.loss(pipe.transformer, x0, noise, torch.full((2,), sigma), cond, meta, TrainConfig())
    expected = ((velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    wrong_sign = ((-velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    assert (wrong_sign - expected).abs().min() > 1e-3, "the check must tell the output's sign apart"


def test_dynamic_shift_is_the_pipeline_schedule(klein):
    family, folder, _ = klein
    flux2_checks.dynamic_shift_is_the_pipeline_schedule(family, folder, compute_empirical_mu)


def test_config_checks(tmp_path):
    from stages.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:  # loading runs the family's checks, all errors at once
        load_config(ROOT / "configs" / "flux2-klein.toml", {"captions.max_sequence_length": 513, "data.bucket_step": 33})
    assert "'captions.max_sequence_length' = 513" in str(err.value) and "512" in str(err.value)
    assert "'data.bucket_step' = 33" in str(err.value)
    assert config_errors(load_config(ROOT / "configs" / "flux2-klein.toml")) == []
