"""The edit demo learns the edit: the sample stage's `edit_error` (stages/edit_error.py) measures each
column's latent distance to the targets; the tiny Kontext's base reproduces the control, and after the
demo's training the LoRA's outputs are closer to the targets than the unedited control: the edit is
learnt. The plumbing on flux-kontext's built run (conftest.built_run, the tests' random-weight model),
the learning on the demo's own model ("flux-kontext-edit"), in-process."""

from __future__ import annotations

import dataclasses

import diffusers
import pytest
import torch

from conftest import make_cfg, tiny_model
from stages import cache_latents, edit_error, encode_captions, export_lora, sample, train
from stages.core import dataset
from stages.core.config import SampleConfig
from stages.families import get_family

FAMILY = "flux-kontext"
on_kontext = pytest.mark.parametrize("built_run", [FAMILY], indirect=True)
DEMO_MODEL = "flux-kontext-edit"  # stages/families/flux_kontext/tiny.py: the base reproduces the control


@pytest.fixture(scope="module")
def demo_model(assets):
    return tiny_model(assets, DEMO_MODEL)


@on_kontext
def test_edit_error_is_zero_for_the_targets_own_latents(built_run):
    """A 'rendered' column whose decoded latents are the targets' own scores 0; the control scores
    what an edit that changes nothing would: the plumbing (normalization, order, shapes) is exact."""
    cfg = built_run
    family = get_family(cfg.family)
    pipe = diffusers.FluxKontextPipeline.from_pretrained(cfg.model)
    items = sample.edit_items(cfg)
    size, background = (64, 64), cfg.data.background
    targets = [it.image_path for it in items]
    norm = family.latent_normalization(pipe.vae)
    own = [family.denormalize_latents(edit_error.image_latent(pipe, family, dataset.load_image(t), size), norm)
           for t in targets]
    controls = [[dataset.load_image(it.controls[0])] for it in items]
    noise = [torch.randn(z.shape, generator=torch.Generator().manual_seed(i)) for i, z in enumerate(own)]
    errors = edit_error.column_errors(pipe, family, ["base", "LoRA"], [*noise, *own], targets, controls, size,
                                      background, seeds=1)
    assert errors["LoRA"] < 1e-9 < errors[edit_error.CONTROL] < errors["base"]
    assert edit_error.closer_percent(errors, "LoRA") == 100.0
    with pytest.raises(RuntimeError, match="decoded latents"):
        edit_error.column_errors(pipe, family, ["base"], own[:2], targets, controls, size, background, seeds=1)


def test_the_tiny_vae_is_a_near_exact_pixel_unshuffle(demo_model):
    """The tiny Kontext VAE (stages/families/flux_kontext/tiny.py): its posterior mean is 2.5 x the
    2x2 pixel-unshuffled image, its std 5e-5, and it decodes a latent to each 2x2 block's mean."""
    vae = diffusers.AutoencoderKL.from_pretrained(demo_model, subfolder="vae")
    pixels = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        dist = vae.encode(pixels).latent_dist
        decoded = vae.decode(dist.mean).sample
    assert torch.allclose(dist.mean[:, :12], 2.5 * torch.nn.functional.pixel_unshuffle(pixels, 2), atol=3e-3)
    assert dist.mean[:, 12:].abs().max() == 0 and float(dist.std.max()) < 1e-4
    blocks = torch.nn.functional.avg_pool2d(pixels, 2).repeat_interleave(2, -1).repeat_interleave(2, -2)
    assert torch.allclose(decoded, blocks, atol=2e-3)


def test_after_the_demo_training_the_lora_applies_the_edit(demo_model, assets, edit_data, tmp_path, monkeypatch):
    """The demo config's training (its steps and LR) on the edit pairs, then the sample stage: the
    base reproduces the control (the tiny Kontext is set to), and the LoRA's outputs are much closer
    to the targets than the base's, closer than the unedited control: it applied the edit. Sample
    reads each control image once (the grid and the edit errors share them)."""
    from collections import Counter

    from stages.core import dataset

    cfg = make_cfg(FAMILY, assets, edit_data, tmp_path, model=str(demo_model))  # the demo's config and model
    for stage in (encode_captions, cache_latents, train):
        stage.run(cfg)
    export_lora.run(cfg)
    cfg = dataclasses.replace(cfg, sample=SampleConfig(seeds=[0], steps=8))
    reads, load_image = Counter(), dataset.load_image
    monkeypatch.setattr(dataset, "load_image", lambda path, *a, **k: reads.update([str(path)]) or load_image(path, *a, **k))
    manifest = sample.run(cfg)
    controls = [str(p) for _, row in sample.edit_rows(cfg) for p in row]
    assert controls and {p: reads[p] for p in controls} == {p: 1 for p in controls}
    errors, final = manifest["edit_error"], manifest["columns"][-1]
    assert set(errors) == {"base", final, edit_error.CONTROL}
    assert abs(errors["base"] - errors[edit_error.CONTROL]) < 0.01 * errors[edit_error.CONTROL], errors
    assert errors[final] < 0.7 * errors[edit_error.CONTROL], errors
    assert manifest["edit_closer_percent"] == edit_error.closer_percent(errors, final) > 30
