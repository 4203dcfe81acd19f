"""Krea 2 against its own diffusers pipeline (Krea2Pipeline), on the tiny real architecture.

    .venv/bin/python -m pytest tests/test_family_krea2.py -q

- caption encoding equals `encode_prompt` (prefix, padding before the suffix, valid-token positions,
  tapped layers, dropped prefix, truncation), also against the pipeline's own 512-token layout;
- one training loss equals what the pipeline's own denoising step implies (timestep = sigma, velocity
  target, packing, position ids, text mask), and a padded batch trains like its items one by one;
- the timestep shift is the scheduler's at Krea 2's resolution-aware mu, latent normalization is what
  the decode inverts, packing and position ids are the pipeline's helpers.
"""

from __future__ import annotations

import diffusers
import pytest
import torch
from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

from conftest import FAMILIES, tiny_model
from stages.core import flow, lora
from stages.core.config import CaptionsConfig, TrainConfig
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family
from stages.families.base import BatchMeta

CAPTIONS = ["a red circle", "a large blue square on a white background at the top left corner of the picture"]
CPU = make_runtime("cpu", "fp32")


@pytest.fixture(scope="module")
def krea(assets):
    """(family, model folder, Krea2Pipeline loaded from it)."""
    folder = tiny_model(assets, FAMILIES["krea2"])
    pipe = diffusers.Krea2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return get_family("krea2"), folder, pipe


def _encode(family, folder, max_len: int) -> dict[str, torch.Tensor]:
    encoder = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=max_len), CPU)
    return encoder.encode(CAPTIONS)


def _pipeline_rows(pipe, max_len: int) -> list[torch.Tensor]:
    """The valid text tokens the pipeline hands its transformer, (tokens, layers, D) per caption."""
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(list(CAPTIONS), device="cpu", max_sequence_length=max_len)
    assert embeds.shape[1] == max_len and mask.dtype == torch.bool
    return [e[m] for e, m in zip(embeds, mask)]


@pytest.mark.parametrize("max_len", [64, 12])  # 12 cuts the long caption: truncation must match too
def test_text_encoding_matches_pipeline(krea, max_len):
    family, folder, pipe = krea
    ours = _encode(family, folder, max_len)
    rows = _pipeline_rows(pipe, max_len)
    assert ours["prompt_embeds"].shape == (2, max_len, len(pipe.text_encoder_select_layers),
                                           pipe.text_encoder.config.text_config.hidden_size)
    assert ours["prompt_length"].tolist() == [len(r) for r in rows]
    for i, row in enumerate(rows):
        torch.testing.assert_close(ours["prompt_embeds"][i, :len(row)], row, rtol=1e-5, atol=1e-5)
        assert not ours["prompt_embeds"][i, len(row):].any(), "padding must be zeros"
    if max_len == 12:
        assert len(rows[1]) == 12, "the long caption must be cut"
    else:  # the same valid tokens as in the pipeline's default 512-token block: padding shifts no position
        for i, row in enumerate(_pipeline_rows(pipe, 512)):
            torch.testing.assert_close(ours["prompt_embeds"][i, :len(row)], row, rtol=1e-5, atol=1e-5)


def test_token_counts_report_untruncated_length(krea):
    family, folder, pipe = krea
    encoder = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=12), CPU)
    full = [len(r) for r in _pipeline_rows(pipe, 512)]
    assert encoder.token_counts(CAPTIONS) == full
    assert full[1] > 12, "the long caption must need more than 12 tokens for this test"


def _meta(b: int, h: int, w: int) -> BatchMeta:
    size = torch.tensor([[h * 2, w * 2]] * b)
    return BatchMeta(original_size=size, crop_top_left=torch.zeros(b, 2, dtype=torch.long), target_size=size)


