"""Memory budgets on the GPU: each stage's plan, predicted and measured peak, and speed
under simulated small cards, run through the product's own stage commands.

    python bench/memory.py run --families flux,qwen-image --out $OUT/memory.json --budget-s 400
    python bench/memory.py run --families flux --budgets auto,6 --res 512 --out $OUT/memory-512.json   # 512 px rows
    python bench/memory.py run --tiny --out /tmp/memory.json          # the plumbing, tiny models, CPU
    python bench/memory.py report bench/results/memory*.json bench/results/memory*/*.json        # markdown, one table per family
    python bench/memory.py plan --families qwen-image,flux --budgets 8,6 --res 512,1024   # train plans, CPU, no weights

For each family it builds the full-size random-weight pipeline (as `bench/bench.py build`, into
/dev/shm) and runs `pipeline.py encode-captions / cache-latents / train` as child processes at
1024 px (`--res`), batch 1, with `--set gpu.vram_budget_gb=B` for B = auto (no cap) and 6/8/12/16/24 GB
(a number is a cap the stage enforces with torch.cuda.set_per_process_memory_fraction). A budget
whose plan for a stage equals one already measured (the planner is asked in-process first, from
meta-device sizes) reuses that measurement instead of running it again. The JSON is rewritten
after every row, so a call cut off keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench import Item, Runner, collect, events_since, model_dir, run_args, stage_manifest  # noqa: E402

STAGES = (("encode", "encode-captions", "captions.zarr"), ("latents", "cache-latents", "latents.zarr"),
          ("train", "train", "lora/final"))
BUDGETS = ("auto", "4", "6", "8", "12", "16", "24")  # the targets' budgets first after the reference
RESOLUTION = 1024  # the default of --res
EST_S = {"encode": 30, "latents": 25, "train": 75}  # seconds per stage call on the H200 (bench/results)


def extra_sets(pairs: list[str]) -> dict[str, str]:
    """`--set KEY=VALUE` options: every row's stage commands get them (e.g. runtime.profile_steps=2,
    runtime.gradient_checkpointing=auto)."""
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise SystemExit(f"--set takes KEY=VALUE, got {bad}")
    return dict(p.split("=", 1) for p in pairs)


def _items_per_s(manifest: dict[str, Any]) -> float | None:
    n, s = manifest.get("encoded_this_run"), manifest.get("seconds")
    return n / s if isinstance(n, int) and n and s else None


class MemoryRunner(Runner):
    def row_sets(self, budget: str) -> dict[str, Any]:
        return {"gpu.vram_budget_gb": budget, "captions.text_encoder_precision": "auto",
                "train.batch_size": 1, "runtime.checkpoint_every": 0, **extra_sets(self.args.set)}

    def planned(self, fam: str, model: Path, budget: str) -> dict[str, Any]:
        """stage -> settings the planner picks for a numeric budget (meta device, no CUDA); {} for auto."""
        if budget == "auto" or self.args.tiny:
            return {}
        return {p["stage"]: p["settings"] for p in self.stage_plans(fam, model, budget, self.args.res)}

    def row_config(self, fam: str, model: Path, budget: str, res: int) -> Any:
        """The config a row's stages run with (the preset and the row's overrides), for planning."""
        return self.config(fam, model, res, self.row_sets(budget))

    def stage_plans(self, fam: str, model: Path, budget: str, res: int) -> list[dict[str, Any]]:
        """Each GPU stage's plan (`pipeline.py plan --json`'s "stages") for a row at a numeric budget,
        from configs on the meta device: nothing touches CUDA."""
        from stages.plan import plans

        return plans(self.row_config(fam, model, budget, res), float(budget))["stages"]

    def measure(self, fam: str, model: Path, budget: str, kind: str, stage: str) -> dict[str, Any]:
        res = self.args.res
        base = _base_run(fam, res)
        run = base if kind != "train" else f"{base}-train-{budget}"
        run_dir = self.work / "artifacts" / run
        if kind == "train":  # a fresh run per budget, on the captions and latents measured last
            for store in ("captions.zarr", "latents.zarr"):
                shutil.rmtree(run_dir / store, ignore_errors=True)
                shutil.copytree(self.work / "artifacts" / base / store, run_dir / store)
        item = Item(f"{fam}/{kind}/{budget}", kind, res, self.row_sets(budget), run=run)
        cmd = self.stage_cmd(fam, item, stage, model, ["--force"] if kind != "train" else [])
        t0 = time.time()
        with SmiPeak() as smi:  # the process as a neighbour sees it: nvidia-smi's memory.used over the call
            rc, wall, tail = self.call(cmd, {}, f"mem-{fam}-{kind}-{budget}")
        row: dict[str, Any] = {"family": fam, "resolution": res, "budget": budget, "stage": stage, "cmd": " ".join(cmd[1:]).replace(str(ROOT) + "/", ""),
                               "rc": rc, "wall_s": wall}
        if smi.peak_gb is not None:
            row["smi_peak_gb"] = smi.peak_gb
        note = self.finished_note(fam, item, run_dir, rc, t0)  # killed while exiting, after its last step
        if note:
            row["note"] = note
        elif rc != 0:  # the plan it ran and the warnings before it failed (a failed capture, say), where logged
            return {**row, "status": "failed", "plan": _plan_event(run_dir, stage, t0), "log_tail": tail[-1500:],
                    "warnings": [e.get("message") for e in events_since(run_dir, t0) if e["event"] == "warning"]}
        summary = collect(run_dir, kind, t0)
        manifest = json.loads(stage_manifest(run_dir, kind).read_text())
        return {**row, "status": "ok", "plan": _plan_event(run_dir, stage, t0), "peak_vram_gb": summary.get("peak_vram_gb"),
                "samples_per_second": summary.get("samples_per_second") or _items_per_s(manifest), "seconds": summary.get("seconds"),
                "items": manifest.get("encoded_this_run"), "loaded_s": summary.get("loaded_s"),
                "warnings": summary.get("warnings"), "steps": summary.get("steps"),
                "runtime": summary.get("runtime"),  # train: block swap's copies / prefetch hits, allocator retries
                **({"profile": summary["profile"]} if "profile" in summary else {})}  # --set runtime.profile_steps=N

    def run_family(self, fam: str) -> None:
        model = self.ensure_model(fam, STAGES[0][0])
        measured: dict[tuple[str, str], dict[str, Any]] = {}  # (stage, settings) -> the row that measured it
        for budget in self.args.budgets.split(","):
            settings = self.planned(fam, model, budget)
            cache_failed = ""  # a cache stage of this budget that failed and left no cache: train has nothing to read
            for kind, stage, store in STAGES:
                if kind == "train" and cache_failed:
                    self.add({"family": fam, "budget": budget, "stage": stage, "status": "skipped",
                              "reason": f"{cache_failed} failed: no cache to train on"})
                    continue
                key = (stage, json.dumps(settings.get(stage), sort_keys=True))
                if stage in settings and key in measured:
                    self.add({"family": fam, "budget": budget, "stage": stage, "status": "same plan",
                              "same_as_budget": measured[key]["budget"], "planned_settings": settings[stage]})
                    continue
                if self.left() < EST_S[kind] * (0.05 if self.args.tiny else 1.0):
                    self.add({"family": fam, "budget": budget, "stage": stage, "status": "skipped",
                              "reason": f"device-time budget: {self.left():.0f}s left"})
                    continue
                self.ensure_model(fam, kind)  # a staged family (FLUX.2 dev): this stage's components
                row = self.measure(fam, model, budget, kind, stage)
                self.add(row)
                if kind != "train" and row["status"] != "ok" and not (
                        self.work / "artifacts" / _base_run(fam, self.args.res) / store).exists():
                    cache_failed = stage
                if row["status"] == "ok" and row["plan"]:
                    measured[(stage, json.dumps(row["plan"]["settings"], sort_keys=True))] = row
        if not self.args.keep:
            shutil.rmtree(model_dir(self.args, fam), ignore_errors=True)

    def add(self, row: dict[str, Any]) -> None:
        row = {"resolution": self.args.res, **row}
        self.results["items"].append(row)
        self.save()
        brief = {k: row.get(k) for k in ("status", "peak_vram_gb", "samples_per_second", "wall_s", "same_as_budget")}
        print(f"[memory] {row['family']} {row['stage']} @{row['budget']}: {json.dumps(brief)[:300]}", flush=True)


def _base_run(fam: str, res: int) -> str:
    """The run whose caches a family's rows at `res` share (each train row copies them into its own run)."""
    return f"mem-{fam}" if res == RESOLUTION else f"mem-{fam}-{res}"


