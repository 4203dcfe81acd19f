"""The benchmark's suites (bench/suites.py) and their runner (bench/run.py), without a GPU: every row is
one the bench scripts can run, every row docs/performance.md shows has a suite, a call's result JSON is
split into one file per row, a newer measurement replaces a row's file and a failure never does, and
the report picks the latest call's row whatever the files are named.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/bench/test_bench_suites.py
"""

from __future__ import annotations

import json
import re

import pytest
from pathlib import Path

from bench import run, suites
from bench.bench import plan
from bench.peers import VARIANT_FLAGS, variant_flag

ROOT = Path(__file__).resolve().parents[2]


def test_every_row_is_one_the_bench_scripts_take_and_keys_are_unique() -> None:
    keys = [r.key for rows in suites.SUITES.values() for r in rows]
    assert len(keys) == len(set(keys))
    planned: dict[str, set[str]] = {}
    for name, rows in suites.SUITES.items():
        for r in rows:
            if isinstance(r, suites.Bench):
                ids = planned.setdefault(r.family, {i.id for i in plan(r.family)})
                assert f"{r.family}/{r.item}" in ids, (name, r)
            elif isinstance(r, suites.Peers):
                for variant in r.product.split(","):
                    flags = variant.split("+")[1:]
                    assert all(f in VARIANT_FLAGS or variant_flag(f) for f in flags), (name, variant)
            elif isinstance(r, suites.Script):
                script = next(a for a in r.args if a.endswith(".py") or a.startswith("tests/"))
                assert (ROOT / script).exists(), (name, script)


def test_every_table_row_of_the_performance_doc_has_a_suite_row() -> None:
    doc = (ROOT / "docs" / "performance.md").read_text()
    keys = {r.key for rows in suites.SUITES.values() for r in rows}
    for section in doc.split("\n### ")[1:]:
        fam = re.search(r"bash bench/device\.sh ([\w.-]+)`", section)
        if not fam or fam.group(1) not in suites.SUITES:
            continue
        runs = re.findall(r"\| `([\w-]+-\d+-b\d[\w-]*)`(?: \([\w ]+\))? \|", section)  # a run may name its GPU
        assert runs, section[:80]
        for name in runs:
            assert f"{fam.group(1)}.train.{name}" in keys, (fam.group(1), name)
    for product, which in re.findall(r"PEERS_PRODUCT=([\w+]+) bash bench/peers\.sh (\w+)", doc):
        assert any(isinstance(r, suites.Peers) and r.which == which and product in r.product.split(",")
                   for rows in suites.SUITES.values() for r in rows), (which, product)


def test_a_bench_call_is_split_into_one_file_per_row(tmp_path: Path) -> None:
    rows = [suites.train("flux", "nf4", 512, 1), suites.train("flux", "bf16", 512, 1)]
    cmd, _ = run.command(rows, tmp_path / "o.json", 300)
    assert cmd[1:6] == ["bench/bench.py", "run", "--families", "flux", "--keep"]
    assert cmd[-4:] == ["--only", "flux/train/nf4-512-b1", "--only", "flux/train/bf16-512-b1"]
    data = {"meta": {"date_utc": "2026-12-05 10:00:00", "command": "x"}, "builds": {}, "items": [
        {"id": "flux/encode/nf4#rerun", "status": "ok"}, {"id": "flux/train/nf4-512-b1", "status": "ok"},
        {"id": "flux/train/bf16-512-b1", "status": "skipped"}]}
    split = run.split(rows, data)
    assert set(split) == {"flux.encode.nf4", "flux.train.nf4-512-b1", "flux.train.bf16-512-b1"}
    assert split["flux.train.nf4-512-b1"]["meta"] == data["meta"]
    written = {k: run.write(tmp_path / "flux", k, v) for k, v in split.items()}
    assert written["flux.train.bf16-512-b1"] is None  # the budget left it unstarted: nothing written
    assert sorted(p.name for p in (tmp_path / "flux").iterdir()) == ["flux.encode.nf4.json", "flux.train.nf4-512-b1.json"]


