"""Training controls: timestep range and stratified timesteps, loss weighting, pseudo-Huber loss, the
optimizers' config checks and LoRA+ groups. The math against diffusers or the direct formulas; the
wiring on the tiny FLUX run (bit-exact resume of every optimizer: tests/stages/test_resume.py).

    .venv/bin/python -m pytest -q tests/stages/test_training_controls.py
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from conftest import ROOT, run_beside
from stages.core import flow
from stages.core.config import TrainConfig, load_config
from stages.core.errors import ConfigError
from stages.families import get_family


flux_run = pytest.mark.parametrize("built_run", ["flux"], indirect=True)


def _demo(overrides: dict):
    return load_config(ROOT / "configs" / "demo.toml", overrides)


# ---- timesteps ----------------------------------------------------------------------------------------


def test_defaults_draw_exactly_what_the_density_draws():
    """New keys at their defaults change no draw: a run made before them trains the same."""
    for density in ("logit_normal", "mode", "uniform"):
        tcfg = TrainConfig(timestep_density=density)
        plain = flow.sample_density(64, torch.Generator().manual_seed(3), density)
        assert torch.equal(flow.draw_u(64, torch.Generator().manual_seed(3), tcfg, first=5), plain)
        bucketed = dataclasses.replace(tcfg, timestep_buckets=4)  # validation (first None): unstratified
        assert torch.equal(flow.draw_u(64, torch.Generator().manual_seed(3), bucketed), plain)


def test_timestep_range_squeezes_the_density_before_the_shift():
    """timestep_min/max: u' = (1 - max) + (max - min) * u, then the family's shift and sigma table; with
    shift 1 every sigma lies in (min, max]."""
    family = get_family("flux")
    tcfg = TrainConfig(timestep_min=0.2, timestep_max=0.6, shift=3.0)
    ours = family.sample_timesteps(512, (32, 32), torch.Generator().manual_seed(1), tcfg)
    u = flow.sample_density(512, torch.Generator().manual_seed(1), "logit_normal")
    table = flow.sigma_table(3.0)
    idx = (((1 - 0.6) + (0.6 - 0.2) * u) * flow.NUM_TRAIN_TIMESTEPS).long()
    assert torch.equal(ours, table[idx])
    unshifted = family.sample_timesteps(512, (32, 32), torch.Generator().manual_seed(1), dataclasses.replace(tcfg, shift=1.0))
    assert unshifted.min() > 0.2 and unshifted.max() <= 0.6 + 1e-6
    assert ours.min() >= flow.shift_sigmas(torch.tensor(0.2), 3.0) - 1e-6  # shifted after the squeeze


@pytest.mark.parametrize("density", ["logit_normal", "uniform", "mode"])
def test_stratified_draws_fill_each_equal_probability_stratum_in_turn(density):
    """Draw j of the run lands in stratum j mod B of the density (its CDF of u in [k/B, (k+1)/B)), so
    any B consecutive draws, within a batch or across steps, cover every stratum once."""
    B = 5
    u = flow.stratified_density(23, torch.Generator().manual_seed(0), density, first=7, buckets=B)
    if density == "logit_normal":
        cdf = torch.special.ndtr(torch.logit(u.double()))
    elif density == "uniform":
        cdf = u.double()
    else:  # mode maps the uniform variate v to u decreasingly: the CDF of u is 1 - v
        v = torch.linspace(0, 1, 200001, dtype=torch.float64)
        mapped = 1 - v - 1.29 * (torch.cos(math.pi * v / 2) ** 2 - 1 + v)
        cdf = 1 - torch.from_numpy(np.interp(u.double().numpy(), mapped.flip(0).numpy(), v.flip(0).numpy()))
    strata = (cdf * B).floor().long()
    if density == "mode":
        strata = B - 1 - strata
    assert strata.tolist() == [(7 + j) % B for j in range(23)]
    again = flow.stratified_density(23, torch.Generator().manual_seed(0), density, first=7, buckets=B)
    assert torch.equal(u, again)  # from the seeded generator alone


def test_stratified_draws_keep_the_density():
    """Stratifying changes which draws come when, not the distribution: the logit-normal median and
    spread stay (a run of 4000 draws in 8 strata puts exactly 500 in each eighth of the CDF)."""
    tcfg = TrainConfig(timestep_buckets=8)
    u = torch.cat([flow.draw_u(4, torch.Generator().manual_seed(s), tcfg, first=4 * s) for s in range(1000)])
    counts = torch.bincount((torch.special.ndtr(torch.logit(u.double())) * 8).long(), minlength=8)
    assert counts.tolist() == [500] * 8
    assert abs(u.median().item() - 0.5) < 0.01


@flux_run
def test_trainer_stratifies_by_step(built_run):
    """The train loop passes each batch's position (step x global batch): with batch 4 and 4 buckets
    every batch holds one timestep from each quarter of the density, also the second batch."""
    from stages.core.events import EventLog
    from stages.train.trainer import Trainer

    cfg = run_beside(built_run, "stratified", **{"train.timestep_buckets": 4, "train.batch_size": 4})
    trainer = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
    full = 0
    for _ in range(3):
        indices, (_, _, _, sigmas) = trainer.draw_next()
        u = 1 - sigmas.double()  # shift 1: the table's sigma is 1 - floor(u * 1000) / 1000
        quarters = (torch.special.ndtr(torch.logit(u)) * 4).floor().long()
        if len(indices) == 4:  # a bucket's short last batch holds fewer
            assert sorted(quarters.tolist()) == [0, 1, 2, 3]
            full += 1
    assert full >= 2


# ---- loss ---------------------------------------------------------------------------------------------


def test_weighting_matches_diffusers():
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    sigmas = torch.tensor([0.001, 0.1, 0.5, 0.77, 1.0])
    for scheme in ("none", "sigma_sqrt", "cosmap"):
        torch.testing.assert_close(flow.loss_weights(scheme, sigmas),
                                   compute_loss_weighting_for_sd3(scheme, sigmas).float(), rtol=0, atol=0)


def test_huber_and_smooth_l1_are_the_pseudo_huber_formulas():
    """sd-scripts' conditional_loss: huber 2c(sqrt(d^2 + c^2) - c), smooth_l1 2(sqrt(d^2 + c^2) - c),
    averaged per sample; ~d^2 for |d| << c, linear beyond; mse unchanged."""
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 4, 6, 8, generator=g), torch.randn(3, 4, 6, 8, generator=g)
    d2, c = (pred - target) ** 2, 0.3
    for kind, want in (("huber", 2 * c * (torch.sqrt(d2 + c * c) - c)), ("smooth_l1", 2 * (torch.sqrt(d2 + c * c) - c)),
                       ("mse", d2)):
        tcfg = TrainConfig(loss=kind, huber_c=c)
        got = flow.per_sample_loss(pred, target, None, tcfg)
        torch.testing.assert_close(got, want.flatten(1).mean(1))
        ones = flow.per_sample_loss(pred, target, torch.ones(3, 1, 6, 8), tcfg)
        assert torch.equal(ones, got)  # an all-ones mask is bit-identical to none
    assert torch.equal(flow.per_sample_loss(pred, target, None, TrainConfig()), flow.per_sample_mse(pred, target))
    small, large = torch.full((1, 4), 1e-3), torch.full((1, 4), 10.0)
    huber = TrainConfig(loss="huber", huber_c=0.1)
    torch.testing.assert_close(flow.per_sample_loss(small, 0 * small, None, huber), torch.tensor([1e-6]), rtol=1e-3, atol=0)
    torch.testing.assert_close(flow.per_sample_loss(large, 0 * large, None, huber), torch.tensor([2 * 0.1 * 10.0]), rtol=0.02, atol=0)


@flux_run
def test_family_loss_applies_weighting_by_its_sigmas_and_lora_plus_groups(built_run):
    """In the train loop (FLUX's loss): cosmap weighs each sample's loss by its own sigma; LoRA+ puts
    exactly the lora_B matrices in a second group at learning_rate x ratio."""
    from stages.core.events import EventLog
    from stages.train.trainer import Trainer

    cfg = run_beside(built_run, "loraplus", **{"train.loraplus_ratio": 4.0})
    trainer = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
    torch.manual_seed(0)
    trainer.setup_model()
    slow, fast = trainer.optimizer.param_groups
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert fast["initial_lr"] == 4.0 * slow["initial_lr"] == 4.0 * cfg.train.learning_rate  # before the warmup
    assert fast["params"] and all(".lora_B." in names[id(p)] for p in fast["params"])
    assert slow["params"] and not any(".lora_B." in names[id(p)] for p in slow["params"])

    trainer.model.eval()  # no dropout: the same forward twice
    _, (batch, eps, noise, t) = trainer.draw_next()
    with torch.no_grad():
        plain = trainer._per_sample_loss(trainer.model, batch, eps, noise, t)
        trainer.tcfg = dataclasses.replace(trainer.tcfg, weighting_scheme="cosmap")
        weighted = trainer._per_sample_loss(trainer.model, batch, eps, noise, t)
    torch.testing.assert_close(weighted, plain * flow.loss_weights("cosmap", t))


# ---- config -------------------------------------------------------------------------------------------


REFUSED = [
    ({"train.optimizer": "adamw_schedulefree"},  # the demo's lr_scheduler is cosine
     "'train.lr_scheduler' = 'cosine' with 'train.optimizer' = 'adamw_schedulefree': a schedule-free optimizer "
     "replaces the LR schedule; set train.lr_scheduler = 'constant'"),
    ({"train.optimizer": "prodigy_schedulefree", "train.lr_scheduler": "constant"},
     "'train.max_grad_norm' = 1.0 with 'train.optimizer' = 'prodigy_schedulefree': clipping upsets its step-size "
     "estimate"),
    ({"train.optimizer": "adamw_schedulefree", "train.lr_scheduler": "constant", "train.ema_decay": 0.99},
     "'train.ema_decay' = 0.99 with 'train.optimizer' = 'adamw_schedulefree'"),
    ({"train.loraplus_ratio": 8.0, "train.adapter": "lokr"},
     "'train.loraplus_ratio' = 8.0 with 'train.adapter' = 'lokr': LoRA+ scales the lora_B matrices"),
    ({"train.timestep_min": 0.7, "train.timestep_max": 0.3},
     "'train.timestep_min' = 0.7 is not below 'train.timestep_max' = 0.3"),
    ({"train.timestep_max": 1.5}, "'train.timestep_max' = 1.5 must be in [0, 1]"),
    ({"train.huber_c": 0.0}, "'train.huber_c' = 0.0 must be > 0"),
    ({"train.weighting_scheme": "mode"}, "'train.weighting_scheme' = 'mode' is not one of 'none', 'sigma_sqrt', 'cosmap'"),
]


@pytest.mark.parametrize("overrides,message", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_combinations_that_make_no_sense_are_refused_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError) as e:
        _demo(overrides)
    assert message in str(e.value)


def test_ddpm_family_refuses_flow_only_keys_and_takes_the_loss():
    """SDXL trains DDPM timesteps: the flow-only keys away from their defaults are errors, train.loss works."""
    base = {"family": "sdxl", "model": "stabilityai/stable-diffusion-xl-base-1.0", "captions.max_sequence_length": 77}
    with pytest.raises(ConfigError) as e:
        _demo({**base, "train.weighting_scheme": "cosmap", "train.timestep_buckets": 4})
    for key in ("weighting_scheme", "timestep_buckets"):
        assert f"'train.{key}'" in str(e.value) and "applies to flow-matching families only, and sdxl" in str(e.value)
    assert _demo({**base, "train.loss": "huber"}).train.loss == "huber"


def test_prodigy_with_an_adamw_learning_rate_gets_an_info_line():
    from stages.train import optimizers

    note = optimizers.notes(TrainConfig(optimizer="prodigy", learning_rate=1e-4))
    assert len(note) == 1 and "train.learning_rate = 0.0001 with train.optimizer = 'prodigy'" in note[0]
    assert "10,000x smaller" in note[0] and "set train.learning_rate = 1.0" in note[0]
    assert optimizers.notes(TrainConfig(optimizer="prodigy", learning_rate=1.0)) == []
    assert optimizers.notes(TrainConfig(learning_rate=1e-4)) == []


@flux_run
def test_every_new_key_is_fingerprinted(built_run):
    """They change what is learned: a changed value makes train stale and a checkpoint of other values unresumable."""
    from stages.core.artifacts import fingerprint
    from stages.train.stage import fingerprint_parts

    base = fingerprint(fingerprint_parts(built_run))
    for key, value in (("loraplus_ratio", 4.0), ("timestep_min", 0.1), ("timestep_max", 0.9), ("timestep_buckets", 4),
                       ("weighting_scheme", "cosmap"), ("loss", "huber"), ("huber_c", 0.2), ("optimizer", "adafactor")):
        changed = run_beside(built_run, f"fp-{key}", **{f"train.{key}": value})
        assert fingerprint(fingerprint_parts(changed)) != base, key
