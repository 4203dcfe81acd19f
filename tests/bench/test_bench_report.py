"""The benchmark report reads result files honestly: what it compares, what it calls missed or cut off.

Synthetic result rows (the shape bench/bench.py writes); no model runs here. The numbers in
bench/RESULTS.md come from these functions, so a wrong comparison there is a wrong claim.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

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


def table(md: str, first_col: str) -> dict[str, dict[str, str]]:
    """The first markdown table whose header starts with `first_col`, as {first cell: {column: cell}}
    (first cells are unique in the tables read this way)."""
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_col} |"))
    head = [c.strip() for c in lines[start].strip("|").split("|")]
    out = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        out[cells[0]] = dict(zip(head, cells))
    return out


def _write(tmp: Path, rows: list[dict]) -> Path:
    f = tmp / "bench-flux-X.json"
    f.write_text(json.dumps({"meta": {"command": "bench.py run", "date_utc": "now"}, "items": rows, "builds": {}}))
    return f


def test_compile_comparison_needs_one_compiled_side(tmp_path: Path) -> None:
    rows = [_train_row("flux", "bf16-512-b4", 0.42, True),
            _train_row("flux", "bf16-512-b4-nocompile", 0.50, False, **{"runtime.compile_transformer": "off"}),
            _train_row("flux", "nf4-512-b4", 0.62, False),
            _train_row("flux", "nf4-512-b4-compile", 0.62, False, **{"runtime.compile_transformer": "on"})]  # fell back
    _, items, _ = report.load([_write(tmp_path, rows)])
    comp = comparison_rows(report.comparisons(report.train_rows(items, NO_MFU)))
    assert comp["compile off → on (auto), bf16 512 b4"] == [("0.500 s → 0.420 s", "1.19x faster")]
    assert not [k for k in comp if k.startswith("compile off → on, nf4")]  # the forced compile fell back
    # a fallen-back compile row never stands for the default: only the plain nf4 row is compared
    assert comp["nf4 / bf16 step, 512 px b4"] == [("nf4-512-b4 0.620 s / bf16-512-b4 0.420 s", "1.48x")]


def test_compiled_nf4_row_stands_for_the_default(tmp_path: Path) -> None:
    """`auto` compiles nf4 now: where an nf4 shape's -compile row compiled, targets use it and name it;
    the comparisons show the old uncompiled row beside it."""
    rows = [_train_row("flux", "bf16-512-b4", 0.40, True), _train_row("flux", "nf4-512-b4", 0.60, False),
            _train_row("flux", "nf4-512-b4-compile", 0.48, True, **{"runtime.compile_transformer": "on"})]
    _, items, _ = report.load([_write(tmp_path, rows)])
    train = report.train_rows(items, NO_MFU)
    t = table(report.targets(train, items), "target")
    ratio = t["FLUX nf4 step ≤ 1.3x bf16 step (512 px b4)"]
    assert ratio["measured"].startswith("1.20x") and "nf4-512-b4-compile" in ratio["measured"] and ratio["met?"] == "yes"
    speed = next(v for k, v in t.items() if k.startswith("FLUX.1-dev nf4 512 px b4"))
    assert speed["measured"].startswith("8.33 samples/s, 8.00 GB") and speed["met?"] == "yes"
    comp = comparison_rows(report.comparisons(train))
    assert sorted(comp["nf4 / bf16 step, 512 px b4"]) == [
        ("nf4-512-b4 0.600 s / bf16-512-b4 0.400 s", "1.50x"), ("nf4-512-b4-compile 0.480 s / bf16-512-b4 0.400 s", "1.20x")]
    assert comp["compile off → on, nf4 512 b4"] == [("0.600 s → 0.480 s", "1.25x faster")]


def test_targets_say_missed_with_the_ratio(tmp_path: Path) -> None:
    rows = [_train_row("flux", "bf16-512-b4", 0.40, True), _train_row("flux", "nf4-512-b4", 0.60, False)]
    _, items, _ = report.load([_write(tmp_path, rows)])
    t = table(report.targets(report.train_rows(items, NO_MFU), items), "target")
    ratio = t["FLUX nf4 step ≤ 1.3x bf16 step (512 px b4)"]
    assert ratio["measured"].startswith("1.50x") and "uncompiled" in ratio["measured"] and ratio["met?"] == "no"
    speed = next(v for k, v in t.items() if k.startswith("FLUX.1-dev nf4 512 px b4"))
    assert speed["measured"].startswith("6.67 samples/s") and speed["met?"] == "yes"  # 6.67 >= 6.0 at 8 GB


def test_a_ratio_says_when_only_one_side_ran_under_cuda_graphs(tmp_path: Path) -> None:
    rows = [_train_row("flux", "bf16-512-b1", 0.20, True), _train_row("flux", "nf4-512-b1", 0.15, True),
            _train_row("flux", "bf16-512-b4", 0.40, True), _train_row("flux", "nf4-512-b4", 0.44, True)]
    for row, graphs in zip(rows, (0, 1, 1, 1)):
        row["summary"]["runtime"] = {"cuda_graphs": {"graphs": graphs}}
    _, items, _ = report.load([_write(tmp_path, rows)])
    t = table(report.targets(report.train_rows(items, NO_MFU), items), "target")
    assert t["FLUX nf4 step ≤ 1.3x bf16 step (512 px b1)"]["measured"] == "0.75x (nf4 under CUDA graphs, bf16 eager)"
    assert t["FLUX nf4 step ≤ 1.3x bf16 step (512 px b4)"]["measured"] == "1.10x"


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


def test_results_lead_with_targets_and_a_table_per_family(tmp_path: Path) -> None:
    """RESULTS.md: targets, then one headline table per measured family (today's default row per
    shape); the full train table lives in the appendix, and neither names an issue."""
    rows = [_train_row("flux", "bf16-512-b4", 0.40, True), _train_row("flux", "nf4-512-b4", 0.60, False),
            _train_row("flux", "nf4-512-b4-compile", 0.48, True, **{"runtime.compile_transformer": "on"})]
    docs = report.write_report([_write(tmp_path, rows)])
    assert set(docs) == {"RESULTS.md", report.APPENDIX}
    results, appendix = docs["RESULTS.md"], docs[report.APPENDIX]
    assert results.index("## Targets") < results.index("## FLUX") and "## Qwen-Image" not in results
    head = table(results[results.index("## FLUX"):], "base")
    assert head["nf4"]["run"] == "nf4-512-b4-compile" and head["nf4"]["step s"] == "0.480"  # the compiled default
    assert head["bf16"]["samples/s"] == "10.00"
    full = [ln for ln in appendix.splitlines() if ln.startswith("| flux | ")]
    assert {ln.split("|")[2].strip() for ln in full} >= {"bf16-512-b4", "nf4-512-b4", "nf4-512-b4-compile"}
    assert "issue" not in (results + appendix).lower().replace("issues", "")


def comparison_rows(md: str) -> dict[str, list[tuple[str, str]]]:
    """The comparisons table as {comparison: [(values, ratio), ...]}."""
    out: dict[str, list[tuple[str, str]]] = {}
    for ln in md.splitlines()[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        out.setdefault(cells[1], []).append((cells[2], cells[3]))
    return out


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


def test_fp8_target_compares_step_and_peak_with_bf16_at_the_same_shape(tmp_path: Path) -> None:
    rows = [_train_row("flux", "bf16-1024-b4", 2.0, True), _train_row("flux", "fp8-1024-b4", 1.5, True)]
    rows[1]["summary"]["peak_vram_gb"] = {"allocated": 6.0, "reserved": 7.0}  # bf16's is 8.0
    _, items, _ = report.load([_write(tmp_path, rows)])
    target = table(report.targets(report.train_rows(items, NO_MFU), items), "target")
    row = target["FLUX fp8 1024 px b4: step ≤ 0.8x bf16's, peak ≤ 0.6x bf16's"]
    assert row["measured"].startswith("0.75x step") and "0.75x peak" in row["measured"]
    assert row["met?"] == "no"  # the step is fast enough, the peak is not small enough
    head = table(report.write_report([_write(tmp_path, rows)])["RESULTS.md"].split("## FLUX")[1], "base")
    assert head["fp8"]["step s"] == "1.500"


def test_short_plan_of_the_newer_and_edit_families() -> None:
    """The newer and edit families: the stage peaks and the 512 px b1 nf4 train, its export and load
    check first, then bf16 and batch 4, then 1024 px; FLUX.2 dev, staged, nf4 first, then its first bf16 row; optional references
    (FLUX.2) add a one-reference run with its own dataset; every family ends with fp8 at 1024 px, batch 1 and 4."""
    klein = [i.id.split("/", 1)[1] for i in plan("flux2-klein")]
    assert klein[:13] == ["encode/nf4", "latents/512", "train/nf4-512-b1", "export/nf4-512-b1", "verify/nf4-512-b1",
                          "train/bf16-512-b1", "train/nf4-512-b4", "train/bf16-512-b4", "latents/1024",
                          "train/nf4-1024-b1", "train/bf16-1024-b1", "train/nf4-1024-b4", "train/bf16-1024-b4"]
    refs = {i.id: i for i in plan("flux2-klein") if "ref1" in i.id}
    assert {i.controls for i in refs.values()} == {1} and {i.run for i in refs.values()} == {"bench-flux2-klein-512-ref1"}
    assert klein[-2:] == ["train/fp8-1024-b1", "train/fp8-1024-b4"] and len(klein) == len(set(klein))
    dev = [i.id.split("/", 1)[1] for i in plan("flux2")]  # staged: its components' items together
    assert dev[4:10] == ["train/nf4-512-b1", "export/nf4-512-b1", "verify/nf4-512-b1", "train/nf4-1024-b1",
                         "train/nf4-512-b4", "train/bf16-512-b1"] and "train/nf4-512-b1-ref1" in dev  # bf16 fits an H200
    for fam in ("flux-kontext", "qwen-image-edit", "krea2", "qwen-image-2.1"):
        items = plan(fam)
        assert not [i for i in items if "ref1" in i.id or i.controls is not None], fam  # the family's own count
        assert items[2].id == f"{fam}/train/nf4-512-b1" and [i.id for i in items[-2:]] == \
            [f"{fam}/train/fp8-1024-b1", f"{fam}/train/fp8-1024-b4"]
        assert all(30 <= i.est_s <= 130 for i in items if i.kind == "train"), fam


def test_fp8_rows_beside_bf16_for_the_measured_families() -> None:
    """fp8 at each shape (512 and 1024 px, batch 1 and 4) beside bf16's, selected by one --only glob."""
    import fnmatch

    for fam in ("qwen-image", "z-image", "sdxl", "flux"):
        ids = {i.id for i in plan(fam)}
        fp8 = {i for i in ids if fnmatch.fnmatch(i, f"{fam}/train/fp8-*")}
        assert fp8 == {f"{fam}/train/fp8-{s}" for s in ("512-b1", "512-b4", "1024-b1", "1024-b4")}, fam
        assert {i.replace("fp8", "bf16") for i in fp8} <= ids


