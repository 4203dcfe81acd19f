"""Stop, cancel, resume and restart of `train`, in-process on the tiny models.

A run stopped at step k (a real SIGTERM the process sends itself, see stages/core/faults.py) and
resumed with `--resume` must end with an adapter bit-identical to an uninterrupted run, with the
same losses and learning rates for the steps after k. `stop --no-save` writes nothing new; a second
signal during the save corrupts nothing; the CLI exits 0 with a `stopped` event. A plain `train`
over an unfinished run refuses; `--restart` sets the old checkpoints aside, and retention never
prunes the checkpoint a stop just wrote.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, demo_config_path, once, run_beside
from stages.core.caches import export_dir, lora_dir

STEPS, STOP_AT = 6, 3
TRAIN = {"train.steps": STEPS, "runtime.checkpoint_every": 4, "runtime.log_every": 1}
_REFERENCE: dict[str, tuple] = {}


def new_run(built, name: str, **overrides):
    return run_beside(built, name, **{**TRAIN, **overrides})


def adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def run_events(cfg, event: str) -> list[dict]:
    """`event` lines of the last train start in this run's events.jsonl."""
    from stages.core.events import read_events

    lines = [e for e in read_events(cfg.run_dir) if e["stage"] == "train"]
    last_start = max(i for i, e in enumerate(lines) if e["event"] == "start")
    return [e for e in lines[last_start:] if e["event"] == event]


def reference(built) -> tuple[dict, dict[int, tuple[float, float]]]:
    """The uninterrupted run: its adapter and {step: (loss, lr)}."""
    from stages import train

    if built.family not in _REFERENCE:
        cfg = new_run(built, "uninterrupted")
        train.run(cfg)
        steps = {e["step"]: (e["loss"], e["lr"]) for e in run_events(cfg, "step")}
        _REFERENCE[built.family] = (adapter(lora_dir(cfg) / "final"), steps)
    return _REFERENCE[built.family]


def assert_same_adapter(got: dict, want: dict) -> None:
    import torch

    assert set(got) == set(want)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def test_stop_then_resume_is_bit_identical(built_run, monkeypatch):
    from stages import train
    from stages.core import faults
    from stages import registry
    from stages.core.stage import staleness

    want, want_steps = reference(built_run)
    cfg = new_run(built_run, "stopped")
    monkeypatch.setenv(faults.ENV, f"train:{STOP_AT}:TERM")  # as `kill -TERM <pid>` after step 3
    stopped = train.run(cfg)
    assert stopped["stopped"] and stopped["saved"] and stopped["step"] == STOP_AT
    assert [(e["step"], e["saved"]) for e in run_events(cfg, "stopped")] == [(STOP_AT, True)]
    final = lora_dir(cfg) / "final"
    assert (lora_dir(cfg) / f"checkpoint-{STOP_AT}" / "manifest.json").is_file()
    ok, reasons = staleness(registry.get("train"), cfg)
    assert not ok and "--resume" in reasons[0], reasons  # status tells how to finish

    monkeypatch.delenv(faults.ENV)
    done = train.run(cfg, resume=True)
    assert done["complete"] and done["step"] == STEPS
    assert any(e["message"].startswith(f"resumed from checkpoint-{STOP_AT}") for e in run_events(cfg, "info"))
    assert not any("resumed" in e["message"] for e in run_events(cfg, "warning"))  # asked for: not a warning
    assert_same_adapter(adapter(final), want)
    got_steps = {e["step"]: (e["loss"], e["lr"]) for e in run_events(cfg, "step")}
    assert got_steps == {s: v for s, v in want_steps.items() if s > STOP_AT}  # same data order, LR, noise