def test_a_newer_measurement_replaces_a_rows_file_and_a_failure_never_does(tmp_path: Path) -> None:
    folder, key = tmp_path / "s", "flux.train.nf4-512-b1"

    def result(status: str, when: str) -> dict:
        return {"meta": {"date_utc": when}, "items": [{"id": "flux/train/nf4-512-b1", "status": status}]}

    run.write(folder, key, result("ok", "1"))
    run.write(folder, key, result("failed", "2"))
    assert json.loads((folder / f"{key}.json").read_text())["meta"]["date_utc"] == "1"
    assert json.loads((folder / f"{key}.failed.json").read_text())["meta"]["date_utc"] == "2"
    run.write(folder, key, result("ok", "3"))
    assert json.loads((folder / f"{key}.json").read_text())["meta"]["date_utc"] == "3"
    assert not (folder / f"{key}.failed.json").exists()


def test_memory_budgets_of_one_call_are_split_and_read_back_as_that_call(tmp_path: Path) -> None:
    """A memory call's budgets go to one file each; the report reads them back as one call, so a budget whose
    plan equals another's ("same plan") still finds that row."""
    from bench.memory import report as memory_report

    rows = suites.memory_grid("z-image", 1024, ("auto", "8"))
    cmd, _ = run.command(rows, tmp_path / "o.json", 300)
    assert cmd[cmd.index("--budgets") + 1] == "auto,8"

    def row(budget: str, status: str = "ok") -> dict:
        if status == "same plan":
            return {"family": "z-image", "resolution": 1024, "budget": budget, "stage": "train", "status": status,
                    "same_as_budget": "auto"}
        return {"family": "z-image", "resolution": 1024, "budget": budget, "stage": "train", "status": "ok",
                "plan": {"settings": {"base_precision": "nf4", "swapped_blocks": 0}, "predicted_peak_gb": 5.0,
                         "budget_gb": 100.0}, "peak_vram_gb": {"allocated": 4.0, "reserved": 5.0},
                "samples_per_second": 2.0, "seconds": 10.0}

    data = {"meta": {"date_utc": "2026-12-05 10:00:00", "command": "bench/memory.py run"},
            "items": [row("auto"), row("8", "same plan")]}
    files = [run.write(tmp_path / "memory", k, v) for k, v in run.split(rows, data).items()]
    assert sorted(f.name for f in files) == ["memory.z-image-1024-8gb.json", "memory.z-image-1024-auto.json"]
    md = memory_report(sorted(files))
    assert "| 8 | train | base_precision=nf4, swapped_blocks=0 (same plan as auto) |" in md


def test_the_report_takes_the_latest_call_of_a_row_whatever_the_file_names(tmp_path: Path) -> None:
    from bench import report

    def call(name: str, when: str, sps: float) -> Path:
        f = tmp_path / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"meta": {"date_utc": when, "command": "bench.py run"}, "builds": {}, "items": [
            {"id": "sdxl/train/bf16-512-b1", "kind": "train", "res": 512, "status": "ok", "env": {},
             "sets": {"train.base_precision": "bf16", "train.batch_size": 1}, "summary": {"samples_per_second": sps}}]}))
        return f

    old = call("bench-sdxl-Z.json", "2026-12-01 10:00:00", 1.0)  # sorts after the newer file's name
    new = call("sdxl/sdxl.train.bf16-512-b1.json", "2026-12-05 10:00:00", 2.0)
    for files in ([old, new], [new, old]):
        _, items, _ = report.load(files)
        assert items["sdxl/train/bf16-512-b1"]["summary"]["samples_per_second"] == 2.0
    assert report.result_files(tmp_path) == [old, new]
    assert report._kind([]) == report._kind({"flux": {}}) == "other"  # layouts no section reads


