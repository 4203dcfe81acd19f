"""End to end as a user runs it: `pipeline.py run` (each stage a child process), then again.

Also the stage-isolation check: each child records the model classes it constructed
(LORAPIPE_TRACE_MODELS), and no stage may build another stage's models.

The child-process run is the same wiring for every family, so it runs on ONE_FAMILY; every family's
stage isolation and `status` (all up to date after a run; one changed key makes exactly its stages
stale) are checked on conftest's in-process `built_run`, whose stages record the model classes
they construct (conftest.BUILT_MODELS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BUILT_MODELS, FAMILIES, ONE_FAMILY, ROOT, demo_config_path, tiny_model


def _registry_classes() -> tuple[set[str], set[str]]:
    """(denoiser classes, VAE classes) of every registered family."""
    from stages.families import get_family

    families = [get_family(f) for f in FAMILIES]
    return {f.denoiser_class for f in families}, {f.vae_class for f in families}


def _pipeline(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "pipeline.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def _assert_stages_build_only_their_models(family: str, built: dict[str, set[str]]) -> None:
    from stages.families import get_family

    fam = get_family(family)
    denoisers, vaes = _registry_classes()
    assert set(fam.text_component_classes) <= built["encode-captions"]
    assert not built["encode-captions"] & (denoisers | vaes), built["encode-captions"]
    assert built["cache-latents"] & vaes and not built["cache-latents"] & denoisers
    assert not built["cache-latents"] & set(fam.text_component_classes)
    assert fam.denoiser_class in built["train"]
    assert not built["train"] & (vaes | set(fam.text_component_classes)), built["train"]
    assert built["export-lora"] == set(), "export must not load any model"


def _assert_status(status: str, changed: str) -> None:
    """`status` right after a run, and with train.learning_rate changed."""
    assert status.count("up to date") == 4, status
    lines = {line.split()[0]: line for line in changed.splitlines() if line.strip()}
    assert "up to date" in lines["encode-captions"] and "up to date" in lines["cache-latents"]
    assert "stale" in lines["train"] and "learning_rate" in lines["train"], changed


@pytest.mark.slow
@pytest.mark.parametrize("family", [ONE_FAMILY])
def test_run_end_to_end_then_skip(family, assets, demo_data, tmp_path):
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {**os.environ, "LORAPIPE_TRACE_MODELS": str(trace), "HF_HUB_OFFLINE": "1"}
    args = ["--config", str(demo_config_path(family)), "--model", str(tiny_model(assets, FAMILIES[family])),
            "--set", f"data.path={demo_data}", "--set", f"artifacts={tmp_path / 'artifacts'}",
            "--set", "train.steps=6", "--set", "device=cpu"]
    first = _pipeline("run", *args, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = next(p for p in (tmp_path / "artifacts").iterdir() if not p.name.startswith("."))  # not .index
    for path in ("captions.zarr/manifest.json", "latents.zarr/manifest.json", "lora/final/manifest.json",
                 "lora/final/adapter_model.safetensors", "export/pytorch_lora_weights.safetensors",
                 "export/manifest.json", "events.jsonl"):
        assert (run_dir / path).is_file(), path

    built = {stage: set(json.loads((trace / f"{stage}.json").read_text()))
             for stage in ("encode-captions", "cache-latents", "train", "export-lora")}
    _assert_stages_build_only_their_models(family, built)

    second = _pipeline("run", *args, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    for stage in ("encode-captions", "cache-latents", "train", "export-lora"):
        assert f"{stage}: up to date, skipped" in second.stdout, second.stdout
    status = _pipeline("status", *args, env=env)
    # one changed setting makes exactly the stages that read it stale
    changed = _pipeline("status", *args, "--set", "train.learning_rate=0.01", env=env)
    _assert_status(status.stdout, changed.stdout)


def test_each_family_stage_builds_only_its_models_and_status_after_a_run(built_run):
    """Every family, in-process: the classes each stage of built_run constructed, and `status` on a
    freshly loaded config (the fingerprints are stable: all up to date; train.learning_rate
    changes train alone)."""
    from click.testing import CliRunner

    from pipeline import cli

    cfg = built_run
    _assert_stages_build_only_their_models(cfg.family, BUILT_MODELS[cfg.family])
    args = ["status", "--config", str(demo_config_path(cfg.family)), "--model", cfg.model,
            "--set", f"data.path={cfg.data.path}", "--set", f"artifacts={cfg.artifacts}",
            "--set", f"device={cfg.device}", "--set", f"train.steps={cfg.train.steps}",
            *(["--set", f"train.expert={cfg.train.expert}"] if cfg.train.expert else [])]
    status = CliRunner().invoke(cli, args)
    changed = CliRunner().invoke(cli, [*args, "--set", "train.learning_rate=0.01"])
    assert status.exit_code == 0 and changed.exit_code == 0, status.output + changed.output
    _assert_status(status.output, changed.output)


def test_the_demo_builds_its_assets_where_its_configs_read_them(tmp_path, monkeypatch):
    """`lorapipe demo` from any folder: the model and data it builds are the paths each demo config names
    (relative to the config's folder), not folders under the working directory."""
    from stages.core.config import load_config
    from stages.demo import ASSETS, demo_config

    monkeypatch.chdir(tmp_path)
    for family in FAMILIES:
        cfg = load_config(demo_config(family))
        assert Path(cfg.model).resolve().parent == ASSETS.resolve(), (family, cfg.model)
        assert all(Path(d.path).resolve().parent == ASSETS.resolve() for d in cfg.dataset_configs()), family