def test_fp8_targets_and_new_family_tables(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(report, "_flops", lambda *a: None)  # MFU (seconds of meta builds) is not what this checks
    rows = [_train_row("qwen-image", "bf16-1024-b1", 2.0, True), _train_row("qwen-image", "fp8-1024-b1", 1.8, True),
            _train_row("z-image", "bf16-512-b1", 1.0, True), _train_row("z-image", "fp8-512-b1", 0.9, True),
            _train_row("flux2-klein", "nf4-512-b1", 0.5, True), _train_row("flux-kontext", "nf4-512-b1", 0.9, True)]
    _, items, _ = report.load([_write(tmp_path, rows)])
    target = table(report.targets(report.train_rows(items, {}), items), "target")
    assert target["Qwen-Image fp8 step ≤ 0.85x bf16 step (1024 px b1)"]["met?"] == "no"  # 0.90x
    assert target["Z-Image fp8 step ≤ 1.00x bf16 step (512 px b1)"]["met?"] == "yes"
    results = report.write_report([_write(tmp_path, rows)])["RESULTS.md"]
    assert "## FLUX.2 [klein]" in results and "## FLUX.1 Kontext (edit, 1 control)" in results
    assert table(results.split("## FLUX.2 [klein]")[1], "base")["nf4"]["step s"] == "0.500"


def test_bench_dataset_controls_follow_the_folder_convention(tmp_path: Path) -> None:
    from bench.bench import make_dataset
    from stages.core import dataset

    plain, one, two = (make_dataset(tmp_path / n, 3, 32, controls=c) for n, c in (("p", 0), ("c1", 1), ("c2", 2)))
    assert [len(it.controls) for it in dataset.scan(plain)] == [0, 0, 0]
    assert [[p.name for p in it.controls] for it in dataset.scan(one)][0] == ["img_000_control.png"]
    assert [[p.name for p in it.controls] for it in dataset.scan(two)][2] == ["img_002_control_1.png", "img_002_control_2.png"]
    for it, ref in zip(dataset.scan(two), dataset.scan(plain)):  # the same targets and captions whatever the controls
        assert (it.key, it.image_id, it.caption) == (ref.key, ref.image_id, ref.caption)
    assert (one / "img_000_control.png").read_bytes() != (one / "img_000.png").read_bytes()


def test_memory_report_takes_the_newest_measurement_whatever_the_file_names(tmp_path: Path) -> None:
    """A later call's train row at a budget replaces the earlier one even when its file sorts first
    (memory-flux-6gb-... before memory-flux-h200.json: the old 6 GB row stood in RESULTS.md)."""
    from bench.memory import report as memory_report

    def row(budget: str, sps: float, settings: dict) -> dict:
        return {"family": "flux", "resolution": 1024, "budget": budget, "stage": "train", "status": "ok",
                "plan": {"settings": settings, "predicted_peak_gb": 5.0, "budget_gb": 6.0 if budget != "auto" else 100.0},
                "peak_vram_gb": {"allocated": 4.0, "reserved": 5.0}, "samples_per_second": sps, "seconds": 10.0}

    old = tmp_path / "memory-flux-h200.json"
    old.write_text(json.dumps({"meta": {"date_utc": "2026-11-30 10:00:00"}, "items": [
        row("auto", 2.0, {"base_precision": "nf4", "swapped_blocks": 0}),
        row("6", 1.0, {"base_precision": "bf16", "swapped_blocks": 55})]}))
    new = tmp_path / "memory-flux-6gb-nf4swap.json"
    new.write_text(json.dumps({"meta": {"date_utc": "2026-12-01 16:00:00"}, "items": [
        row("6", 1.4, {"base_precision": "nf4", "swapped_blocks": 44})]}))
    for order in ([old, new], [new, old]):
        rows = table(memory_report(order), "budget GB")
        assert "swapped_blocks=44" in rows["6"]["plan"] and rows["6"]["x auto"] == "0.70"
        assert rows["6"]["x unswapped"] == "0.70" and rows["auto"]["x unswapped"] == ""  # nf4 whole: the auto row
    bf16 = tmp_path / "memory-flux-bf16.json"  # a swap row without an unswapped row of its precision: no ratio
    bf16.write_text(json.dumps({"meta": {"date_utc": "2026-12-02 10:00:00"}, "items": [
        row("8", 1.2, {"base_precision": "bf16", "swapped_blocks": 30})]}))
    rows = table(memory_report([old, new, bf16]), "budget GB")
    assert rows["8"]["x auto"] == "0.60" and rows["8"]["x unswapped"] == ""


def test_memory_report_resolves_a_same_plan_row_within_its_own_call(tmp_path: Path) -> None:
    """A "same plan as auto" row means the auto plan of its call: when a later call's auto trains
    another plan (bf16 where it used to be nf4), the row keeps its own call's measurement and says so."""
    from bench.memory import report as memory_report

    def row(budget: str, status: str = "ok", sps: float = 1.0, precision: str = "nf4") -> dict:
        if status == "same plan":
            return {"family": "z-image", "budget": budget, "stage": "train", "status": status, "same_as_budget": "auto"}
        return {"family": "z-image", "resolution": 1024, "budget": budget, "stage": "train", "status": "ok",
                "plan": {"settings": {"base_precision": precision, "swapped_blocks": 0}, "predicted_peak_gb": 5.0,
                         "budget_gb": 100.0}, "peak_vram_gb": {"allocated": 4.0, "reserved": 5.0},
                "samples_per_second": sps, "seconds": 10.0}

    old = tmp_path / "memory-old.json"
    old.write_text(json.dumps({"meta": {"date_utc": "2026-11-30 10:00:00"}, "items": [row("auto", sps=2.0), row("6", "same plan")]}))
    new = tmp_path / "memory-new.json"
    new.write_text(json.dumps({"meta": {"date_utc": "2026-12-01 10:00:00"}, "items": [row("auto", sps=2.5, precision="bf16")]}))
    rows = table(memory_report([new, old]), "budget GB")
    assert "base_precision=bf16" in rows["auto"]["plan"]
    assert "base_precision=nf4" in rows["6"]["plan"] and "same plan as auto in an earlier call" in rows["6"]["plan"]
    assert rows["6"]["samples/s"] == "2.000" and rows["6"]["x auto"] == "0.80"
    rows = table(memory_report([old]), "budget GB")  # its own call's auto row is the one shown: no note
    assert rows["6"]["plan"].endswith("(same plan as auto)")


def test_memory_report_gives_a_call_with_overrides_a_table_of_its_own(tmp_path: Path) -> None:
    """A call run with `--set` (CUDA graphs forced on, partial checkpointing) is not the presets'
    default: its rows get their own table, never replace the default rows, and with no "auto" row of
    their own compare with the defaults' "auto"; the targets read the default rows only."""
    from bench.memory import report as memory_report, targets

    def row(budget: str, sps: float, stage: str = "train") -> dict:
        return {"family": "flux", "resolution": 512, "budget": budget, "stage": stage, "status": "ok",
                "plan": {"settings": {"base_precision": "nf4", "swapped_blocks": 26 if budget == "6" else 0},
                         "predicted_peak_gb": 5.0, "budget_gb": 6.0}, "peak_vram_gb": {"allocated": 4.0, "reserved": 5.0},
                "samples_per_second": sps, "seconds": 10.0}

    default = tmp_path / "memory-flux-512.json"
    default.write_text(json.dumps({"meta": {"date_utc": "2026-12-01 23:41:00", "command": "bench/memory.py run --res 512 "
                                            "--families flux --budgets 6,auto --out x.json"},
                                   "items": [row("auto", 8.0), row("6", 1.6)]}))
    graphs = tmp_path / "memory-flux-512-graphs.json"
    graphs.write_text(json.dumps({"meta": {"date_utc": "2026-12-02 10:00:00", "command": "bench/memory.py run --res 512 "
                                           "--families flux --budgets 6 --set runtime.cuda_graphs=on --out y.json"},
                                  "items": [row("6", 4.0)]}))
    md = memory_report([graphs, default])
    assert "### flux, 512 px, batch 1\n" in md and "### flux, 512 px, batch 1, with runtime.cuda_graphs=on\n" in md
    from bench.memory import _variant
    assert _variant("bench/memory.py run --set=b=2 --set a=1 --out x") == "a=1, b=2" and _variant("run --out x") == ""
    assert table(md, "budget GB")["6"]["samples/s"] == "1.600"  # the first table: the defaults, untouched
    forced = table(md[md.index("with runtime.cuda_graphs=on"):], "budget GB")
    assert list(forced) == ["6"] and forced["6"]["samples/s"] == "4.000" and forced["6"]["x auto"] == "0.50"
    every = [row("auto", 8.0), row("6", 1.0, "encode-captions"), row("6", 1.0, "cache-latents"), row("6", 4.0)]
    for f, label in ((default, ""), (graphs, " --set runtime.cuda_graphs=on")):  # every stage of the 6 GB target, at 1024 px
        f.write_text(json.dumps({"meta": {"date_utc": "2026-12-02 10:00:00", "command": f"bench/memory.py run{label}"},
                                 "items": [{**r, "resolution": 1024} for r in every]}))
    assert targets([graphs], {}) == []  # the target is the defaults' to meet
    assert "0.50x" in targets([default], {})[0]


def test_memory_targets_need_every_stage_within_the_budget_and_the_speed(tmp_path: Path) -> None:
    """The memory target rows: each stage's reserved peak at the family's budget, train over auto."""
    from bench.memory import targets

    def row(budget: str, stage: str, reserved: float, sps: float | None = None) -> dict:
        return {"family": "qwen-image", "resolution": 1024, "budget": budget, "stage": stage, "status": "ok",
                "plan": {"settings": {"base_precision": "nf4" if budget != "auto" else "bf16"}, "predicted_peak_gb": 1.0},
                "peak_vram_gb": {"allocated": reserved - 0.5, "reserved": reserved}, "samples_per_second": sps}

    def write(name: str, train_reserved: float, train_sps: float) -> Path:
        f = tmp_path / name
        f.write_text(json.dumps({"meta": {"date_utc": "2026-12-01 22:05:00"}, "items": [
            row("auto", "train", 40.0, 2.0), row("8", "encode-captions", 6.7), row("8", "cache-latents", 5.1),
            row("8", "train", train_reserved, train_sps)]}))
        return f

    (ok,) = targets([write("a.json", 7.9, 1.6)], {"qwen-image": "Qwen-Image"})
    assert ok.startswith("| Qwen-Image 1024 px b1: every stage ≤ 8 GB") and "6.70 / 5.10 / 7.90" in ok
    assert "0.80x" in ok and "auto's base bf16" in ok and ok.endswith("| yes |")
    assert targets([write("b.json", 8.1, 1.6)], {})[0].endswith("| no |")  # a stage over its budget
    assert targets([write("c.json", 7.9, 1.1)], {})[0].endswith("| no |")  # 0.55x
    assert targets([tmp_path / "b.json"], {}) and not targets([], {})
    later = tmp_path / "later.json"  # a later call failed at that budget: its code has no passing row
    later.write_text(json.dumps({"meta": {"date_utc": "2026-12-01 23:00:00"}, "items": [
        {"family": "qwen-image", "resolution": 1024, "budget": "8", "stage": "train", "status": "failed", "rc": 2}]}))
    (row,) = targets([tmp_path / "a.json", later], {})
    assert "0.80x" in row and "train failed in a later call at 23:00 UTC" in row and row.endswith("| no |")
    (row,) = targets([later], {})  # nothing measured at all: unmet, not left out
    assert "train failed in the call at 23:00 UTC, no passing row" in row and row.endswith("| no |")


def test_memory_targets_say_how_the_train_row_ran() -> None:
    from bench.memory import _graphs

    ran = lambda **g: _graphs({"runtime": {"cuda_graphs": {"plan": "...", **g}}})  # noqa: E731
    assert ran(graphs=1, failed=0, replays=7) == "train under CUDA graphs, "
    assert ran(graphs=0, failed=1, replays=0) == "train eager after a failed capture, "
    assert ran(graphs=0, failed=0, replays=0, no_room=1, room="0.80 GB free ...") == "train eager (no room to capture), "
    assert ran() == "train eager, " and _graphs({"runtime": None}) == ""


def test_memory_plan_shows_the_full_size_train_plans_with_their_graph_room(tmp_path: Path, monkeypatch) -> None:
    """`bench/memory.py plan`: the train plan `run` would measure, from full-size configs on the meta
    device: FLUX at 6 GB swaps blocks at 512 and 1024 px, with room for CUDA graphs at both, each only
    with more blocks swapped than fit needs (the note says how many: 3 at 512 px, whose 26 left 1.90x
    free at the capture on the H200 and ran eager). The budget is those rows' 6 GB of allocator plus the CUDA
    context, which a --vram number counts now."""
    from bench.memory import plan_table
    from stages.core import fastpath, memory

    monkeypatch.delenv(fastpath.ENV, raising=False)

    vram = f"{6 + memory.CUDA_CONTEXT_GB:g}"
    rows = [ln.split(" | ") for ln in plan_table("flux", vram, "512,1024", str(tmp_path)).splitlines()[2:]]
    assert [(r[1], r[2]) for r in rows] == [("512", vram), ("1024", vram)]
    for r in rows:
        assert "base_precision=nf4" in r[3] and "swapped_blocks=" in r[3] and float(r[4]) * memory.FRAGMENTATION <= 6
        room = float(r[3].split("graph_room=")[1].split(",")[0])
        assert room >= fastpath.CAPTURE_ROOM * memory.GRAPH_ROOM_MARGIN
        assert "more blocks swapped than the budget needs" in r[5]


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """family -> its tiny pipeline folder with the full-size configs and no weights (bench.plan_cost), built
    once for this file's planner tests."""
    from bench.plan_cost import config_only_model

    root = tmp_path_factory.mktemp("config-only")
    return lambda family: config_only_model(family, root / family)


def test_the_planners_graph_room_predicts_the_room_measured_on_the_h200(tmp_path: Path, config_only, monkeypatch) -> None:
    """The planner's room for CUDA graphs under swap (memory.graph_room, which decides how many blocks a
    plan swaps to leave it) against the room the trainer measured at the capture on the H200, in every
    result file's train row that recorded it (runtime.cuda_graphs.room; full-size configs on the meta
    device, the row's own plan): never above the measured room, so a plan the planner gives room has
    it, and within 10 % of it, so it does not swap blocks for nothing."""
    import re

    from bench.bench import run_args
    from bench.memory import MemoryRunner, _variant, parser
    from stages.core import fastpath, memory
    from stages.core.model_source import model_source
    from stages.families import get_family

    monkeypatch.delenv(fastpath.ENV, raising=False)
    figures = re.compile(r"(-?[\d.]+) GB free under the ([\d.]+) GB budget for a capture that wants [\d.]+x "
                         r"the eager step's ([\d.]+) GB of activations")
    calls = [json.loads(f.read_text()) for f in (Path(__file__).parents[2] / "bench" / "results").glob("memory-*.json")]
    rows = [r for d in calls if not _variant(d.get("meta", {}).get("command", ""))  # the presets' rows, no --set overrides
            for r in d["items"] if ((r.get("runtime") or {}).get("cuda_graphs") or {}).get("room")]
    assert len(rows) >= 5 and {r["family"] for r in rows} >= {"flux", "qwen-image", "z-image"}
    runner, ratios = MemoryRunner(run_args(parser, work=str(tmp_path))), []
    for r in rows:
        free, budget_gb, need = map(float, figures.search(r["runtime"]["cuda_graphs"]["room"][0]).groups())
        assert budget_gb == float(r["budget"])
        model = config_only(r["family"])
        cfg = runner.row_config(r["family"], model, r["budget"], r["resolution"])
        budget = memory.Budget(float(r["budget"]), "cap")
        plan = memory.plan_for(cfg, get_family(cfg.family), model_source(cfg), budget, "train")
        ran = r["plan"]["settings"]
        same = next(t for t in plan.tried if all(t[k] == ran[k] for k in ("base_precision", "swapped_blocks", "checkpointed_blocks")))
        room = memory.graph_room(same["predicted_peak_gb"], same["activations_gb"], same["lora_grads_gb"], budget)
        ratios.append(room / (free / need))
    assert all(0.9 <= x <= 1.0 for x in ratios), ratios


def test_the_planners_train_peak_predicts_the_bf16_and_fp8_rows_measured_on_the_h200(tmp_path: Path, config_only) -> None:
    """The planner's train peak (full-size configs on the meta device, each row's own settings) against
    the peak every checkpointed bf16 and fp8 train row of bench/results allocated on the H200: 0.93-1.05x
    (0.94-1.04x: over 1 only in eager rows, which allocate less), so "auto" sizes an fp8 base as
    stages/core/fp8.py makes it (one byte per block weight plus a scale per output channel) and SDXL's
    activations outside its transformer blocks (family.outside_block_gb, fitted on these rows: it had
    been 0.92-0.96x, which would have planned fp8 at 4 GB for a row that reserved 4.30) and FLUX.2's
    recomputed block (family.block_work_units: at the default its rows were 0.86-0.996x), and the
    budgets it picks hold; the reserve on top is memory.FRAGMENTATION's."""
    from bench.bench import Runner, run_args
    from stages.core import memory
    from stages.core.model_source import model_source
    from stages.families import get_family

    runner = Runner(run_args(work=str(tmp_path)))
    ratios: dict[str, float] = {}
    for f in sorted((Path(__file__).parents[2] / "bench" / "results").glob("bench-*.json")):
        for r in json.loads(f.read_text())["items"]:
            fam, sets = r["id"].split("/")[0], r.get("sets") or {}
            if r["kind"] != "train" or r["status"] != "ok" \
                    or fam not in ("flux", "qwen-image", "z-image", "sdxl", "flux2", "flux2-klein") \
                    or sets.get("train.base_precision") not in ("bf16", "fp8") or sets.get("runtime.gradient_checkpointing") is False:
                continue
            model = config_only(fam)
            cfg = runner.config(fam, model, r["res"], sets)
            plan = memory.plan_train(cfg, get_family(fam), model_source(cfg), memory.Budget(1000.0, "cap"))
            ratios[f"{f.name}:{r['id']}"] = plan.predicted_peak_gb / r["summary"]["peak_vram_gb"]["allocated"]
    assert sum("/fp8-" in k for k in ratios) >= 5 and len(ratios) >= 25 and sum("flux2" in k for k in ratios) >= 10
    assert all(0.93 <= x <= 1.05 for x in ratios.values()), {k: round(v, 3) for k, v in ratios.items()}


def test_the_planners_train_peak_predicts_every_suites_unswapped_train_row(tmp_path: Path, config_only) -> None:
    """The suites' train rows (bench/results/<family>/<family>.train.*.json: nf4, fp8 and bf16, 512 and 1024 px,
    batch 1 and 4, the newer and edit families among them, some on an H100) against the planner's peak for the
    row's settings: 0.93-1.07x what each allocated, so a cap sized by the plan (with memory.FRAGMENTATION on top)
    holds at every precision and batch measured. A row whose plan swapped blocks is left out (its peak is the
    swap's, planned under the GPU's budget, not this uncapped one)."""
    from bench.bench import Runner, run_args
    from stages.core import fp8, memory
    from stages.core.model_source import model_source
    from stages.families import FAMILIES, get_family

    runner, ratios = Runner(run_args(work=str(tmp_path))), {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8, "fp8_supported", lambda: True)  # the rows ran on Hopper
        mp.setattr(memory.budget, "host_available_bytes", lambda: None)
        for f in sorted((Path(__file__).parents[2] / "bench" / "results").glob("*/*.train.*.json")):
            fam = f.name.split(".train.")[0]
            if fam not in FAMILIES or f.name.endswith(".failed.json"):
                continue
            for r in json.loads(f.read_text())["items"]:
                s = r.get("summary") or {}
                if r["kind"] != "train" or r["status"] != "ok" or (s.get("runtime") or {}).get("block_swap"):
                    continue
                model = config_only(fam)
                cfg = runner.config(fam, model, r["res"], r.get("sets") or {})
                plan = memory.plan_train(cfg, get_family(fam), model_source(cfg), memory.Budget(1000.0, "cap"))
                ratios[f.name] = plan.predicted_peak_gb / s["peak_vram_gb"]["allocated"]
    assert len(ratios) >= 35 and {f.split(".train.")[0] for f in ratios} >= {
        "chroma", "ernie-image", "hidream-i1", "ideogram4", "qwen-image-edit-2511"}
    assert sum(".train.fp8-1024-b4" in k for k in ratios) >= 3, sorted(ratios)
    assert all(0.93 <= x <= 1.07 for x in ratios.values()), {k: round(v, 3) for k, v in ratios.items()}


def _cmd_sets(cmd: str) -> dict[str, Any]:
    """A stage command's `--set k=v` pairs that planning reads (the model and paths left out)."""
    from bench.memory import command_sets, extra_sets

    return {k: {"true": True, "false": False}.get(v, v) for k, v in extra_sets(command_sets(cmd)).items()
            if k.split(".")[0] in ("train", "captions", "gpu") or k in ("data.resolution", "data.cache_variants")}


def test_the_planners_un_checkpointed_blocks_predict_the_rows_measured_on_the_h200(tmp_path: Path, config_only) -> None:
    """Rows with some or no blocks checkpointed: the planner's peak at each row's own checkpointed count
    against what it allocated on the H200, 0.99-1.06x. FLUX.1's single-stream blocks keep 13 units
    un-checkpointed (family.block_saved_units; the 17 of every other block had the partial rows at
    1.10-1.19x, so "auto" left up to 5.4 GB of a budget unused): FLUX's bf16 1024 px b4 row with no
    checkpointing, its nf4 rows at 16 and 24 GB with 41 and 22 of 57 checkpointed
    (memory-flux-partialckpt-h200.json), and FLUX.1 Kontext's fp8 row within the diffusers script's
    peak (47 checkpointed; peers-kontext-1024-b1-run3.json); Z-Image's and SDXL's rows with none."""
    from bench.bench import Runner, run_args
    from stages.core import memory
    from stages.core.model_source import model_source
    from stages.families import get_family

    results = Path(__file__).parents[2] / "bench" / "results"
    rows = []  # (name, family, px, sets, checkpointed blocks or None for none, allocated GB)
    for f in sorted(results.glob("bench-*.json")):
        for r in json.loads(f.read_text())["items"]:
            if r["kind"] == "train" and r["status"] == "ok" and (r.get("sets") or {}).get("runtime.gradient_checkpointing") is False:
                rows.append((f"{f.name}:{r['id']}", r["id"].split("/")[0], r["res"], r["sets"], 0, r["summary"]["peak_vram_gb"]["allocated"]))
    for r in json.loads((results / "memory-flux-partialckpt-h200.json").read_text())["items"]:
        if r["stage"] == "train":
            planned = r["plan"]["settings"]["base_precision"]  # "auto" chose it
            rows.append((f"flux at {r['budget']} GB", "flux", r["resolution"], {**_cmd_sets(r["cmd"]), "train.base_precision": planned},
                         r["plan"]["settings"]["checkpointed_blocks"], r["peak_vram_gb"]["allocated"]))
    for r in json.loads((results / "peers-kontext-1024-b1-run3.json").read_text())["rows"]:
        t = r.get("stages", {}).get("train", {})
        if r.get("status") == "ok" and t.get("runtime", {}).get("checkpointed_blocks", 0) < t.get("runtime", {}).get("blocks", 0):
            rows.append((f"kontext {r['precision']}", "flux-kontext", 1024, _cmd_sets(t["cmd"]),
                         t["runtime"]["checkpointed_blocks"], t["peak_gb"]))
    runner, ratios = Runner(run_args(work=str(tmp_path))), {}
    for name, fam, res, sets, checkpointed, allocated in rows:
        sets = {k: v for k, v in sets.items() if k not in ("gpu.vram_budget_gb", "data.resolution")}
        if checkpointed:
            sets["runtime.gradient_checkpointing"] = "auto"  # every count is tried: read the row's own
        cfg = runner.config(fam, config_only(fam), res, sets)
        plan = memory.plan_train(cfg, get_family(fam), model_source(cfg), memory.Budget(1000.0, "cap"))
        same = [t for t in plan.tried if t["checkpointed_blocks"] == checkpointed and not t["swapped_blocks"]
                and t["base_precision"] == cfg.train.base_precision]
        ratios[name] = same[0]["predicted_peak_gb"] / allocated
    assert len(ratios) >= 6 and sum(n.startswith(("flux at", "kontext")) for n in ratios) == 3, sorted(ratios)
    assert all(0.99 <= x <= 1.06 for x in ratios.values()), str({k: round(v, 3) for k, v in ratios.items()})


def test_results_carry_the_hand_written_notes(tmp_path: Path) -> None:
    """The generated RESULTS.md appends memory.md and fp8.md (the hand-written reading of those result files)
    when the memory and fp8 result files are among its inputs."""
    bench_dir = Path(__file__).parents[2] / "bench"
    files = [_write(tmp_path, [_train_row("flux", "bf16-512-b4", 0.40, True)]),
             bench_dir / "results" / "memory-flux-h200.json", bench_dir / "results" / "fp8-h200.json"]
    results = report.write_report(files)["RESULTS.md"]
    for name in ("memory.md", "fp8.md"):
        assert (bench_dir / name).read_text() in results, name


def test_the_denoiser_flops_count_on_the_meta_device_for_each_token_layout() -> None:
    """The MFU column's FLOPs (bench/full_configs.denoiser_flops: the full-size denoiser run on the meta
    device with a hook on every Linear) at 512 px b1, for the families whose token layout differs (the
    others share FLUX's or Qwen-Image's code path, which bench/RESULTS.md's MFU columns exercise): it runs
    (Qwen-Image 2.1's image-slot mask once stopped it, so its rows had no MFU), and the token count is the
    family's own: Qwen-Image 2.1 77 text tokens beside 32x32 unpacked latents of its 16x VAE; Kontext
    twice the 32x32 packed tokens; SDXL the image alone, and no attention count (DiT families only)."""
    from bench.full_configs import denoiser_flops
    from bench.report import VAE_DOWN

    for fam in ("qwen-image-2.1", "flux-kontext", "sdxl"):
        down = VAE_DOWN[fam]
        f = denoiser_flops(fam, 1, (512 // down, 512 // down), 77)
        images = 2 if fam == "flux-kontext" else 1
        assert f["tokens"] == images * 1024 + (0 if fam == "sdxl" else 77), fam
        assert f["linear_fwd"] > 0 and f["params"] > 1e9 and (f["attention_fwd"] > 0) == (fam != "sdxl"), fam


def test_gpu_probe_section_shows_gradients_against_flash_and_the_attention_modes() -> None:
    """The cuDNN probe's gradient comparison (worst block of each case) and the tiny fp8 probe's attention settings
    reach bench/APPENDIX.md: a NaN block or a far-off gradient shows there, not just "ok"."""
    cudnn = {"probe": "cudnn_flux_probe.py", "date": "2026-12-04", "rows": [
        {"case": "tiny-widths-guard", "ok": True, "s": 0.02, "grads_vs_flash": [
            {"block": 0, "finite": False, "cos": 0.5, "rel": 0.9}, {"block": 1, "finite": True, "cos": 0.9999, "rel": 0.01}]},
        {"case": "kontext-eager", "ok": False, "err": ["illegal memory access"]}]}
    tiny = {"probe": "fp8_tiny_probe.py", "shapes": [{"y_finite": True, "dx_finite": True, "y_rel": 0.01, "dx_rel": 0.02}],
            "model": ["loss 2.48"], "attention_modes": [{"attention": "guard", "base": "fp8", "finite": 0, "of": 3}]}
    text = report.gpu_probe_section([cudnn, tiny])
    assert "`python3 bench/cudnn_flux_probe.py` (2026-12-04):" in text
    assert "| tiny-widths-guard | cuDNN | True | 0.02 |  |  | 1/2, 0.5, 0.9 |" in text
    assert "| kontext-eager | cuDNN | False |  |  | illegal memory access |  |" in text
    assert "1 (rows, in, out) shapes of the fp8 Linear, 0 with" in text and "| guard | fp8 | 0 of 3 |" in text


def test_memory_rows_skip_train_when_a_cache_stage_left_no_cache(tmp_path: Path, monkeypatch) -> None:
    """A failed encode-captions (LTX-2's connectors refused 77-token captions) leaves no captions.zarr: the row's
    train says it was skipped and why, and the call goes on (it once crashed the whole call on the missing store).
    Where an earlier budget's caches exist, train still runs on them."""
    from bench.bench import run_args
    from bench.memory import MemoryRunner, parser

    runner = MemoryRunner(run_args(parser, work=str(tmp_path), budgets="auto,8", tiny=True))
    monkeypatch.setattr(runner, "ensure_model", lambda fam, kind: tmp_path / "model")
    monkeypatch.setattr(runner, "save", lambda: None)
    ran: list = []

    def measure(fam, model, budget, kind, stage):  # the fault: encode fails at the first budget only
        ran.append((budget, stage))
        if kind == "encode" and budget == "auto":
            return {"family": fam, "budget": budget, "stage": stage, "status": "failed", "plan": None}
        if kind != "train":
            (tmp_path / "artifacts" / "mem-ltx2" / ("captions.zarr" if kind == "encode" else "latents.zarr")).mkdir(parents=True, exist_ok=True)
        return {"family": fam, "budget": budget, "stage": stage, "status": "ok", "plan": {"settings": {"b": budget}}}

    monkeypatch.setattr(runner, "measure", measure)
    runner.run_family("ltx2")
    items = [(r["budget"], r["stage"], r["status"], r.get("reason", "")) for r in runner.results["items"]]
    assert items[:3] == [("auto", "encode-captions", "failed", ""), ("auto", "cache-latents", "ok", ""),
                         ("auto", "train", "skipped", "encode-captions failed: no cache to train on")]
    assert ("auto", "train") not in ran and ("8", "encode-captions") in ran and ("8", "train") in ran
    assert items[-1] == ("8", "train", "ok", "")


def test_the_performance_docs_train_tables_are_the_latest_results() -> None:
    """docs/performance.md's per-family train tables are rebuilt from bench/results (`python bench/bench.py report
    --docs docs/performance.md`): a newer result, or a figure edited by hand, shows here until the doc is rebuilt."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "performance.md"
    text = doc.read_text()
    tables = [line for line in text.splitlines() if report.SUITE_LINE.match(line)]
    assert len(tables) >= 11, tables
    assert report.sync_performance_doc(text, report.result_files()) == text, \
        "run `python bench/bench.py report --docs docs/performance.md` and commit the doc"
    # not vacuous: a hand-edited figure is put back
    edited = text.replace("| 0.451 |", "| 0.450 |", 1)  # FLUX.1's fp8-1024-b1 step
    assert edited != text and report.sync_performance_doc(edited, report.result_files()).count("| 0.450 |") == 0
    # a row whose plan swapped blocks says so beside its peak (Qwen-Image-Edit-2511's bf16 at batch 4 on an 80 GB
    # card held 26 GB, less than its batch 1's 42 GB, because 46 blocks stayed in host memory)
    swapped = [line for line in text.splitlines() if "blocks swapped |" in line]
    assert any(line.startswith("| bf16 | 1024 | 4 |") and "46 of 60 blocks swapped" in line for line in swapped), swapped


def test_memory_report_times_train_from_its_steady_steps(tmp_path: Path) -> None:
    """A train row's samples/s in the memory report is its batch over the median gap between the steps after its
    warm-up, not the stage's figure over its few timed steps, which one long step sets: Qwen-Image's first step of
    a second caption length took 41 s where the others took 0.7 (0.11 samples/s over 5 steps)."""
    from bench.memory import report as memory_report, steady_samples_per_second

    def row(budget: str, gaps: list[float], sps: float) -> dict:
        times = [100.0]
        for g in gaps:
            times.append(times[-1] + g)
        return {"family": "qwen-image", "resolution": 1024, "budget": budget, "stage": "train", "status": "ok",
                "cmd": "pipeline.py train --set runtime.warmup_steps_excluded=3 --set train.batch_size=2",
                "plan": {"settings": {"base_precision": "nf4", "swapped_blocks": 55 if budget == "8" else 0},
                         "predicted_peak_gb": 5.0, "budget_gb": 8.0},
                "peak_vram_gb": {"allocated": 4.0, "reserved": 5.0}, "samples_per_second": sps, "seconds": 10.0,
                "steps": [{"step": k + 1, "ts": t} for k, t in enumerate(times)]}

    capped = row("8", [5.0, 9.0, 0.7, 0.7, 41.0, 0.7, 1.0], 0.113)  # steps 1-3 warm up; 41 s: a new caption length
    assert steady_samples_per_second(capped) == pytest.approx(2 / 0.7)
    free = row("auto", [3.0, 0.5, 0.5, 0.5, 0.5, 0.5, 2.0], 1.5)
    results = tmp_path / "memory-qwen.json"
    results.write_text(json.dumps({"meta": {"date_utc": "2026-12-05 15:00:00"}, "items": [free, capped]}))
    rows = table(memory_report([results]), "budget GB")
    assert rows["8"]["samples/s"] == f"{2 / 0.7:.3f}" and rows["8"]["x auto"] == f"{0.5 / 0.7:.2f}"
    no_steps = {k: v for k, v in capped.items() if k != "steps"}  # a row that kept no step times: the stage's figure
    assert steady_samples_per_second(no_steps) == 0.113


def test_auto_puts_fp8_first_for_the_families_whose_fp8_step_was_measured_faster() -> None:
    """Every family with fp8 and bf16 train rows at 1024 px batch 1 in bench/results: where fp8 stepped faster,
    train.base_precision = "auto" tries fp8 first at that step (family.fp8_faster_from_tokens at most its tokens);
    where it stepped slower, not (None, or above them)."""
    from stages.core.memory.sizes import sample_tokens
    from stages.families import FAMILIES, get_family

    bench = [f for f in report.result_files() if report._kind(json.loads(f.read_text())) == "bench"]
    _, items, _ = report.load(bench)
    steps = {(r["family"], r["name"]): r["step_s"] for r in report.train_rows(items, None)
             if r["status"] == "ok" and r.get("step_s")}
    checked = []
    for name in FAMILIES:
        fp8, bf16 = steps.get((name, "fp8-1024-b1")), steps.get((name, "bf16-1024-b1"))
        if fp8 is None or bf16 is None:
            continue
        family = get_family(name)
        tokens = sample_tokens(family, 1024, 1024) + 77
        faster_from = family.fp8_faster_from_tokens
        first = faster_from is not None and faster_from <= tokens
        assert first == (fp8 < bf16), (name, fp8, bf16, faster_from, tokens)
        checked.append(name)
    assert {"flux", "qwen-image", "ernie-image", "ideogram4", "hidream-i1"} <= set(checked), checked