def test_the_budget_grid_runs_every_preset_as_users_run_it_most_used_first() -> None:
    """budget-grid: each family's own preset (the one its full.py names), every budget, the preset's caption
    length and 77 tokens, train batch 1 and 4, 1024 and 512 px; FLUX.1 dev's 512-token rows open it, so a call
    cut short measured the preset users run most; one call per (family, length, batch, px)."""
    from stages.families import FAMILIES
    from bench.full_configs import full

    assert set(suites.PRESETS) == set(FAMILIES)
    assert all(full(f).PRESET == suites.PRESETS[f] for f in FAMILIES)
    rows = suites.SUITES["budget-grid"]
    assert list(dict.fromkeys(r.family for r in rows))[:5] == ["flux", "qwen-image", "z-image", "flux2-klein", "sdxl"]
    first = [r for r in rows if r.family == "flux"][:len(suites.GRID_BUDGETS)]
    assert [r.budget for r in first] == list(suites.GRID_BUDGETS) and {r.px for r in first} == {1024}
    assert "captions.max_sequence_length=512" in first[0].sets and "train.batch_size=1" in first[0].sets
    for family in FAMILIES:
        mine = [r for r in rows if r.family == family]
        lengths = {s for r in mine for s in r.sets if s.startswith("captions.max_sequence_length=")}
        short = 128 if family == "ltx2" else 77  # LTX-2's connectors take multiples of their 128 registers
        assert len(mine) == len(suites.GRID_BUDGETS) * 2 * 2 * len(lengths) and f"captions.max_sequence_length={short}" in lengths
    calls = [list(group) for _, group in run.groupby(rows, key=run.call_of)]
    assert all(len(c) == len(suites.GRID_BUDGETS) for c in calls)
    cmd, _ = run.command(calls[0], Path("/tmp/row.json"), 540)
    assert cmd[1:3] == ["bench/memory.py", "run"] and "4,6,8,12,16,24,auto" in cmd


def test_a_varied_captions_row_draws_captions_of_distinct_lengths_and_keys_apart(tmp_path: Path) -> None:
    """`caption-lengths`: memory.py --captions varied draws 24 images whose captions all differ in length (the
    default draws 8 of about one length), and its rows' keys and commands differ from the equal-caption rows'."""
    from bench.bench import VARIED_CAPTIONS, make_dataset

    varied = make_dataset(tmp_path / "varied", VARIED_CAPTIONS, 32, varied=True)
    equal = make_dataset(tmp_path / "equal", 8, 32)
    assert len({len(p.read_text().split()) for p in varied.glob("*.txt")}) == VARIED_CAPTIONS
    assert len({len(p.read_text().split()) for p in equal.glob("*.txt")}) == 1
    rows = suites.SUITES["caption-lengths"]
    assert len({r.key for r in rows}) == len(rows) == 6
    calls = [run.command([r], tmp_path / "row.json", 540)[0] for r in rows]
    assert sum("--captions" in c for c in calls) == 4 and all(("--captions" in c) == ("varied" in r.key)
                                                             for c, r in zip(calls, rows))
    rounded = [c for c in calls if "runtime.caption_tokens_multiple=64" in c]
    assert len(rounded) == 2 and all("varied" in c for c in rounded)


def test_list_shows_the_rows_and_commands_that_only_and_missing_select(tmp_path: Path, monkeypatch) -> None:
    """`run.py --list` with --only (and --missing) prints what the same call would start, so a device call can be
    checked before it is spent."""
    monkeypatch.setattr(run, "RECORD", tmp_path / "record")  # the committed record holds none of these rows
    only = ["chroma.train.fp8-1024-b1", "chroma.encode.*"]
    shown = run.listing(["chroma", "flux"], only, False, tmp_path)
    assert shown.splitlines()[0] == "chroma:" and "flux:" not in shown
    assert "--only chroma/train/fp8-1024-b1" in shown and "--only chroma/encode/nf4" in shown
    assert "chroma/train/bf16-1024-b1" not in shown
    (tmp_path / "chroma").mkdir()
    (tmp_path / "chroma" / "chroma.encode.nf4.json").write_text(json.dumps({"items": [{"id": "chroma/encode/nf4", "status": "ok"}]}))
    missing = run.listing(["chroma"], only, True, tmp_path)
    assert "chroma/encode/nf4" not in missing and "--only chroma/train/fp8-1024-b1" in missing
    assert run.listing(["chroma"], ["no-such-row"], False, tmp_path) == ""


