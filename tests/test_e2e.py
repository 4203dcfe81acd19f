"""End to end as a user runs it: `pipeline.py run` (each stage a child process), then again.

Also the stage-isolation check: each child records the model classes it constructed
(LORAPIPE_TRACE_MODELS), and no stage may build another stage's models.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAMILIES, ROOT, demo_config_path, tiny_model


def _registry_classes() -> tuple[set[str], set[str]]:
    """(denoiser classes, VAE classes) of every registered family."""
    from stages.families import get_family

    families = [get_family(f) for f in FAMILIES]
    return {f.denoiser_class for f in families}, {f.vae_class for f in families}


def _pipeline(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "pipeline.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_run_end_to_end_then_skip(family, assets, demo_data, tmp_path):
    from stages.families import get_family

    fam = get_family(family)
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {**os.environ, "LORAPIPE_TRACE_MODELS": str(trace), "HF_HUB_OFFLINE": "1"}
    args = ["--config", str(demo_config_path(family)), "--model", str(tiny_model(assets, FAMILIES[family])),
            "--set", f"data.path={demo_data}", "--set", f"artifacts={tmp_path / 'artifacts'}",
            "--set", "train.steps=6", "--set", "device=cpu"]
    denoisers, vaes = _registry_classes()
    first = _pipeline("run", *args, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = next((tmp_path / "artifacts").iterdir())
    for path in ("captions.zarr/manifest.json", "latents.zarr/manifest.json", "lora/final/manifest.json",
                 "lora/final/adapter_model.safetensors", "export/pytorch_lora_weights.safetensors",
                 "export/manifest.json", "events.jsonl"):
        assert (run_dir / path).is_file(), path

    built = {stage: set(json.loads((trace / f"{stage}.json").read_text()))
             for stage in ("encode-captions", "cache-latents", "train", "export-lora")}
    assert set(fam.text_component_classes) <= built["encode-captions"]
    assert not built["encode-captions"] & (denoisers | vaes), built["encode-captions"]
    assert built["cache-latents"] & vaes and not built["cache-latents"] & denoisers
    assert not built["cache-latents"] & set(fam.text_component_classes)
    assert fam.denoiser_class in built["train"]
    assert not built["train"] & (vaes | set(fam.text_component_classes)), built["train"]
    assert built["export-lora"] == set(), "export must not load any model"

    second = _pipeline("run", *args, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    for stage in ("encode-captions", "cache-latents", "train", "export-lora"):
        assert f"{stage}: up to date, skipped" in second.stdout, second.stdout
    status = _pipeline("status", *args, env=env)
    assert status.stdout.count("up to date") == 4, status.stdout

    # one changed setting makes exactly the stages that read it stale
    changed = _pipeline("status", *args, "--set", "train.learning_rate=0.01", env=env)
    lines = {line.split()[0]: line for line in changed.stdout.splitlines() if line.strip()}
    assert "up to date" in lines["encode-captions"] and "up to date" in lines["cache-latents"]
    assert "stale" in lines["train"] and "learning_rate" in lines["train"], changed.stdout
