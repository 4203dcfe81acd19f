"""The edit demos learn the edit: the sample stage's `edit_error` (stages/edit_error.py) measures each
column's latent distance to the targets; each edit family's demo model (its DEMO_MODEL_VARIANT,
stages/tiny/copy_edit.py) has a base that reproduces the control, and after the demo's training the
LoRA's outputs are closer to the targets than the unedited control: the edit is learnt. The plumbing
on flux-kontext's built run (conftest.built_run, the tests' random-weight model), the learning on the
demo's own models ("flux-kontext-edit", "qwen-image-edit-edit") and data, in-process."""

from __future__ import annotations

import dataclasses
import json

import diffusers
import pytest
import torch

from conftest import make_cfg, tiny_model
from stages import cache_latents, edit_error, encode_captions, export_lora, sample, train
from stages.core import image_io
from stages.core.config import SampleConfig
from stages.demo import demo_edit_sizes
from stages.families import demo_model_variant, get_family

FAMILY = "flux-kontext"
on_kontext = pytest.mark.parametrize("built_run", [FAMILY], indirect=True)
EDIT_FAMILIES = ("flux-kontext", "qwen-image-edit")
# normalized latent = gain x pixel-unshuffled image + offset (stages/families/<family>/tiny.py):
# Kontext's VAE gives 2.5 x pixel, normalized by FLUX.1's (z - 0.1159) x 0.3611; Qwen's 0.9 x pixel after the Wan statistics
LATENT_AFFINE = {"flux-kontext": (2.5 * 0.3611, -0.1159 * 0.3611), "qwen-image-edit": (0.9, 0.0)}


@pytest.fixture(scope="module", params=EDIT_FAMILIES)
def demo_family(request, assets, edit_data):
    """(family, its demo model, its demo's edit pairs)."""
    from stages.tiny.shapes import make_edit_dataset

    family = request.param
    sizes = demo_edit_sizes(family)
    data = edit_data if sizes is None else make_edit_dataset(assets / f"data-edit-{family}", n=12, seed=0, sizes=sizes)
    return family, tiny_model(assets, demo_model_variant(family)), data


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
    own = [family.denormalize_latents(edit_error.image_latent(pipe, family, image_io.load_image(t), size), norm)
           for t in targets]
    controls = [[image_io.load_image(it.controls[0])] for it in items]
    noise = [torch.randn(z.shape, generator=torch.Generator().manual_seed(i)) for i, z in enumerate(own)]
    errors = edit_error.column_errors(pipe, family, ["base", "LoRA"], [*noise, *own], targets, controls, size,
                                      background, seeds=1)
    assert errors["LoRA"] < 1e-9 < errors[edit_error.CONTROL] < errors["base"]
    assert edit_error.closer_percent(errors, "LoRA") == 100.0
    with pytest.raises(RuntimeError, match="decoded latents"):
        edit_error.column_errors(pipe, family, ["base"], own[:2], targets, controls, size, background, seeds=1)


def test_the_demo_vae_is_a_near_exact_pixel_unshuffle(demo_family):
    """The demo model's VAE, encoded and normalized as training does: the latent's 12 pixel channels
    are an affine map of the 2x2 pixel-unshuffled image, the other 4 constant, the posterior std
    below 1e-4; it decodes a latent to each 2x2 block's mean."""
    name, model, _ = demo_family
    family = get_family(name)
    vae = getattr(diffusers, family.vae_class).from_pretrained(model, subfolder="vae")
    pixels = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    gain, offset = LATENT_AFFINE[name]
    with torch.no_grad():
        mean, logvar = family.encode_posterior(vae, pixels)
        latent = family.normalize_latents(mean, family.latent_normalization(vae))
        frames = isinstance(vae, diffusers.AutoencoderKLQwenImage)  # a 3-D VAE decodes (B, C, T, H, W)
        decoded = vae.decode(mean.unsqueeze(2) if frames else mean).sample.reshape(pixels.shape)
    assert torch.allclose(latent[:, :12], gain * torch.nn.functional.pixel_unshuffle(pixels, 2) + offset, atol=3e-3)
    assert torch.allclose(latent[:, 12:], torch.full_like(latent[:, 12:], offset), atol=1e-5)
    assert float((logvar / 2).exp().max()) < 1e-4
    blocks = torch.nn.functional.avg_pool2d(pixels, 2).repeat_interleave(2, -1).repeat_interleave(2, -2)
    assert torch.allclose(decoded, blocks, atol=2e-3)


def test_after_the_demo_training_the_lora_applies_the_edit(demo_family, assets, tmp_path, monkeypatch):
    """The demo config's training (its steps and LR) on the demo's edit pairs, then the sample stage:
    the base reproduces the control (the demo model is set to), and the LoRA's outputs are much
    closer to the targets than the base's, closer than the unedited control: it applied the edit.
    Sample reads each control image once (the grid and the edit errors share them)."""
    from collections import Counter

    from stages.core import image_io

    name, model, data = demo_family
    cfg = make_cfg(name, assets, data, tmp_path, model=str(model))  # the demo's config and model
    for stage in (encode_captions, cache_latents, train):
        stage.run(cfg)
    export_lora.run(cfg)
    cfg = dataclasses.replace(cfg, sample=SampleConfig(seeds=[0], steps=8))
    reads, load_image = Counter(), image_io.load_image
    monkeypatch.setattr(image_io, "load_image", lambda path, *a, **k: reads.update([str(path)]) or load_image(path, *a, **k))
    manifest = sample.run(cfg)
    controls = [str(p) for _, row in sample.edit_rows(cfg) for p in row]
    assert controls and {p: reads[p] for p in controls} == {p: 1 for p in controls}
    errors, final = manifest["edit_error"], manifest["columns"][-1]
    assert set(errors) == {"base", final, edit_error.CONTROL}
    assert abs(errors["base"] - errors[edit_error.CONTROL]) < 0.01 * errors[edit_error.CONTROL], errors
    assert errors[final] < 0.7 * errors[edit_error.CONTROL], errors
    assert manifest["edit_closer_percent"] == edit_error.closer_percent(errors, final) > 30
    done = [e for e in map(json.loads, (cfg.run_dir / "events.jsonl").read_text().splitlines())
            if e["event"] == "done" and e["stage"] == "sample"]
    rendered = [c for c in manifest["columns"] if c != "control"]  # the control column is the input, not rendered
    assert manifest["columns"][0] == "control" and done[-1]["images"] == len(sample.edit_rows(cfg)) * len(cfg.sample.seeds) * len(rendered)