def test_a_row_with_a_stage_the_budget_left_unstarted_is_run_again_and_keeps_what_was_measured(tmp_path: Path,
                                                                                                monkeypatch) -> None:
    """A memory row whose call ran out of budget before a stage ("skipped": Qwen-Image's uncapped train) is not
    done: `--missing` runs it again. The rerun's file keeps each stage that the older call measured and the new
    one left unstarted, saying when it was measured; a stage the rerun measured replaces the older one."""
    monkeypatch.setattr(run, "RECORD", tmp_path / "record")
    folder, key = tmp_path / "budget-grid", "memory.qwen-image-1024-auto"

    def item(stage: str, status: str, gb: float | None = None) -> dict:
        return {"family": "qwen-image", "stage": stage, "status": status, "peak_vram_gb": gb and {"total": gb}}

    run.write(folder, key, {"meta": {"date_utc": "2026-12-05 15:00:00"},
                            "items": [item("encode-captions", "ok", 16.9), item("cache-latents", "ok", 5.7),
                                      item("train", "skipped")]})
    assert not run.done("budget-grid", key, tmp_path)
    run.write(folder, key, {"meta": {"date_utc": "2026-12-06 09:00:00"},
                            "items": [item("encode-captions", "skipped"), item("cache-latents", "ok", 5.8),
                                      item("train", "ok", 42.0)]})
    items = {i["stage"]: i for i in json.loads((folder / f"{key}.json").read_text())["items"]}
    assert items["encode-captions"]["peak_vram_gb"] == {"total": 16.9}
    assert items["encode-captions"]["measured_utc"] == "2026-12-05 15:00:00"
    assert items["cache-latents"]["peak_vram_gb"] == {"total": 5.8} and "measured_utc" not in items["cache-latents"]
    assert items["train"]["status"] == "ok" and run.done("budget-grid", key, tmp_path)


def _calls(*rows) -> list:
    from itertools import groupby

    return [("s", list(group)) for _, group in groupby(rows, key=run.call_of)]


def test_on_several_gpus_each_familys_calls_queue_on_a_gpu_of_their_own() -> None:
    """bench/run.py on a machine of several GPUs: bench and memory calls queue per family, in their order (they
    share the family's built pipeline), each call pinned to its GPU with a work folder of that GPU's; one GPU, a
    single family or a peers call (timed beside the product) keeps one queue of every call, on the whole
    machine."""
    ernie = [suites.Bench("ernie-image", "train/nf4-1024-b4"), suites.Bench("ernie-image", "train/fp8-1024-b4")]
    ernie_memory = suites.Memory("ernie-image", 1024, "16")
    ideogram = suites.Bench("ideogram4", "train/fp8-1024-b1")
    calls = _calls(*ernie, ideogram, ernie_memory)
    queues = run.lanes(calls, 2)
    assert [[(s, [r.key for r in rows]) for s, rows in q] for q in queues] == [
        [("s", [r.key for r in ernie]), ("s", [ernie_memory.key])], [("s", [ideogram.key])]]
    assert run.lanes(calls, 1) == [calls]
    assert run.lanes(_calls(*ernie), 4) == [_calls(*ernie)]
    with_peers = calls + _calls(suites.Peers("ideogram", 1024, 1, 15, "nf4"))
    assert run.lanes(with_peers, 4) == [with_peers]

    cmd, env = run.command(ernie, Path("/o/row.json"), 500, gpu=3)
    assert env == {"CUDA_VISIBLE_DEVICES": "3"} and cmd[cmd.index("--work") + 1] == "/tmp/lorapipe-bench-gpu3"
    cmd, env = run.command([ernie_memory], Path("/o/row.json"), 500, gpu=1)
    assert env == {"CUDA_VISIBLE_DEVICES": "1"} and cmd[cmd.index("--work") + 1] == "/tmp/lorapipe-memory-gpu1"
    cmd, env = run.command(ernie, Path("/o/row.json"), 500)
    assert env == {} and "--work" not in cmd


