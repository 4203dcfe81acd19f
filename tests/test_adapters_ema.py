"""EMA of the adapter weights, adapter types and per-module rank/alpha (issue 20), on tiny models.

EMA: the saved EMA is the running average the formula gives (checked against the saved weights of
consecutive steps), a resumed run with EMA on ends bit-identical to an uninterrupted one (weights
and EMA), `export-lora --ema` exports the EMA and refuses a run that has none. Invalid settings
are ConfigErrors before any model loads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import demo_config_path, once

EMA = {"train.ema_decay": 0.9}


def new_run(built, name: str, **overrides):
    """A run beside `built` with copies of its caches (same config), so training starts at once."""
    from stages.core.config import load_config

    cfg = load_config(demo_config_path(built.family), {
        "model": built.model, "data.path": built.data.path, "artifacts": built.artifacts, "device": built.device,
        "run": f"{built.family}-{name}", "train.steps": 3, "train.batch_size": 2, "train.checkpoint_every": 1,
        "train.keep_checkpoints": 0, **overrides})
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    for cache in ("captions.zarr", "latents.zarr"):
        shutil.copytree(built.run_dir / cache, cfg.run_dir / cache)
    return cfg


def weights(folder: Path, name: str = "adapter_model.safetensors") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / name))


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@once
def test_ema_average_resume_and_export(built_run):
    from stages import export_lora, train
    from stages.core.artifacts import ArtifactError

    cfg = new_run(built_run, "ema", **EMA)
    train.run(cfg)
    lora = cfg.run_dir / "lora"
    w = {s: weights(lora / f"checkpoint-{s}") for s in (1, 2, 3)}
    e = {s: weights(lora / f"checkpoint-{s}", "ema_model.safetensors") for s in (1, 2, 3)}
    assert same(e[3], weights(lora / "final", "ema_model.safetensors"))
    d = cfg.train.ema_decay
    for s in (2, 3):  # ema_s = d * ema_(s-1) + (1 - d) * w_s
        for k in w[s]:
            torch.testing.assert_close(e[s][k], d * e[s - 1][k] + (1 - d) * w[s][k], rtol=0, atol=1e-7)
    for k in (k for k in w[1] if "lora_B" in k):  # B starts at zero, so ema_1 = (1 - d) * w_1
        torch.testing.assert_close(e[1][k], (1 - d) * w[1][k], rtol=0, atol=1e-8)
        assert not torch.equal(e[3][k], w[3][k])

    # resume from checkpoint-1: the same weights and EMA as the uninterrupted run
    resumed = new_run(built_run, "ema-resumed", **EMA)
    shutil.copytree(lora / "checkpoint-1", resumed.run_dir / "lora" / "checkpoint-1")
    train.run(resumed, resume=True)
    for name in ("adapter_model.safetensors", "ema_model.safetensors"):
        assert same(weights(resumed.run_dir / "lora" / "final", name), weights(lora / "final", name)), name

    # export --ema: the EMA under diffusers' keys; the plain export stays the weights
    plain = export_lora.run(cfg)
    exported = weights(cfg.run_dir / "export", "pytorch_lora_weights.safetensors")
    assert not plain.get("ema") and _values(exported) == _values(w[3])
    cfg.export.ema = True
    assert export_lora.run(cfg)["ema"] is True  # another fingerprint: rewritten, not "up to date"
    assert _values(weights(cfg.run_dir / "export", "pytorch_lora_weights.safetensors")) == _values(e[3])

    no_ema = new_run(built_run, "no-ema", **{"train.steps": 1})
    train.run(no_ema)
    no_ema.export.ema = True
    with pytest.raises(ArtifactError, match="holds no EMA of the adapter .*train.ema_decay"):
        export_lora.run(no_ema)


def _values(state: dict[str, torch.Tensor]) -> list[tuple]:
    """The tensors of a state dict, key names aside (diffusers' file renames peft's keys)."""
    return sorted((tuple(t.shape), t.double().sum().item(), t.double().abs().sum().item()) for t in state.values())


@pytest.mark.parametrize("overrides, message", [
    ({"train.ema_decay": 1.0}, r"'train.ema_decay' = 1.0 must be in \[0, 1\)"),
    ({"train.ema_device": "cuda", "train.ema_decay": 0.9, "device": "cpu"}, "'train.ema_device' = 'cuda' but 'device' = 'cpu'"),
    ({"train.ema_device": "cpu"}, r"'train.ema_device' = 'cpu' but 'train.ema_decay' = 0"),
])
def test_invalid_settings_are_config_errors(overrides, message):
    from stages.core.config import load_config
    from stages.core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(demo_config_path("flux"), overrides)
