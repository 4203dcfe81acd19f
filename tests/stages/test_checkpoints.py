"""Checkpoints (stages/train/checkpoints.py), checkpoint exports and the layering of stages/core.

The training state round-trips through safetensors + JSON with no pickle; retention keeps the newest
checkpoints by write order of the current lineage; `export-lora --checkpoint N` writes beside the
final export and never replaces it. Resume and restart end to end are in test_resume.py.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from stages.core.caches import export_dir


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_core_imports_no_stage_module():
    """stages/core is what the stages are built on: it must not import any stages/<stage>.py, nor the
    train package's modules."""
    stage_modules = {f"stages.{p.stem}" for p in (ROOT / "stages").glob("*.py") if p.stem != "__init__"}
    stage_modules |= {"stages.train"} | {f"stages.train.{p.stem}" for p in (ROOT / "stages" / "train").glob("*.py")}
    assert {"stages.train", "stages.train.trainer", "stages.train.checkpoints"} <= stage_modules
    found = {f"{p.name} imports {m}" for p in (ROOT / "stages" / "core").glob("*.py")
             for m in _imported_modules(p) if m in stage_modules}
    assert not found, sorted(found)


def _trained_optimizer(kind: str):
    from diffusers.optimization import get_scheduler

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64))]
    if kind == "adamw8bit":
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(params, lr=1e-3, betas=(0.9, 0.99))
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99))
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=10)
    for _ in range(3):
        sum(p.square().sum() for p in params).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return params, optimizer, scheduler


def _assert_same(a, b, where="state"):
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("kind", ["adamw", "adamw8bit"])
def test_training_state_round_trips_without_pickle(kind, tmp_path):
    """Optimizer (int-keyed state, tuple betas, 0-dim step tensors; bitsandbytes' quantization
    state), scheduler, RNG states and counters come back equal, with their types; the files are
    safetensors and JSON only, and the restored optimizer steps exactly as the original."""
    from stages.train.checkpoints import STATE_JSON, STATE_TENSORS, read_training_state, write_training_state

    params, optimizer, scheduler = _trained_optimizer(kind)
    state = {"step": 3, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "generator": torch.Generator().manual_seed(5).get_state(), "torch_rng": torch.get_rng_state(),
             "sampler": {"epoch": 1, "index": 7}, "batch_sizes": {"4": 2, "1": 1}, "lr": float("inf")}
    write_training_state(tmp_path, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([STATE_JSON, STATE_TENSORS])
    back = read_training_state(tmp_path)
    _assert_same(state, back)

    _, again, again_scheduler = _trained_optimizer(kind)
    again.load_state_dict(back["optimizer"])
    again_scheduler.load_state_dict(back["scheduler"])
    for opt, sched in ((optimizer, scheduler), (again, again_scheduler)):
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    assert all(torch.equal(a, b) for a, b in zip(optimizer.param_groups[0]["params"], again.param_groups[0]["params"]))
    assert scheduler.get_last_lr() == again_scheduler.get_last_lr()


def test_damaged_training_state_is_named(tmp_path):
    from stages.train.checkpoints import STATE_TENSORS, read_training_state, write_training_state
    from stages.core.errors import ArtifactError

    write_training_state(tmp_path, {"x": torch.arange(1000)})
    data = (tmp_path / STATE_TENSORS).read_bytes()
    (tmp_path / STATE_TENSORS).write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match=f"'{tmp_path}' has a damaged training state"):
        read_training_state(tmp_path)


class _Log:
    def __init__(self):
        self.events = []

    def emit(self, event, **fields):
        self.events.append((event, fields))


def _checkpoint(lora: Path, step: int, lineage: str, index: int) -> None:
    from stages.core.artifacts import write_manifest

    folder = lora / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    write_manifest(folder, "train", kind="checkpoint", step=step, fingerprint="fp", fingerprint_parts={},
                   lineage=lineage, save_index=index)


