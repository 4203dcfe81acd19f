"""Crash safety: SIGKILL each stage at several points, rerun, compare with an
uninterrupted run: the same item ids, the same array bytes, the same adapter.

The stages run as the user runs them (`python pipeline.py <stage>`, child processes) and kill
themselves at a chosen point (LORAPIPE_KILL_AFTER, stages/core/faults.py): between rows, inside a
row write (arrays on disk, `written` flag not yet), after a training step, inside a checkpoint save.
The uninterrupted reference is conftest's `built_run` (same config, built in-process).
Also: a second process on a running stage refuses with a clear message.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, demo_config_path
from stages.core.caches import lora_dir

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("built_run", ["flux"], indirect=True)]
TRAIN = {"train.steps": 8, "runtime.checkpoint_every": 2}  # built_run trains 8 steps; checkpoints change no math


def crash_cfg(built, name: str):
    from stages.core.config import load_config

    run_dir = Path(built.artifacts) / name
    shutil.rmtree(run_dir, ignore_errors=True)
    return load_config(demo_config_path(built.family), {
        "model": built.model, "data.path": built.data.path, "artifacts": built.artifacts, "device": "cpu",
        "run": name, **TRAIN})


def pipeline(cfg, stage: str, *extra: str, kill: str = "") -> subprocess.CompletedProcess:
    """`python pipeline.py <stage>` for this config; `kill` is a LORAPIPE_KILL_AFTER spec."""
    from stages.core.faults import ENV

    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update({"HF_HUB_OFFLINE": "1", "LORAPIPE_PLAIN": "1", **({ENV: kill} if kill else {})})
    sets = {"data.path": cfg.data.path, "artifacts": cfg.artifacts, "device": "cpu", **TRAIN}
    args = [sys.executable, str(ROOT / "pipeline.py"), stage, "--config", str(demo_config_path(cfg.family)),
            "--run", cfg.run, "--model", cfg.model, *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    return subprocess.run([*args, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def killed(result: subprocess.CompletedProcess) -> bool:
    return result.returncode == -signal.SIGKILL


def finished(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout + result.stderr


def rows_by_id(store, ids_to_rows: dict[str, int]) -> dict[str, dict[str, bytes]]:
    """{item id: {field: raw bytes}}: what a store holds for each id, wherever its row is."""
    return {i: {f: store.read(f, r).tobytes() for f in store.fields} for i, r in ids_to_rows.items()}


def caption_rows(cfg) -> dict:
    from stages.encode_captions import load_captions

    store, manifest = load_captions(cfg)
    return rows_by_id(store, manifest["rows"])


def latent_rows(cfg) -> dict:
    from stages.cache_latents import load_latents

    stores, manifest = load_latents(cfg)
    out = {}
    for image_id, loc in manifest["index"].items():
        out.update(rows_by_id(stores[loc["bucket"]], {image_id: loc["row"]}))
    return out


def manifest_of(path: Path) -> dict | None:
    from stages.core.artifacts import read_manifest

    return read_manifest(path)


def leftovers(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.name.endswith(".partial") or p.name.startswith(".")
            and (".tmp" in p.name or ".trash." in p.name or ".old." in p.name)]


def test_kill_encode_captions(built_run):
    from stages import encode_captions

    cfg = crash_cfg(built_run, "crash-captions")
    out = cfg.run_dir / "captions.zarr"
    assert killed(pipeline(cfg, "encode-captions", kill="encode-captions:2"))  # 2 rows on disk, then killed
    assert (out / "zarr.json").exists() and manifest_of(out) is None
    assert killed(pipeline(cfg, "encode-captions", kill="mid-row:2"))  # 1 more row, then inside the next
    manifest = encode_captions.run(cfg)  # the rerun (in-process: no second import of torch)
    assert manifest["encoded_this_run"] == len(manifest["rows"]) - 3  # continued; the half row redone
    assert caption_rows(cfg) == caption_rows(built_run)
    assert not leftovers(out)


def test_kill_cache_latents(built_run):
    from stages import cache_latents

    cfg = crash_cfg(built_run, "crash-latents")
    out = cfg.run_dir / "latents.zarr"
    # 2 rows on disk; the 3rd image, encoded while the 2nd row was written (encode_units' one-deep pipeline),
    # is lost with the process and encoded again
    assert killed(pipeline(cfg, "cache-latents", kill="cache-latents:2"))
    assert manifest_of(out) is None
    assert killed(pipeline(cfg, "cache-latents", kill="mid-row:2"))  # 1 more row, the next half written
    manifest = cache_latents.run(cfg)
    assert manifest["encoded_this_run"] == len(manifest["index"]) - 3
    assert latent_rows(cfg) == latent_rows(built_run)
    assert not leftovers(out)


def test_kill_train(built_run):
    from safetensors.torch import load_file

    from stages import train

    cfg = crash_cfg(built_run, "crash-train")
    for cache in ("captions.zarr", "latents.zarr"):
        shutil.copytree(built_run.run_dir / cache, cfg.run_dir / cache)
    lora = lora_dir(cfg)
    # checkpoint-2 is saved; steps 3-4 run; the kill lands inside checkpoint-4's save (adapter
    # and training state written, manifest not, folder not renamed)
    assert killed(pipeline(cfg, "train", kill="mid-save:2"))
    assert sorted(p.name for p in lora.iterdir()) == [".checkpoint-4.tmp", "checkpoint-2"]
    final = train.run(cfg, resume=True)  # continues from checkpoint-2, the newest complete one
    assert final["complete"] and final["step"] == 8
    got = load_file(str(lora / "final" / "adapter_model.safetensors"))
    want = load_file(str(lora_dir(built_run) / "final" / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
    assert not leftovers(lora)


def test_second_process_on_a_stage_refuses(built_run, tmp_path):
    """A second process on the same stage and run refuses at once, naming the first one's pid,
    and writes nothing; another stage of the same run is not blocked."""
    from click.testing import CliRunner

    from pipeline import cli
    from stages.core.artifacts import lock_holder_pid, stage_lock

    cfg = crash_cfg(built_run, "locked")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from stages.core.artifacts import "
         "stage_lock\nwith stage_lock(Path(sys.argv[1]), 'cache-latents'):\n print('locked', flush=True); "
         "time.sleep(120)", str(cfg.run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        args = ["cache-latents", "--config", str(demo_config_path("flux")), "--run", cfg.run, "--model", cfg.model,
                "--set", f"data.path={cfg.data.path}", "--set", f"artifacts={cfg.artifacts}"]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2
        assert f"stage 'cache-latents' of run 'locked' is already running (pid {holder.pid})" in result.output
        assert not (cfg.run_dir / "latents.zarr").exists()
        assert lock_holder_pid(cfg.run_dir, "cache-latents") == holder.pid
        with stage_lock(cfg.run_dir, "encode-captions"):  # other stages of the run are free
            pass
    finally:
        holder.kill()
        holder.wait()
    assert lock_holder_pid(cfg.run_dir, "cache-latents") is None  # the kernel drops a dead holder's lock