def test_training_loss_matches_pipeline_step(krea):
    """Our loss at (x0, noise, sigma) equals the MSE between the velocity the pipeline steps with at
    x_t (its 512-token text block, one Euler step to sigma = 0, no CFG) and noise - x0."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    family, folder, shared = krea
    pipe = diffusers.Krea2Pipeline(**{**shared.components, "scheduler": FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)}, text_encoder_select_layers=shared.text_encoder_select_layers)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 8, 8, generator=g)
    with torch.no_grad():
        out = pipe(list(CAPTIONS), height=16, width=16, num_inference_steps=1, sigmas=[0.6], guidance_scale=0.0,
                   latents=pipe._pack_latents(latents, 2, 16, 8, 8), output_type="latent").images
        sigma = float(pipe.scheduler.sigmas[0])
        velocity = (latents - flow.unpack_2x2(out, 8, 8)) / sigma
        noise = torch.randn(latents.shape, generator=g)
        x0 = (latents - sigma * noise) / (1 - sigma)  # so that (1 - sigma) x0 + sigma noise = latents
        cond = _encode(family, folder, 64)
        assert cond["prompt_length"][0] != cond["prompt_length"][1]
        ours = family.loss(pipe.transformer, x0, noise, torch.full((2,), sigma), cond, _meta(2, 8, 8), TrainConfig())
    expected = ((velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    wrong_sign = ((-velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    assert (wrong_sign - expected).abs().min() > 1e-3, "the check must tell the output's sign apart"


def test_padded_batch_trains_like_single_items(krea):
    family, folder, _ = krea
    model = family.load_denoiser(ModelSource(str(folder)), "fp32", CPU, TrainConfig())
    params = lora.attach_lora(model, lora.lora_config(4, 8, 0.0, family.default_lora_targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero up-projections, so both LoRA matrices get gradients
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    cond = _encode(family, folder, 64)
    lengths = cond["prompt_length"].tolist()
    x0, noise, t = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 16, 8, 8, generator=g), torch.tensor([0.3, 0.8])

    def loss_and_grads(rows: list[int], c: dict[str, torch.Tensor]):
        model.zero_grad(set_to_none=True)
        per_item = family.loss(model, x0[rows], noise[rows], t[rows], {k: v[rows] for k, v in c.items()},
                               _meta(len(rows), 8, 8), TrainConfig())
        per_item.mean().backward()
        return per_item.detach(), [p.grad.clone() for p in params]

    batch_losses, batch_grads = loss_and_grads([0, 1], cond)
    singles = [loss_and_grads([i], cond) for i in range(2)]
    torch.testing.assert_close(batch_losses, torch.cat([s[0] for s in singles]), rtol=1e-5, atol=1e-6)
    for j, grad in enumerate(batch_grads):
        torch.testing.assert_close(grad, (singles[0][1][j] + singles[1][1][j]) / 2, rtol=1e-4, atol=1e-7)
    unmasked = {**cond, "prompt_length": torch.tensor([lengths[1], lengths[1]])}
    attended, _ = loss_and_grads([0], unmasked)
    assert (attended - singles[0][0]).abs().item() > 1e-4, "had padding been attended, the loss would differ"


@pytest.mark.parametrize("latent_hw", [(32, 32), (128, 96)])  # 256 and 3072 image tokens
def test_timesteps_are_the_schedulers_at_krea2_shift(krea, latent_hw):
    family, folder, _ = krea
    # The tiny pipeline's scheduler as saved (the Krea2Pipeline docstring's settings).
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    s = scheduler.config
    assert s.use_dynamic_shifting and s.time_shift_type == "exponential"
    seq_len = (latent_hw[0] // 2) * (latent_hw[1] // 2)
    mu = calculate_shift(seq_len, s.base_image_seq_len, s.max_image_seq_len, s.base_shift, s.max_shift)
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / 1000, 1000).tolist(), mu=mu)
    tcfg = TrainConfig(timestep_density="uniform", dynamic_shift=True)
    ours = family.sample_timesteps(64, latent_hw, torch.Generator().manual_seed(4), tcfg)
    u = torch.rand(64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours, scheduler.sigmas[:-1][(u * 1000).long()].float(), rtol=1e-5, atol=1e-6)
    flux_range = calculate_shift(seq_len)  # FLUX's 256..4096: a different shift above 256 tokens
    assert seq_len == 256 or abs(flux_range - mu) > 0.1


def test_latent_normalization_packing_and_positions_as_pipeline(krea):
    family, folder, pipe = krea
    vae = pipe.vae
    norm = family.latent_normalization(vae)
    z = torch.randn(2, 16, 6, 4, generator=torch.Generator().manual_seed(3))
    x = family.normalize_latents(z, norm)
    std, mean = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1), torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1)
    torch.testing.assert_close(x / (1.0 / std) + mean, z, rtol=1e-5, atol=1e-5)  # the pipeline's decode
    torch.testing.assert_close(family.denormalize_latents(x, norm), z, rtol=1e-5, atol=1e-5)
    assert family.pixel_multiple(ModelSource(str(folder))) == pipe.vae_scale_factor * pipe.patch_size
    packed = pipe._pack_latents(z, 2, 16, 6, 4)
    assert torch.equal(flow.pack_2x2(z), packed)
    size = dict(height=6 * pipe.vae_scale_factor, width=4 * pipe.vae_scale_factor)
    assert torch.equal(flow.unpack_2x2(packed, 6, 4), pipe._unpack_latents(packed, **size).squeeze(2))
    assert torch.equal(family.position_ids(7, 6, 4, torch.device("cpu")), pipe.prepare_position_ids(7, 3, 2, "cpu"))


@pytest.mark.parametrize("n, ok", [(5, False), (6, True)])
def test_config_check_leaves_room_for_a_caption_token(n, ok):
    from stages.core.config import load_config
    from stages.demo import demo_config
    from stages.families import config_errors

    errors = config_errors(load_config(demo_config("krea2"), {"model": "unused", "captions.max_sequence_length": n}))
    if ok:
        assert errors == []
    else:
        assert len(errors) == 1 and "'captions.max_sequence_length' = 5" in errors[0] and "6 or more" in errors[0]