@once
def test_second_signal_during_save_corrupts_nothing(built_run, monkeypatch):
    """SIGTERM after step 2, then another SIGTERM in the middle of writing the checkpoint: the save
    completes, the CLI exits 0 and says so, and resuming still ends bit-identical."""
    from click.testing import CliRunner

    from pipeline import cli
    from stages import train
    from stages.core import faults

    want, _ = reference(built_run)
    cfg = new_run(built_run, "double-signal")
    monkeypatch.setenv(faults.ENV, "train:2:TERM,mid-save:1:TERM")
    args = ["train", "--config", str(demo_config_path("flux")), "--run", cfg.run, "--model", cfg.model,
            "--set", f"data.path={cfg.data.path}", "--set", f"artifacts={cfg.artifacts}", "--set", "device=cpu",
            *[a for k, v in TRAIN.items() for a in ("--set", f"{k}={v}")]]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "stopped at step 2" in result.output
    lora = lora_dir(cfg)
    assert sorted(p.name for p in lora.iterdir()) == ["checkpoint-2", "final"]  # no temp folder left
    assert adapter(lora / "checkpoint-2").keys() == want.keys()
    monkeypatch.delenv(faults.ENV)
    train.run(cfg, resume=True)
    assert_same_adapter(adapter(lora / "final"), want)


def _stop_when_training(cfg, save: bool, seen: list) -> None:
    """What `pipeline.py stop <run> [--no-save]` does, once the run has logged a step."""
    from stages.core.events import read_events
    from stages.train import request_stop

    deadline = time.time() + 120
    while time.time() < deadline:
        if any(e["event"] == "step" and e["step"] >= 2 for e in read_events(cfg.run_dir)):
            seen.append(sorted(p.name for p in (lora_dir(cfg)).glob("checkpoint-*")))
            seen.append(request_stop(cfg.run_dir, save=save))
            return
        time.sleep(0.05)


@once
def test_stop_no_save_writes_nothing_new(built_run):
    """`pipeline.py stop <run> --no-save` (its stop file, from another thread) cancels the run:
    a `stopped` event with saved=false, no lora/final, every checkpoint made before left as it was."""
    from stages import train
    from stages.core.artifacts import lock_holder_pid

    cfg = new_run(built_run, "cancelled", **{"train.steps": 400, "runtime.checkpoint_every": 1,
                                             "runtime.keep_checkpoints": 1000})
    seen: list = []
    watcher = threading.Thread(target=_stop_when_training, args=(cfg, False, seen))
    watcher.start()
    result = train.run(cfg)
    watcher.join()
    assert len(seen) == 2, "the run logged no step >= 2 within 120 s, so no stop was requested"
    before, pid = seen
    assert pid is not None and result["stopped"] and not result["saved"]
    assert [e["saved"] for e in run_events(cfg, "stopped")] == [False]
    lora = lora_dir(cfg)
    assert not (lora / "final").exists()
    after = sorted(p.name for p in lora.iterdir())
    assert set(before) <= set(after) and all(int(n.split("-")[1]) <= result["step"] for n in after)
    assert lock_holder_pid(cfg.run_dir, "train") is None and not (cfg.run_dir / "train.stop").exists()


def test_stop_command_without_a_running_train(tmp_path):
    from click.testing import CliRunner

    from pipeline import cli

    result = CliRunner().invoke(cli, ["stop", "nothing-here", "--artifacts", str(tmp_path)])
    assert result.exit_code == 1 and "no train stage is running for run 'nothing-here'" in result.output