def test_queues_run_side_by_side_each_gpu_taking_the_next_and_shm_keeps_the_running_families(tmp_path: Path,
                                                                                              monkeypatch) -> None:
    """Three families on two GPUs: the first two run at once (each waits for the other at a barrier), the third
    on the GPU that frees first; /dev/shm keeps the folders of the families running (both first ones, taken
    before either starts) and no other."""
    import threading

    monkeypatch.setattr(run, "SHM_MODELS", tmp_path / "shm")
    for fam in ("ernie-image", "ideogram4", "hidream-i1", "flux"):
        (tmp_path / "shm" / fam).mkdir(parents=True)
    queues = run.lanes(_calls(suites.Bench("ernie-image", "encode/nf4"), suites.Bench("ideogram4", "encode/nf4"),
                              suites.Bench("hidream-i1", "encode/nf4")), 2)
    both, ran, lock = threading.Barrier(2, timeout=30), [], threading.Lock()

    def one(queue, gpu) -> None:
        family = queue[0][1][0].family
        with run.IN_USE_LOCK:
            run.keep_only(run.IN_USE | {family})
            kept = sorted(p.name for p in (tmp_path / "shm").iterdir())
        if family != "hidream-i1":
            both.wait()  # raises BrokenBarrierError unless the other family runs at the same time
        with lock:
            ran.append((family, gpu, kept))

    run.side_by_side(queues, 2, one)
    assert [(f, g) for f, g, _ in ran[:2]] in ([("ernie-image", 0), ("ideogram4", 1)], [("ideogram4", 1), ("ernie-image", 0)])
    assert ran[2][0] == "hidream-i1" and ran[2][1] in (0, 1)
    assert all(set(kept) >= {"ernie-image", "ideogram4"} and "flux" not in kept for _, _, kept in ran[:2])
    assert "flux" not in ran[2][2] and len(ran[2][2]) <= 2 and not run.IN_USE  # at most the two running


def test_a_device_calls_results_come_back_packed_in_one_file_and_are_taken_here(tmp_path: Path) -> None:
    """A device call returns at most 8 files, and one family's call writes more: device.sh packs $OUT's results/
    and logs/ into results.tgz, and `run.py --take <files_at>` copies each row's file into bench/results/<suite>/,
    a newer file replacing the older. A damaged row is refused before anything is copied over it."""
    out = tmp_path / "out"
    rows = {f"ideogram4.train.{p}-1024-b{b}.json": {"meta": {"p": p, "b": b}, "items": []}
            for p in ("nf4", "fp8", "bf16") for b in (1, 4)}
    for name, data in rows.items():
        (out / "results" / "ideogram4").mkdir(parents=True, exist_ok=True)
        (out / "results" / "ideogram4" / name).write_text(json.dumps(data))
    (out / "results" / "chroma").mkdir()
    (out / "results" / "chroma" / "memory.chroma-1024-16gb.json").write_text("{}")
    (out / "logs").mkdir()
    (out / "logs" / "x.log").write_text("log")
    assert run.main(["--pack", str(out)]) is None
    assert [p.name for p in out.iterdir()] == ["results.tgz"]  # one file comes back, not 8

    record = tmp_path / "bench-results"
    (record / "ideogram4").mkdir(parents=True)
    (record / "ideogram4" / "ideogram4.train.nf4-1024-b1.json").write_text('{"older": true}')
    taken = run.take(out, record)
    assert len(taken) == 7 and not list(record.rglob("*.log"))
    assert json.loads((record / "ideogram4" / "ideogram4.train.nf4-1024-b1.json").read_text()) == \
        rows["ideogram4.train.nf4-1024-b1.json"]
    assert (record / "chroma" / "memory.chroma-1024-16gb.json").exists()

    import tarfile

    bad = tmp_path / "bad.tgz"
    (tmp_path / "r" / "results" / "flux").mkdir(parents=True)
    (tmp_path / "r" / "results" / "flux" / "flux.train.nf4-512-b1.json").write_text('{"cut')
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(tmp_path / "r" / "results", arcname="results")
    with pytest.raises(json.JSONDecodeError):
        run.take(bad, record)
    assert not (record / "flux").exists()