class SmiPeak:
    """The most GPU memory nvidia-smi showed used (memory.used of this process's GPU: the first of
    CUDA_VISIBLE_DEVICES, else GPU 0) while the block ran, less what it showed before: a stage process's whole
    footprint, CUDA context included, where it runs alone on its GPU (a call's stages run one at a time; calls
    side by side, `bench/run.py --gpus`, each have a GPU of their own). Sampled every `every_s`; a caching allocator keeps what it
    reserved until the process exits, so the peak stays up long enough to be read. `peak_gb` is None
    without nvidia-smi (CPU) or where nothing was read."""

    def __init__(self, every_s: float = 0.2) -> None:
        import threading

        self.every_s, self.peak_gb = every_s, None
        self._stop, self._thread = threading.Event(), threading.Thread(target=self._poll, daemon=True)
        self._base: float | None = None
        self._most: float | None = None

    @staticmethod
    def used_gb() -> float | None:
        import subprocess

        try:
            gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", gpu],
                                 capture_output=True, text=True, timeout=10)
            return float(out.stdout.split()[0]) / 1024 if out.returncode == 0 and out.stdout.strip() else None  # MiB
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            used = self.used_gb()
            if used is not None:
                self._most = used if self._most is None else max(self._most, used)

    def __enter__(self) -> "SmiPeak":
        self._base = self.used_gb()
        if self._base is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._base is None:
            return
        self._stop.set()
        self._thread.join()
        if self._most is not None:
            self.peak_gb = round(max(self._most - self._base, 0.0), 3)


