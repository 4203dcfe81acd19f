"""Partial gradient checkpointing (train.gradient_checkpointing = "auto"): the trainer checkpoints exactly
the k repeated blocks the memory plan chose, and the loss and LoRA gradients are those of checkpointing
every block and of checkpointing none.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/test_partial_checkpointing.py

On CPU there is no budget, so the GPU budget is simulated: `memory.resolve_budget` returns a cap just
above the planner's own predicted peak for one checkpointed block, and the real planner and trainer run.
The checkpoint path is counted by wrapping torch's checkpoint function (it still runs).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_beside
from stages.core import blockswap, memory
from stages.core.events import EventLog
from stages.core.model_source import model_source
from stages.families import get_family


def _budget_for(cfg, k: int) -> float:
    """A cap (GB) at which the planner checkpoints exactly k blocks of cfg's model."""
    plan = memory.plan_train(cfg, get_family(cfg.family), model_source(cfg), memory.Budget(1e6, "cap"))
    peak = next(t["predicted_peak_gb"] for t in plan.tried if t["swapped_blocks"] == 0 and t["checkpointed_blocks"] == k)
    return peak * memory.FRAGMENTATION * 1.0001


def _simulate_budget(monkeypatch, gb: float) -> None:
    monkeypatch.setattr(memory, "resolve_budget", lambda setting, device, enforce=True: memory.Budget(gb, "cap"))


def _step(cfg, checkpointed: list) -> tuple[object, float, list[torch.Tensor]]:
    """One step's trainer, loss and LoRA gradients, seeded as `fit` seeds it; `checkpointed` collects the
    module every checkpoint call ran."""
    from stages.trainer import Trainer

    tr = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "train"))
    torch.manual_seed(cfg.seed)
    tr.setup_model()
    _, (batch, eps, noise, t) = tr.draw_next()
    checkpointed.clear()
    loss = tr.compute_loss(batch, eps, noise, t)
    loss.backward()
    return tr, float(loss), [p.grad.clone() for p in tr.params]


@pytest.mark.parametrize("built_run", ["flux", "sdxl"], indirect=True)
def test_partial_checkpointing_same_loss_and_gradients(built_run, monkeypatch):
    """k of N blocks checkpointed (0 < k < N): loss and LoRA gradients equal those of all N and of none
    bit for bit (fp32, CPU); the first k blocks go through the checkpoint path, the other N - k never do."""
    real, ran = torch.utils.checkpoint.checkpoint, []

    def counting(fn, *args, **kwargs):
        ran.append(blockswap.block_of(fn.__self__))  # fn is the module's bound __call__
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    results = {}
    for name, value in (("none", False), ("all", True), ("partial", "auto")):
        cfg = run_beside(built_run, f"ckpt-{name}", **{"train.base_precision": "fp32", "train.gradient_checkpointing": value})
        if name == "partial":
            _simulate_budget(monkeypatch, _budget_for(cfg, 1))
        tr, loss, grads = _step(cfg, ran)
        blocks = blockswap.repeated_blocks(tr.model)
        ids = [id(m) for m in ran]
        results[name] = (loss, grads, tr.checkpointed, [ids.count(id(b)) for b in blocks])
    n = len(blocks)
    assert n >= 2
    assert results["none"][2:] == (0, [0] * n)
    assert results["all"][2:] == (n, [1] * n)
    assert results["partial"][2:] == (1, [1] + [0] * (n - 1))  # the first block only, once per forward
    for other in ("all", "none"):
        assert results["partial"][0] == results[other][0]
        assert all(torch.equal(a, b) for a, b in zip(results["partial"][1], results[other][1]))


@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
def test_planned_partial_checkpointing_is_logged_recorded_and_resumes_any_setting(built_run, monkeypatch):
    """A budget that fits 1 of 2 blocks checkpointed: the `plan` event and the manifest's runtime say so;
    the run's fingerprint is that of true, false and "auto" alike (checkpointing changes no numbers), so
    it stays up to date under any of them."""
    from stages import plan as plan_stage
    from stages import train
    from stages.core.stage import staleness

    cfg = run_beside(built_run, "ckpt-run", **{"train.base_precision": "fp32", "train.gradient_checkpointing": "auto",
                                               "train.steps": 2, "train.checkpoint_every": 0})
    gb = _budget_for(cfg, 1)
    _simulate_budget(monkeypatch, gb)
    manifest = train.run(cfg)
    assert (manifest["runtime"]["checkpointed_blocks"], manifest["runtime"]["blocks"]) == (1, 2)
    assert manifest["runtime"]["gradient_checkpointing"] is True
    events = [json.loads(line) for line in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
    planned = [e["settings"] for e in events if e["event"] == "plan" and e["stage"] == "train"]
    assert planned[-1]["checkpointed_blocks"] == 1 and planned[-1]["blocks"] == 2
    for value in (True, False, "auto"):
        ok, reasons = staleness(train, _same_run(cfg, value))
        assert ok, (value, reasons)
    assert "checkpointed_blocks=1/2" in plan_stage._settings_text(planned[-1])


def _same_run(cfg, value):
    import dataclasses

    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, gradient_checkpointing=value))
