"""Partial gradient checkpointing (runtime.gradient_checkpointing = "auto"): the trainer checkpoints exactly
the k repeated blocks the memory plan chose, and the loss and LoRA gradients are those of checkpointing
every block and of checkpointing none.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/planner/test_partial_checkpointing.py

On CPU there is no budget, so the GPU budget is simulated: `memory.resolve_budget` returns a cap just
above the planner's own predicted peak for one checkpointed block, and the real planner and trainer run.
The checkpoint path is counted by wrapping torch's checkpoint function (it still runs).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import losses_and_lora, run_beside
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
    monkeypatch.setattr(memory.budget, "resolve_budget", lambda setting, device, enforce=True, stage=None: memory.Budget(gb, "cap"))


def _step(cfg, checkpointed: list) -> tuple[object, float, list[torch.Tensor]]:
    """One step's trainer, loss and LoRA gradients, seeded as `fit` seeds it; `checkpointed` collects the
    module every checkpoint call ran."""
    from stages.train.trainer import Trainer

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
        cfg = run_beside(built_run, f"ckpt-{name}", **{"train.base_precision": "fp32", "runtime.gradient_checkpointing": value})
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
def test_partial_checkpointing_replays_lora_dropout(built_run, monkeypatch):
    """With LoRA dropout the checkpointed block's recompute draws the forward's masks again (torch's RNG
    state saved and restored), and the direct blocks draw theirs once: the loss and gradients of no
    checkpointing, bit for bit."""
    results = []
    for name, value in (("none", False), ("partial", "auto")):
        cfg = run_beside(built_run, f"ckpt-dropout-{name}", **{"train.base_precision": "fp32", "train.dropout": 0.25,
                                                             "runtime.gradient_checkpointing": value})
        if name == "partial":
            _simulate_budget(monkeypatch, _budget_for(cfg, 1))
        tr, loss, grads = _step(cfg, [])
        results.append((tr.checkpointed, loss, grads))
    (k0, loss0, grads0), (k1, loss1, grads1) = results
    assert (k0, k1) == (0, 1)
    assert loss0 == loss1 and all(torch.equal(a, b) for a, b in zip(grads0, grads1))


@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
def test_planned_partial_checkpointing_is_logged_recorded_and_resumes_any_setting(built_run, monkeypatch):
    """A budget that fits 1 of 2 blocks checkpointed: the `plan` event and the manifest's runtime say so;
    the run's fingerprint is that of true, false and "auto" alike (checkpointing changes no numbers), so
    it stays up to date under any of them."""
    from stages import plan as plan_stage
    from stages import train
    from stages import registry
    from stages.core.stage import staleness

    cfg = run_beside(built_run, "ckpt-run", **{"train.base_precision": "fp32", "runtime.gradient_checkpointing": "auto",
                                               "train.steps": 2, "runtime.checkpoint_every": 0})
    gb = _budget_for(cfg, 1)
    _simulate_budget(monkeypatch, gb)
    manifest = train.run(cfg)
    assert (manifest["runtime"]["checkpointed_blocks"], manifest["runtime"]["blocks"]) == (1, 2)
    assert manifest["runtime"]["gradient_checkpointing"] is True
    events = [json.loads(line) for line in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
    planned = [e["settings"] for e in events if e["event"] == "plan" and e["stage"] == "train"]
    assert planned[-1]["checkpointed_blocks"] == 1 and planned[-1]["blocks"] == 2
    for value in (True, False, "auto"):
        ok, reasons = staleness(registry.get("train"), _same_run(cfg, value))
        assert ok, (value, reasons)
    assert "checkpointed_blocks=1/2" in plan_stage._settings_text(planned[-1])


def _same_run(cfg, value):
    import dataclasses

    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, gradient_checkpointing=value))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
def test_partial_checkpointing_under_compile_and_cuda_graphs(built_run, monkeypatch):
    """On the GPU, compiled blocks (regional compile keeps each block's identity) under CUDA graphs: a plan
    of 1 of 2 blocks checkpointed trains the losses and LoRA weights of every block checkpointed, as close
    as two such runs are to each other (within bf16 rounding)."""
    from stages.core import fastpath
    from stages.core.runtime import torch_flags

    monkeypatch.setenv(fastpath.ENV, "on")
    runs = []
    for name, value in (("all", True), ("all-again", True), ("partial", "auto")):
        cfg = run_beside(built_run, f"ckpt-cuda-{name}", **{
            "device": "cuda", "train.base_precision": "bf16", "runtime.gradient_checkpointing": value,
            "runtime.compile_transformer": "on", "train.steps": 6})
        if name == "partial":
            _simulate_budget(monkeypatch, _budget_for(cfg, 1))
        from stages.train.trainer import Trainer

        tr = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "train"))
        torch.manual_seed(cfg.seed)
        with torch_flags(True, False, True):
            tr.setup_model()
            assert tr.compiled and tr.checkpointed == (1 if name == "partial" else 2)
            losses, weights = losses_and_lora(tr)
        runs.append((losses, weights, tr.denoiser))
    (l0, w0, _), (l1, w1, _), (l2, w2, graphed) = runs
    assert isinstance(graphed, fastpath.GraphedDenoiser) and graphed.summary()["replays"] >= 4
    # dynamo may trace a block called inside checkpoint apart from one called directly (other fusions,
    # other bf16 roundings): a 1e-3 relative floor over ten times the run-to-run difference
    assert (l2 - l0).abs().max() <= 10 * (l1 - l0).abs().max() + 1e-3 * l0.abs().max()
    assert (w2 - w0).abs().max() <= 10 * (w1 - w0).abs().max() + 1e-3 * w0.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
def test_under_a_budget_auto_captures_only_with_room_and_trains_eager_without(built_run, monkeypatch):
    """On the GPU under a budget, runtime.cuda_graphs = "auto" weighs the room at the capture (fastpath.CaptureRoom
    with the unswapped factor): with room it captures and replays; with the factor past any room it trains
    eager to the end (FLUX.2 klein's capped rows crashed after a capture without room), the same losses
    within bf16 rounding, and the summary says why."""
    from stages.core import fastpath
    from stages.core.runtime import torch_flags
    from stages.train.trainer import Trainer

    monkeypatch.delenv(fastpath.ENV, raising=False)
    runs = {}
    for name, factor in (("room", 0.0), ("no-room", 1e6)):
        monkeypatch.setattr(fastpath, "UNSWAPPED_CAPTURE_ROOM", factor)
        cfg = run_beside(built_run, f"room-cuda-{name}", **{
            "device": "cuda", "train.base_precision": "bf16", "runtime.gradient_checkpointing": True,
            "runtime.cuda_graphs": "auto", "runtime.compile_transformer": "off", "train.steps": 6})
        tr = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "train"))
        torch.manual_seed(cfg.seed)
        with torch_flags(True, False, True):
            tr.setup_model()
            assert isinstance(tr.denoiser, fastpath.GraphedDenoiser) and tr.denoiser._room.factor == factor
            losses, _ = losses_and_lora(tr)
        runs[name] = (losses, tr.denoiser.summary())
    (l0, room), (l1, none) = runs["room"], runs["no-room"]
    assert room["graphs"] == 1 and room["replays"] >= 4 and room["no_room"] == 0
    assert not room["room"][0].startswith("no room")
    assert none["graphs"] == 0 and none["replays"] == 0 and none["no_room"] == 1
    assert none["room"][0].startswith("no room: ") and "GB free under the" in none["room"][0]
    assert torch.isfinite(l1).all() and (l1 - l0).abs().max() <= 1e-2 * l0.abs().max()
