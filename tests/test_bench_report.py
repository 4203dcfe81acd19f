"""The benchmark report reads result files honestly: what it compares, what it calls missed or cut off.

Synthetic result rows (the shape bench/bench.py writes); no model runs here. The numbers in
bench/RESULTS.md come from these functions, so a wrong comparison there is a wrong claim.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import report
from bench.bench import plan


# MFU needs a meta-device build of the full-size denoiser (seconds): these tests check the rest
NO_MFU = {(fam, res, b): None for fam in ("flux",) for res in (512, 1024) for b in (1, 4)}


def _train_row(fam: str, name: str, step_s: float, compiled: bool, **sets: object) -> dict:
    precision, res, batch = name.split("-")[:3]
    ts = [100.0 + i * step_s for i in range(8)]
    return {"id": f"{fam}/train/{name}", "kind": "train", "res": int(res), "status": "ok", "rc": 0, "env": {},
            "sets": {"train.base_precision": precision, "train.batch_size": int(batch[1:]), **sets},
            "summary": {"samples_per_second": int(batch[1:]) / step_s, "compiled": compiled,
                        "peak_vram_gb": {"allocated": 8.0, "reserved": 9.0},
                        "steps": [{"step": i + 1, "ts": t, "loss": 1.0} for i, t in enumerate(ts)]}}


def _write(tmp: Path, rows: list[dict]) -> Path:
    f = tmp / "bench-flux-X.json"
    f.write_text(json.dumps({"meta": {"command": "bench.py run", "date_utc": "now"}, "items": rows, "builds": {}}))
    return f


def test_compile_comparison_needs_one_compiled_side(tmp_path: Path) -> None:
    rows = [_train_row("flux", "bf16-512-b4", 0.42, True),
            _train_row("flux", "bf16-512-b4-nocompile", 0.50, False, **{"train.compile_transformer": "off"}),
            _train_row("flux", "nf4-512-b4", 0.62, False),
            _train_row("flux", "nf4-512-b4-compile", 0.62, False, **{"train.compile_transformer": "on"})]  # fell back
    _, items, _ = report.load([_write(tmp_path, rows)])
    text = report.comparisons(report.train_rows(items, NO_MFU))
    assert "compile off → on (auto), bf16 512 b4 | 0.500 s → 0.420 s | 1.19x faster" in text
    assert "compile off → on, nf4" not in text  # the forced compile fell back: neither side compiled
    assert "nf4 / bf16 step, 512 px b4 | nf4-512-b4 0.620 s / bf16-512-b4 0.420 s | 1.48x" in text
    assert "nf4-512-b4-compile 0.620 s" not in text  # a fallen-back compile row never stands for the default


def test_compiled_nf4_row_stands_for_the_default(tmp_path: Path) -> None:
    """`auto` compiles nf4 now: where an nf4 shape's -compile row compiled, targets use it and name it;
    the comparisons show the old uncompiled row beside it."""
    rows = [_train_row("flux", "bf16-512-b4", 0.40, True), _train_row("flux", "nf4-512-b4", 0.60, False),
            _train_row("flux", "nf4-512-b4-compile", 0.48, True, **{"train.compile_transformer": "on"})]
    _, items, _ = report.load([_write(tmp_path, rows)])
    train = report.train_rows(items, NO_MFU)
    text = report.targets(train, items)
    assert "| FLUX nf4 step ≤ 1.3x bf16 step (512 px b4) | 1.20x (run nf4-512-b4-compile, compiled) | yes |" in text
    assert "8.33 samples/s, 8.00 GB allocated (9.00 reserved) (run nf4-512-b4-compile, compiled) | yes |" in text
    comp = report.comparisons(train)
    assert "| nf4-512-b4 0.600 s / bf16-512-b4 0.400 s | 1.50x |" in comp
    assert "| nf4-512-b4-compile 0.480 s / bf16-512-b4 0.400 s | 1.20x |" in comp
    assert "compile off → on, nf4 512 b4 | 0.600 s → 0.480 s | 1.25x faster" in comp


def test_targets_say_missed_with_the_ratio(tmp_path: Path) -> None:
    rows = [_train_row("flux", "bf16-512-b4", 0.40, True), _train_row("flux", "nf4-512-b4", 0.60, False)]
    _, items, _ = report.load([_write(tmp_path, rows)])
    text = report.targets(report.train_rows(items, NO_MFU), items)
    assert "| FLUX nf4 step ≤ 1.3x bf16 step (512 px b4) | 1.50x (nf4 uncompiled: run before `auto` compiled nf4) | no |" in text
    assert "6.67 samples/s, 8.00 GB allocated (9.00 reserved) (nf4 uncompiled: run before `auto` compiled nf4) | yes |" in text


def test_killed_at_budget_is_cut_off_and_unplanned_failures_drop_out(tmp_path: Path) -> None:
    rows = [{"id": "flux/train/nf4-512-b1", "kind": "train", "res": 512, "status": "failed", "rc": -9, "sets": {},
             "env": {}, "log_tail": "[train] 4/8 steps"},
            {"id": "flux/train/old-item", "kind": "train", "res": 512, "status": "failed", "rc": 1, "sets": {}, "env": {}},
            {"id": "flux/latents/512", "kind": "latents", "res": 512, "status": "ok", "rc": 0, "sets": {}, "env": {},
             "summary": {}}]
    _, items, _ = report.load([_write(tmp_path, rows)])
    assert items["flux/train/nf4-512-b1"]["status"] == "cut off (budget)"
    assert "flux/train/old-item" not in items  # no longer in the plan and never ran
    missing = report.not_run(items)
    assert "`flux/train/nf4-512-b1`: cut off (budget) — [train] 4/8 steps" in missing
    assert "`flux/train/bf16-512-b4-nocompile`: not run yet" in missing
    assert "qwen-image" not in missing  # a family with no result file is not listed item by item


def test_plan_puts_each_familys_targets_first() -> None:
    assert [i.id for i in plan("flux")][:4] == ["flux/encode/nf4", "flux/latents/512", "flux/profile/nf4-512-b4",
                                                 "flux/train/nf4-512-b4"]
    qwen = [i.id for i in plan("qwen-image")]
    assert qwen[:3] == ["qwen-image/encode/nf4", "qwen-image/latents/512", "qwen-image/train/nf4-512-b1"]
    assert "qwen-image/pytest/cuda" not in qwen
    sdxl = plan("sdxl")
    assert [i.id for i in sdxl if i.kind == "encode"] == ["sdxl/encode/bf16"]
    ids = [i.id for i in plan("z-image")]
    assert len(ids) == len(set(ids))