def _plan_event(run_dir: Path, stage: str, t0: float) -> dict[str, Any] | None:
    plans = [e for e in events_since(run_dir, t0) if e["event"] == "plan" and e.get("stage") == stage]
    return plans[-1] if plans else None


# ---- report
def _group(r: dict[str, Any]) -> tuple[str, int, str]:
    """A table of the report: (family, resolution, variant); rows written before --res existed were
    1024 px. A call run with `--set` overrides is a variant of the presets' defaults and gets a table
    of its own, so its rows never stand in for the defaults' (a forced `runtime.cuda_graphs = on` row
    is not what "auto" does)."""
    return r["family"], int(r.get("resolution", RESOLUTION)), r.get("variant", "")


def command_sets(command: str) -> list[str]:
    """The `--set KEY=VALUE` overrides of a command line, as "KEY=VALUE" strings (`extra_sets` reads them)."""
    words = command.split()
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--set"] + [w[6:] for w in words if w.startswith("--set=")]


def _variant(command: str) -> str:
    """The `--set KEY=VALUE` overrides of a call's command line, as "key=value, ..." ("" for none)."""
    return ", ".join(sorted(command_sets(command)))


def _newest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (family, budget, stage) over all files: a measurement beats "same plan", which
    beats a skipped or failed row, and among equals the later file wins. A family's failed build
    ("-" row) is dropped once a later call measured the family. Budgets sorted: auto, then by GB."""
    rank = lambda r: 2 if r["status"] == "ok" else 1 if r["status"].startswith("same plan") else 0  # noqa: E731
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        key = (_group(r), r["budget"], r["stage"])
        if key not in best or rank(r) >= rank(best[key]):
            best[key] = r
    measured = {g for g, b, _ in best if b != "-"}
    order = {stage: i for i, (_, stage, _) in enumerate(STAGES)}
    keep = [r for (f, b, _), r in best.items() if b != "-" or f not in measured]
    return sorted(keep, key=lambda r: (list(dict.fromkeys(map(_group, rows))).index(_group(r)),
                                       -1.0 if r["budget"] == "auto" else float(r["budget"]) if r["budget"] != "-" else 1e9,
                                       order.get(r["stage"], 9)))


def _resolved(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One call's rows, "same plan" ones filled in from the row of that call that measured the plan
    (another call may have planned that budget differently: "auto" trained nf4 before it tried bf16)."""
    by = {(_group(r), r["budget"], r["stage"]): r for r in rows}
    out = []
    for r in rows:
        if r["status"] == "same plan":
            src = by.get((_group(r), r["same_as_budget"], r["stage"]))
            if src is None or src["status"] != "ok":
                continue
            r = {**src, "budget": r["budget"], "status": f"same plan as {r['same_as_budget']}", "source": src}
        out.append(r)
    return out