@pytest.mark.slow
@once
def test_sigterm_to_pipeline_run_stops_train_cleanly(built_run):
    """`pipeline.py run` passes SIGTERM (or a terminal's Ctrl-C) on to its train child, which saves
    and exits 0; the parent then stops without exporting the unfinished adapter."""
    import os
    import signal
    import subprocess
    import sys

    from stages.core.events import read_events

    cfg = new_run(built_run, "run-sigterm", **{"train.steps": 400, "runtime.checkpoint_every": 0})
    sets = {"data.path": cfg.data.path, "artifacts": cfg.artifacts, "device": "cpu", "train.steps": 400,
            "runtime.checkpoint_every": 0}
    parent = subprocess.Popen(
        [sys.executable, str(ROOT / "pipeline.py"), "run", "--config", str(demo_config_path("flux")), "--run", cfg.run,
         "--model", cfg.model, *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]],
        cwd=ROOT, env={**os.environ, "LORAPIPE_PLAIN": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    deadline = time.time() + 300
    while not any(e["event"] == "step" for e in read_events(cfg.run_dir)) and time.time() < deadline:
        time.sleep(0.1)
    parent.send_signal(signal.SIGTERM)
    output, _ = parent.communicate(timeout=300)
    assert parent.returncode == 0, output
    assert "train was stopped before its last step; later stages not run" in output
    stopped = [e for e in read_events(cfg.run_dir) if e["event"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["saved"]
    assert (lora_dir(cfg) / f"checkpoint-{stopped[0]['step']}" / "manifest.json").is_file()
    assert not (export_dir(cfg)).exists()


@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
def test_plain_train_refuses_then_restart_keeps_new_lineage(built_run, monkeypatch):
    """Lost work: a run stopped at step 5, then a plain `train`, a `--restart` stopped at
    step 2, then `--resume`. The plain train refuses, naming both commands; the restart sets the
    old checkpoints aside (not deleted); its checkpoint-2 survives retention although the abandoned
    run reached step 5; the resume continues from it and ends bit-identical to an uninterrupted run,
    with the batch-size histogram of all 6 steps."""
    from collections import Counter

    from stages import train
    from stages.core import faults
    from stages.core.errors import ArtifactError
    from stages.core.events import read_events

    want, _ = reference(built_run)
    cfg = new_run(built_run, "restarted")
    lora = lora_dir(cfg)
    monkeypatch.setenv(faults.ENV, "train:5:TERM")
    assert train.run(cfg)["step"] == 5
    before = sorted(p.name for p in lora.iterdir())
    with pytest.raises(ArtifactError) as refused:
        train.run(cfg)
    message = str(refused.value)
    assert "checkpoint-5" in message and "step 5 of 6" in message
    for flag in ("--resume", "--restart"):
        assert f"`lorapipe train {cfg.run} --artifacts {cfg.run_dir.parent} {flag}`" in message
    assert sorted(p.name for p in lora.iterdir()) == before == ["checkpoint-4", "checkpoint-5", "final"]

    monkeypatch.setenv(faults.ENV, "train:2:TERM")
    assert train.run(cfg, restart=True)["step"] == 2
    aside = [p for p in lora.iterdir() if p.name.startswith(".restarted-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == before
    assert sorted(p.name for p in lora.iterdir() if p not in aside) == ["checkpoint-2", "final"]

    monkeypatch.delenv(faults.ENV)
    done = train.run(cfg, resume=True)
    assert any(e["message"].startswith("resumed from checkpoint-2") for e in run_events(cfg, "info"))
    assert_same_adapter(adapter(lora / "final"), want)
    assert sorted(p.name for p in lora.iterdir() if p not in aside) == ["checkpoint-4", "checkpoint-6", "final"]
    uninterrupted = read_events(cfg.run_dir.parent / f"{built_run.family}-uninterrupted")
    sizes = Counter(str(e["batch_size"]) for e in uninterrupted if e["event"] == "step")
    assert sum(sizes.values()) == STEPS and done["batch_sizes"] == dict(sizes)  # steps 1-2 came from checkpoint-2
    assert run_events(cfg, "done")[0]["batch_sizes"] == done["batch_sizes"]


@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
def test_old_pickle_training_state_is_never_loaded(built_run, monkeypatch, tmp_path):
    """A checkpoint from an older version holds training_state.pt, a pickle. Here it is a payload
    that would create a file when unpickled: resume must not run it, and must say what to do."""
    import pickle

    from stages import train
    from stages.train.checkpoints import STATE_JSON, STATE_TENSORS
    from stages.core import faults
    from stages.core.errors import ArtifactError

    cfg = new_run(built_run, "old-pickle")
    monkeypatch.setenv(faults.ENV, f"train:{STOP_AT}:TERM")
    train.run(cfg)
    monkeypatch.delenv(faults.ENV)
    checkpoint = lora_dir(cfg) / f"checkpoint-{STOP_AT}"
    for name in (STATE_JSON, STATE_TENSORS):
        (checkpoint / name).unlink()
    marker = tmp_path / "payload-ran"
    (checkpoint / "training_state.pt").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(ArtifactError) as refused:
        train.run(cfg, resume=True)
    assert not marker.exists()
    message = str(refused.value)
    assert f"checkpoint-{STOP_AT}' was written by an older lorapipe version" in message
    assert "never loaded" in message and "--restart" in message


class _Payload:
    """Unpickling this calls open(path, "w"): the file appears if anything unpickles it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


# Each optimizer (and LoRA+), as a user would set it, with a training control riding along, must resume
# bit for bit: its state goes through the same safetensors training state as AdamW's.
OPTIMIZER_RUNS = {
    "prodigy": {"train.optimizer": "prodigy", "train.learning_rate": 1.0, "train.loss": "huber"},
    "prodigy_schedulefree": {"train.optimizer": "prodigy_schedulefree", "train.learning_rate": 1.0,
                             "train.max_grad_norm": 0.0, "train.lr_scheduler": "constant_with_warmup"},
    "adamw_schedulefree": {"train.optimizer": "adamw_schedulefree", "train.lr_scheduler": "constant_with_warmup",
                           "train.timestep_buckets": 3},  # the stratum position continues across the resume
    "adafactor": {"train.optimizer": "adafactor", "train.weighting_scheme": "cosmap", "train.timestep_max": 0.8},
    "loraplus": {"train.loraplus_ratio": 16.0},
}


@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
@pytest.mark.parametrize("setting", list(OPTIMIZER_RUNS))
def test_each_optimizer_resumes_bit_identical(built_run, setting, monkeypatch):
    """Stopped at step 3 (after a checkpoint of a schedule-free run put x in the adapter and y in the
    state) and resumed: the same adapter, losses and LRs as the uninterrupted run of that setting,
    which trained differently from plain AdamW."""
    from stages import train
    from stages.core import faults

    overrides = OPTIMIZER_RUNS[setting]
    straight = new_run(built_run, f"{setting}-straight", **overrides)
    train.run(straight)
    want = adapter(lora_dir(straight) / "final")
    want_steps = {e["step"]: (e["loss"], e["lr"]) for e in run_events(straight, "step")}
    plain, _ = reference(built_run)
    assert any(not torch_equal(want[k], plain[k]) for k in want), "the setting changed nothing"

    cfg = new_run(built_run, f"{setting}-stopped", **overrides)
    monkeypatch.setenv(faults.ENV, f"train:{STOP_AT}:TERM")
    assert train.run(cfg)["step"] == STOP_AT
    monkeypatch.delenv(faults.ENV)
    train.run(cfg, resume=True)
    assert_same_adapter(adapter(lora_dir(cfg) / "final"), want)
    got_steps = {e["step"]: (e["loss"], e["lr"]) for e in run_events(cfg, "step")}
    assert got_steps == {s: v for s, v in want_steps.items() if s > STOP_AT}


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
@pytest.mark.parametrize("optimizer", ["adamw_schedulefree", "prodigy_schedulefree"])
def test_schedule_free_adapter_is_the_eval_point(built_run, optimizer):
    """A schedule-free run's saved adapter is its evaluation point x (`optimizer.eval()`), not the
    training point y; writing it leaves the parameters at y, bit for bit, in train mode."""
    import torch

    from stages.core import lora
    from stages.core.events import EventLog
    from stages.train.trainer import Trainer

    cfg = new_run(built_run, f"{optimizer}-eval", **{"train.optimizer": optimizer, "train.learning_rate": 1e-2,
                                                     "train.lr_scheduler": "constant", "train.max_grad_norm": 0.0})
    trainer = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
    torch.manual_seed(cfg.seed)
    trainer.setup_model()
    for _ in range(3):
        trainer.step()
    y = [p.detach().clone() for p in trainer.params]
    trainer.save_final(3, True, {})
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, y))  # back at y exactly
    assert all(g["train_mode"] for g in trainer.optimizer.param_groups)
    trainer.optimizer.eval()
    x = lora.adapter_state_dict(trainer.model)
    saved = adapter(lora_dir(cfg) / "final")
    assert_same_adapter(saved, x)
    trainer.optimizer.train()
    with torch.no_grad():
        for p, q in zip(trainer.params, y):
            p.copy_(q)
    assert any(not torch.equal(saved[k], v) for k, v in lora.adapter_state_dict(trainer.model).items())  # x != y