def test_retention_keeps_newest_written_of_this_lineage(tmp_path):
    """An abandoned lineage's checkpoint-16 outranks nothing: after this lineage writes checkpoint-3
    (after checkpoint-2), keep_checkpoints=1 keeps checkpoint-3, not the highest step, and leaves
    the other lineage's folders alone."""
    from stages.train.checkpoints import Checkpoints

    for step, lineage, index in ((8, "abandoned", 4), (16, "abandoned", 5), (2, "current", 0), (3, "current", 1)):
        _checkpoint(tmp_path, step, lineage, index)
    checkpoints = Checkpoints(tmp_path, "fp", keep=1, log=_Log())
    checkpoints.lineage = "current"
    checkpoints.prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-16", "checkpoint-3", "checkpoint-8"]


def test_set_aside_moves_everything_and_deletes_nothing(tmp_path):
    from stages.train.checkpoints import Checkpoints

    _checkpoint(tmp_path, 4, "old", 0)
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "adapter_model.safetensors").write_bytes(b"x")
    log = _Log()
    aside = Checkpoints(tmp_path, "fp", keep=2, log=log).set_aside()
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name] and aside.name.startswith(".restarted-")
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-4", "final"]
    assert (aside / "final" / "adapter_model.safetensors").read_bytes() == b"x"
    assert str(aside) in log.events[-1][1]["message"]
    assert Checkpoints(tmp_path, "fp", keep=2, log=log).set_aside() is None  # nothing left to move


# ---- export-lora --checkpoint ---------------------------------------------------------------------


@pytest.fixture()
def exported_copy(built_run, tmp_path):
    """A copy of a built run's lora/ and export/ (train.steps=8: lora/checkpoint-8 and lora/final)."""
    import dataclasses

    cfg = dataclasses.replace(built_run, artifacts=str(tmp_path))
    for folder in ("lora", "export"):
        shutil.copytree(built_run.run_dir / folder, cfg.run_dir / folder)
    return cfg


@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
def test_export_checkpoint_beside_final(exported_copy):
    from safetensors.torch import load_file

    from stages import export_lora
    from stages.core.errors import ArtifactError

    cfg = exported_copy
    export = export_dir(cfg)
    final_before = (export / "manifest.json").read_text()
    result = export_lora.run(cfg, checkpoint=8)
    assert result["source"].endswith("checkpoint-8") and result["step"] == 8
    assert (export / "manifest.json").read_text() == final_before  # the final export is untouched
    ckpt_file = export / "checkpoint-8" / export_lora.DIFFUSERS_FILE
    assert load_file(str(ckpt_file)).keys() == load_file(str(export / export_lora.DIFFUSERS_FILE)).keys()

    with pytest.raises(ArtifactError, match=r"no complete lora/checkpoint-7: the checkpoints there are: 8 \(e\.g\. "
                                            rf"`lorapipe export-lora {cfg.run} --artifacts .* --checkpoint 8`\)"):
        export_lora.run(cfg, checkpoint=7)

    assert export_lora.run(cfg) == json.loads(final_before)  # up to date: not rewritten
    assert _last_export_event(cfg) == "up_to_date"
    rewritten = export_lora.run(cfg, force=True)
    assert _last_export_event(cfg) == "done" and rewritten["fingerprint"] == json.loads(final_before)["fingerprint"]
    assert ckpt_file.is_file() and json.loads((export / "checkpoint-8" / "manifest.json").read_text())["step"] == 8


def _last_export_event(cfg) -> str:
    from stages.core.events import read_events

    return [e["event"] for e in read_events(cfg.run_dir) if e["stage"] == "export-lora"][-1]


def test_report_shows_batch_sizes():
    from stages import report

    done = {"stage": "train", "event": "done", "seconds": 1.0, "batch_sizes": {"4": 10, "1": 2}}
    steps = [{"stage": "train", "event": "step", "step": s, "loss": 1.0, "lr": 1e-4, "peak_vram_gb": 0.0}
             for s in range(1, 13)]
    events = [{"stage": "train", "event": "start"}, *steps, done]
    summary = report.summary(events, report.train_curve(events), 0.9)
    assert summary["batch_sizes"] == {"4": 10, "1": 2}
    assert "batch sizes      4 x 10 steps, 1 x 2 steps" in report.format_summary(summary)