def _earlier(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A "same plan" row whose source is not the row the table shows for that budget says so."""
    shown = {id(r) for r in rows}
    return [{**r, "status": r["status"] + " in an earlier call"} if "source" in r and id(r["source"]) not in shown
            else r for r in rows]


def _cell(r: dict[str, Any]) -> list[str]:
    if not r["status"].startswith(("ok", "same")):
        return [r["status"], "", "", "", ""]
    plan = r.get("plan") or {}
    settings = ", ".join(f"{k}={v}" for k, v in (plan.get("settings") or {}).items() if k != "blocks")
    peaks = r.get("peak_vram_gb") or {}
    peak = peaks.get("total", peaks.get("reserved"))  # a budget counts the context too where the row measured it
    budget = plan.get("budget_gb")
    within = "" if budget is None or peak is None else (" ok" if peak <= budget else f" OVER by {peak - budget:.2f}")
    sps = steady_samples_per_second(r)
    return [settings + ("" if r["status"] == "ok" else f" ({r['status']})"), f"{plan.get('predicted_peak_gb', 0):.2f}",
            f"{peak:.2f}{within}" if peak is not None else "", f"{sps:.3f}" if sps else "", f"{r.get('seconds') or 0:.1f}"]


def steady_samples_per_second(r: dict[str, Any]) -> float | None:
    """A train row's speed from its steady steps: its batch over the median gap between the steps after its
    warm-up (runtime.warmup_steps_excluded), so that a one-time wait does not set it (Qwen-Image's first step of
    a second caption length took 41 s where the others took 0.7, and made 0.11 samples/s of 5 timed steps);
    the stage's own samples/s where the row kept no step times."""
    sets = extra_sets(command_sets(r.get("cmd") or ""))
    warmup = int(sets.get("runtime.warmup_steps_excluded", 0))
    times = [s["ts"] for s in r.get("steps") or [] if s.get("step", 0) >= warmup]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    if r.get("stage") != "train" or len(gaps) < 3:
        return r.get("samples_per_second")
    return int(sets.get("train.batch_size", 1)) / gaps[len(gaps) // 2]


def _train_settings(r: dict[str, Any]) -> dict[str, Any]:
    return (r.get("plan") or {}).get("settings") or r.get("planned_settings") or {}


def _auto_train(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The measured "auto" train row among `rows`: what "x auto" is over."""
    return next((r for r in rows if r["budget"] == "auto" and r["stage"] == "train" and steady_samples_per_second(r)), None)


def _unswapped(r: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """For a measured swap row: the measured train row of the same precision with no block swapped."""
    mine = _train_settings(r)
    if r["stage"] != "train" or not mine.get("swapped_blocks") or not steady_samples_per_second(r):
        return None
    return next((o for o in rows if o["stage"] == "train" and steady_samples_per_second(o)
                 and _train_settings(o).get("base_precision") == mine.get("base_precision")
                 and not _train_settings(o).get("swapped_blocks")), None)


def _stamped(files: list[Path]) -> list[list[dict[str, Any]]]:
    """Each call's rows, oldest call first, each row with the UTC time of the call that measured it. The
    per-row files bench/run.py splits one call into (same meta) are read back as that one call, so a
    "same plan" row finds the row it names."""
    calls: dict[str, list[dict[str, Any]]] = {}
    metas: dict[str, dict[str, Any]] = {}
    for f in files:
        d = json.loads(f.read_text())
        meta = d.get("meta", {})
        call = json.dumps([meta.get("date_utc"), meta.get("command")]) if meta.get("date_utc") else str(f)
        metas[call] = meta
        calls.setdefault(call, []).extend(d["items"])
    order = sorted(calls, key=lambda c: metas[c].get("date_utc", ""))
    # an item kept from an older call of its row (bench/run.py write) says when it was measured
    return [[{**r, "measured_utc": r.get("measured_utc") or metas[c].get("date_utc", ""), "variant": _variant(metas[c].get("command", ""))}
             for r in calls[c]] for c in order]


def _table_rows(stamped: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows the tables show, from `_stamped` (a measurement beats a later call's failure there: see
    the targets)."""
    return _earlier(_newest([r for items in stamped for r in _resolved(items)]))


# The memory targets at 1024 px, batch 1: every stage within the budget, train at >= 0.6x its unconstrained speed
TARGETS_GB = {"qwen-image": 8, "flux": 6, "z-image": 4, "sdxl": 4}
TARGET_SPEED = 0.6


def _graphs(r: dict[str, Any]) -> str:
    """How a train row ran ("train under CUDA graphs, ", "... eager after a failed capture, ", "... eager
    (no room to capture), ", "... eager, "), or "" for a row recorded before the runtime was
    (the oldest rows)."""
    from stages.core.events import graphs_ran

    g = (r.get("runtime") or {}).get("cuda_graphs")
    if not g:
        return ""
    how = {"graphs": "under CUDA graphs", "failed": "eager after a failed capture",
           "released": "under CUDA graphs, then eager (released for a new shape)",
           "no room": "eager (no room to capture)", "eager": "eager"}[graphs_ran(g)]
    return f"train {how}, "


def targets(files: list[Path], names: dict[str, str]) -> list[str]:
    """Rows for RESULTS.md's target table: per family, its three stages' reserved peaks at the target
    budget and its train speed over the "auto" row. A later call that failed at that budget makes the
    target unmet (the code it ran has no passing row), and a budget with a failed stage and no
    measurement shows as unmet too."""
    stamped = _stamped(files)
    rows, every, out = _table_rows(stamped), [r for items in stamped for r in items], []
    for fam, gb in TARGETS_GB.items():
        mine = [r for r in rows if _group(r) == (fam, RESOLUTION, "")]
        at = {r["stage"]: r for r in mine if r["budget"] == str(gb) and r["status"].startswith(("ok", "same"))}
        ref = _auto_train(mine)
        failed = {r["stage"]: r for r in every if _group(r) == (fam, RESOLUTION, "") and r["budget"] == str(gb)
                  and r["status"] == "failed"}
        later = [f"{stage} failed " + ("in a later call" if stage in at else "in the call") + f" at {f['measured_utc'][11:16]} UTC"
                 for stage, f in failed.items() if stage not in at or f["measured_utc"] > at[stage]["measured_utc"]]
        target = f"| {names.get(fam, fam)} {RESOLUTION} px b1: every stage ≤ {gb} GB, train ≥ {TARGET_SPEED}x unconstrained | "
        if len(at) < len(STAGES) or ref is None or not steady_samples_per_second(at["train"]):
            if later:
                out.append(target + "; ".join(later) + ", no passing row | no |")
            continue
        peaks = [(at[stage].get("peak_vram_gb") or {}).get("reserved") for _, stage, _ in STAGES]
        mine, theirs = steady_samples_per_second(at["train"]), steady_samples_per_second(ref)
        speed = mine / theirs
        ok = all(p is not None and p <= gb for p in peaks) and speed >= TARGET_SPEED and not later
        out.append(target + f"encode / latents / train {' / '.join(f'{p:.2f}' for p in peaks)} GB reserved; train {speed:.2f}x "
                   f"({mine:.3f} / {theirs:.3f} samples/s over the steady steps, auto's base "
                   f"{_train_settings(ref).get('base_precision')}; {_graphs(at['train'])}measured "
                   f"{at['train']['measured_utc'][:16]} UTC){''.join('; ' + x for x in later)} | {'yes' if ok else 'no'} |")
    return out


def report(files: list[Path]) -> str:
    """One table per (family, px, variant: a call's `--set` overrides). Files are read oldest
    measurement first (their meta.date_utc), so a newer call's row replaces an older one whatever the
    files are named. A variant's ratios fall back to the defaults' rows where it has none of its own."""
    rows = _table_rows(_stamped(files))
    lines = []
    for fam, res, variant in dict.fromkeys(map(_group, rows)):
        mine = [r for r in rows if _group(r) == (fam, res, variant)]
        defaults = [r for r in rows if _group(r) == (fam, res, "")]
        # a variant without an "auto" (or unswapped) row of its own is compared with the defaults'
        ref = _auto_train(mine) or _auto_train(defaults)
        lines += [f"### {fam}, {res} px, batch 1" + (f", with {variant}" if variant else ""), "",
                  "| budget GB | stage | plan | predicted GB | measured peak GB (reserved, + CUDA context where measured) | "
                  "samples/s | x auto | "
                  "x unswapped | stage s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            cells = _cell(r)
            ratio = swap = ""
            if r["stage"] == "train" and ref and steady_samples_per_second(r):
                ratio = f"{steady_samples_per_second(r) / steady_samples_per_second(ref):.2f}"
            whole = _unswapped(r, mine) or _unswapped(r, defaults)
            if whole is not None:  # block swap's own cost: the same precision without swapping, same px
                swap = f"{steady_samples_per_second(r) / steady_samples_per_second(whole):.2f}"
            lines.append(f"| {r['budget']} | {r['stage']} | " + " | ".join(cells[:4] + [ratio, swap, cells[4]]) + " |")
        lines.append("")
    return "\n".join(lines)


def plan_table(families: str, budgets: str, res: str, work: str, sets: Sequence[str] = (), stage: str = "train") -> str:
    """The stage's plan (train unless `stage` says) per family, px and budget (comma lists), from full-size configs on the meta
    device (no weights, no GPU: bench/plan_cost.py's config-only folders under `work`), with the rows'
    settings (and `sets`, "KEY=VALUE" as `run --set` takes them): what `run` would train, and its CUDA
    graph room under swap."""
    from bench.plan_cost import config_only_model

    runner = MemoryRunner(run_args(parser, work=work, set=list(sets)))
    lines = [f"| family | px | budget GB | {stage} plan | predicted GB | note |", "|---|---|---|---|---|---|"]
    for fam in families.split(","):
        folder = Path(work) / "config-only" / fam
        shutil.rmtree(folder, ignore_errors=True)  # made afresh: a folder cut off, or older configs, would be reused
        model = config_only_model(fam, folder)
        for px in map(int, str(res).split(",")):
            for budget in budgets.split(","):
                train = next(p for p in runner.stage_plans(fam, model, budget, px) if p["stage"] == stage)
                settings = ", ".join(f"{k}={v}" for k, v in train["settings"].items() if k not in ("blocks", "host_gb"))
                note = train["note"]
                lines.append(f"| {fam} | {px} | {budget} | {settings} | {train['predicted_peak_gb']:.2f} | {note} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--families", default="flux,qwen-image")
    r.add_argument("--budgets", default=",".join(BUDGETS))
    r.add_argument("--res", type=int, default=RESOLUTION, help="image side in px (rows of another size: 512)")
    r.add_argument("--work", default="/tmp/lorapipe-memory")
    r.add_argument("--models", default="")
    r.add_argument("--budget-s", type=float, default=1e9)
    r.add_argument("--tiny", action="store_true")
    r.add_argument("--keep", action="store_true")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every row's stages (repeatable), e.g. runtime.profile_steps=2")
    r.add_argument("--captions", choices=("equal", "varied"), default="equal",
                   help="varied: 24 images whose captions each have their own length (equal: 8 of about one length)")
    r.set_defaults(skip_done=[], only=[])  # what bench.py's Runner reads: every row runs
    p = sub.add_parser("report")
    p.add_argument("files", nargs="+")
    t = sub.add_parser("plan", help="the train plans `run` would measure, from full-size configs (CPU, no weights)")
    t.add_argument("--families", default="qwen-image,flux,z-image,sdxl")
    t.add_argument("--budgets", default="8,6,4")
    t.add_argument("--res", default=f"512,{RESOLUTION}", help="comma-separated px")
    t.add_argument("--work", default="/tmp/lorapipe-memory-plan")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every row (repeatable), e.g. runtime.gradient_checkpointing=auto")
    t.add_argument("--stage", default="train", choices=("encode-captions", "cache-latents", "train", "sample"))
    t.add_argument("--fp8-gpu", action="store_true", help="plan as on a GPU with fp8 tensor cores (the H200), where "
                   "train.base_precision = 'auto' tries fp8 after bf16")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.cmd == "report":
        print(report([Path(f) for f in args.files]))
        return
    if args.cmd == "plan":
        from contextlib import ExitStack
        from unittest import mock

        from stages.core import fp8, memory

        with ExitStack() as stack:  # plan as on the GPU machine, not with this host's memory and GPU
            stack.enter_context(mock.patch.object(memory.budget, "host_available_bytes", lambda: None))
            if args.fp8_gpu:
                stack.enter_context(mock.patch.object(fp8, "fp8_supported", lambda: True))
            print(plan_table(args.families, args.budgets, args.res, args.work, args.set, args.stage))
        return
    runner = MemoryRunner(args)
    for fam in args.families.split(","):
        try:
            runner.run_family(fam)
        except Exception as e:  # noqa: BLE001 - one family failing must not lose the others' rows
            runner.add({"family": fam, "budget": "-", "stage": "-", "status": "failed", "reason": f"{type(e).__name__}: {e}"})
    runner.save()


if __name__ == "__main__":
    main()
