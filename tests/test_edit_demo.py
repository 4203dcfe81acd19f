"""The edit demo learns the edit: the sample stage's `edit_error` (stages/edit_error.py) measures each
column's latent distance to the targets, and after the demo's training the LoRA's outputs are closer
to them than the base's. On flux-kontext's built run (conftest.built_run), in-process."""

from __future__ import annotations

import dataclasses

import diffusers
import pytest
import torch

from conftest import run_beside
from stages import edit_error, export_lora, sample, train
from stages.core import dataset
from stages.core.config import SampleConfig
from stages.families import get_family

FAMILY = "flux-kontext"
on_kontext = pytest.mark.parametrize("built_run", [FAMILY], indirect=True)


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


@on_kontext
def test_after_the_demo_training_the_lora_output_is_closer_to_the_targets(built_run):
    """The demo config's training (its steps and LR) on the edit pairs, then the sample stage: the
    LoRA column's outputs are measurably closer to the targets than the base column's."""
    cfg = run_beside(built_run, "learns-edit")
    train.run(cfg)
    export_lora.run(cfg)
    cfg = dataclasses.replace(cfg, sample=SampleConfig(seeds=[0], steps=8))
    manifest = sample.run(cfg)
    errors, final = manifest["edit_error"], manifest["columns"][-1]
    assert set(errors) == {"base", final, edit_error.CONTROL}
    assert errors[final] < 0.95 * errors["base"], errors
    assert manifest["edit_closer_percent"] == edit_error.closer_percent(errors, final) > 5
