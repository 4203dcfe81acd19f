"""bench results JSON -> bench/RESULTS.md (used by `python bench/bench.py report ... --write`).

Every number in the tables comes from a result file; bench/analysis.md (hand-written reading of
the profile) is appended as it is. MFU: useful FLOPs / step time / 790e12 (the bf16 matmul rate
measured on this H200), useful = 2 x forward (forward + input gradients; frozen weights get no
gradient, activation recompute is not useful) computed two ways: the 4·P·T rule
(4 x params x tokens + attention), and the Linear FLOPs counted on the meta device + attention.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
from pathlib import Path
from typing import Any

from stages.families import FAMILIES, get_family

PEAK_FLOPS = 790e12
VAE_DOWN = {f: get_family(f).vae_downsample for f in FAMILIES}
NAMES = {f: get_family(f).title or f for f in FAMILIES}
FAMILY_ORDER = tuple(NAMES)  # one headline table each, in this order
MAX_STAGE_PEAK = {"flux": 10.4, "qwen-image": 12.8, "z-image": 4.7}  # GB: the peaks the speed work had to stay under
TARGETS = """| target | measured | met? |
|---|---|---|
{rows}"""


def result_files(root: Path = Path(__file__).with_name("results")) -> list[Path]:
    """Every result file: the suites' per-row files (results/<suite>/<row key>.json) and the files of
    the runs made before the suites (results/*.json, kept as the measured record); results/archive/
    holds superseded ones the report leaves out."""
    return sorted(root.glob("*.json")) + sorted(p for p in root.glob("*/*.json") if p.parent.name != "archive")


def row_key(row: dict[str, Any]) -> str:
    """What a bench row measures: its item id names the family, the stage, and for a train row the base
    precision, px, batch and settings tag ("flux/train/nf4-512-b4-compile"; bench rows run unconstrained,
    with no budget); a rerun of an item ("...#rerun") measures that item."""
    return row["id"].split("#")[0]


def load(files: list[Path]) -> tuple[dict[str, Any], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """(meta of the first call, row key -> its latest measurement, every call's meta, oldest first). Calls
    are read in the order they ran (meta.date_utc), whatever their files are named, so a later ok row of a
    key replaces an earlier one; a failed or cut-off row shows only where the key has no ok row."""
    metas, items = [], {}
    loaded = [(f, json.loads(f.read_text())) for f in files]
    for f, data in sorted(loaded, key=lambda fd: str(fd[1].get("meta", {}).get("date_utc", ""))):
        metas.append({**data["meta"], "file": f.name, "builds": data.get("builds", {})})
        for row in data["items"]:
            rid = row_key(row)
            if row["status"] == "failed" and row.get("rc") == -9:  # killed at the --budget-s deadline
                row = {**row, "status": "cut off (budget)"}
            if row["status"] == "ok" or rid not in items or items[rid]["status"] != "ok":
                items[rid] = {**row, "gpu": data["meta"].get("gpu")}
    planned = _planned()
    if planned:  # an item dropped from the plan since is shown only where it ran
        items = {k: v for k, v in items.items() if v["status"] == "ok" or k in planned}
    return metas[0], items, metas


@functools.cache
def _planned() -> frozenset[str]:
    try:
        from bench.bench import plan
        from stages.families import FAMILIES
    except Exception:  # noqa: BLE001 - a report without the package still lists every row
        return frozenset()
    return frozenset(it.id for fam in FAMILIES for it in plan(fam))


def step_time(row: dict[str, Any], warmup: int = 3) -> float | None:
    """Median time between consecutive steady steps (event timestamps, steps after the warm-up)."""
    steps = row.get("summary", {}).get("steps", [])
    ts = [s["ts"] for s in steps if s["step"] > warmup]
    diffs = [b - a for a, b in zip(ts, ts[1:])]
    return statistics.median(diffs) if diffs else None


def _flops(fam: str, res: int, batch: int, cache: dict) -> dict[str, float] | None:
    key = (fam, res, batch)
    if key not in cache:
        try:
            from bench.full_configs import denoiser_flops

            lat = res // VAE_DOWN[fam]
            cache[key] = denoiser_flops(fam, batch, (lat, lat), 77)
        except Exception:  # noqa: BLE001 - MFU is optional in a report made without diffusers
            cache[key] = None
    return cache[key]


def train_rows(items: dict[str, dict[str, Any]], flops_cache: dict | None) -> list[dict[str, Any]]:
    """Each train item as a table row; with its MFU unless `flops_cache` is None (the FLOPs are counted on the meta
    device, seconds a family)."""
    rows = []
    for rid, row in sorted(items.items()):
        if row["kind"] != "train":
            continue
        fam, _, name = rid.split("/")
        sets, s = row["sets"], row.get("summary", {})
        r = {"id": rid, "family": fam, "name": name, "status": row["status"], "precision": sets["train.base_precision"],
             "res": row["res"], "batch": sets["train.batch_size"], "cmd": row.get("cmd", ""),
             "compile": sets.get("runtime.compile_transformer", "auto"), "ckpt": sets.get("runtime.gradient_checkpointing", True),
             "graphs": row.get("env", {}).get("LORAPIPE_CUDA_GRAPHS", "auto"), "reason": row.get("reason", ""),
             "gpu": row.get("gpu")}
        if row["status"] == "ok":
            st = step_time(row)
            rt = s.get("runtime", {})
            r.update(step_s=st, sps=s.get("samples_per_second"), peak=s.get("peak_vram_gb", {}), compiled=s.get("compiled"),
                     graphs_used=rt.get("cuda_graphs", {}).get("graphs", 0), wall=row.get("wall_s"),
                     swapped=(rt.get("block_swap") or {}).get("swapped_blocks"), blocks=rt.get("blocks"),
                     loss=(s.get("loss_first"), s.get("loss_last")), load_s=(s.get("loaded_s") or [None])[0])
            f = _flops(fam, r["res"], r["batch"], flops_cache) if flops_cache is not None else None
            if f and st:
                r["mfu_rule"] = (4 * f["params"] * f["tokens"] + 3 * f["attention_fwd"]) / st / PEAK_FLOPS
                r["mfu_counted"] = (2 * f["linear_fwd"] + 3 * f["attention_fwd"]) / st / PEAK_FLOPS
        rows.append(r)
    return rows


def _f(x: Any, nd: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _pct(x: Any) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def table_train(rows: list[dict[str, Any]]) -> str:
    head = ("| family | run | base | px | batch | compile | CUDA graphs | step s (median) | samples/s | peak GB alloc / reserved "
            "| MFU (4·P·T rule) | MFU (counted) | model load s | loss first → last |\n|" + "---|" * 14)
    lines = [head]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['family']} | {r['name']} | {r['precision']} | {r['res']} | {r['batch']} | {r['compile']} | "
                         f"{r['graphs']} | **{r['status']}** | | | | | | {r['reason'][:80]} |")
            continue
        peak = r["peak"]
        graphs = f"{r['graphs']} ({r['graphs_used']} captured)"
        lines.append(f"| {r['family']} | {r['name']} | {r['precision']} | {r['res']} | {r['batch']} | "
                     f"{r['compile']}{_compile_note(r)}{'' if r['ckpt'] else ', no ckpt'} | {graphs} | "
                     f"{_f(r['step_s'])} | {_f(r['sps'], 2)} | {_f(peak.get('allocated'), 2)} / {_f(peak.get('reserved'), 2)} | "
                     f"{_pct(r.get('mfu_rule'))} | {_pct(r.get('mfu_counted'))} | {_f(r['load_s'], 1)} | "
                     f"{_f(r['loss'][0], 3)} → {_f(r['loss'][1], 3)} |")
    return "\n".join(lines)


def _predates_nf4_compile(r: dict[str, Any]) -> bool:
    """An nf4 row that `auto` left uncompiled: it ran before `auto` compiled nf4."""
    return r["precision"] == "nf4" and r["compile"] == "auto" and not r["compiled"]


def _compile_note(r: dict[str, Any]) -> str:
    if r["compiled"]:
        return " (compiled)"
    return " (then off over nf4)" if _predates_nf4_compile(r) else ""


def table_stages(items: dict[str, dict[str, Any]]) -> str:
    lines = ["| stage call | status | process wall s | stage seconds (manifest) | model load s | peak GB allocated / reserved |",
             "|---|---|---|---|---|---|"]
    for rid, row in sorted(items.items()):
        if row["kind"] not in ("encode", "latents", "train", "export"):
            continue
        s = row.get("summary", {})
        peak = s.get("peak_vram_gb", {}) or {}
        lines.append(f"| {rid} | {row['status']} | {_f(row.get('wall_s'), 1)} | {_f(s.get('seconds'), 1)} | "
                     f"{_f((s.get('loaded_s') or [None])[0], 1)} | {_f(peak.get('allocated'), 2)} / {_f(peak.get('reserved'), 2)} |")
    return "\n".join(lines)


def _by(rows: list[dict[str, Any]], fam: str, name: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["family"] == fam and r["name"] == name and r["status"] == "ok"), None)


def _default(rows: list[dict[str, Any]], fam: str, name: str) -> dict[str, Any] | None:
    """The row that stands for today's defaults at this shape. `compile_transformer = auto` compiles
    an nf4 base too since the compiled nf4 rows were measured faster on every family; runs made
    before that left nf4 uncompiled, so an nf4 shape's `-compile` row (if it did compile) is the default."""
    if name.startswith("nf4-"):
        c = _by(rows, fam, name + "-compile")
        if c and c["compiled"]:
            return c
    return _by(rows, fam, name)


def comparisons(rows: list[dict[str, Any]]) -> str:
    out = ["| family | comparison | values | ratio |", "|---|---|---|---|"]
    fams = sorted({r["family"] for r in rows})
    for fam in fams:
        for p in ("nf4", "bf16"):
            for res in (512, 1024):
                b1, b4 = _default(rows, fam, f"{p}-{res}-b1"), _default(rows, fam, f"{p}-{res}-b4")
                if b1 and b4 and b1["compiled"] != b4["compiled"]:  # compare like with like
                    b1, b4 = _by(rows, fam, f"{p}-{res}-b1"), _by(rows, fam, f"{p}-{res}-b4")
                if b1 and b4 and b1["sps"] and b4["sps"]:
                    out.append(f"| {fam} | batch-4 gain, {p} {res} px{' (compiled)' if b1['compiled'] else ''} | "
                               f"{b1['sps']:.2f} → {b4['sps']:.2f} samples/s | {b4['sps'] / b1['sps']:.2f}x |")
        for res in (512, 1024):
            for b in (1, 4):
                plain, default = _by(rows, fam, f"nf4-{res}-b{b}"), _default(rows, fam, f"nf4-{res}-b{b}")
                d = _by(rows, fam, f"bf16-{res}-b{b}")
                for n in [plain] + ([default] if default is not plain else []):  # the old uncompiled row beside today's
                    if n and d and n["step_s"] and d["step_s"]:
                        out.append(f"| {fam} | nf4 / bf16 step, {res} px b{b} | {n['name']} {n['step_s']:.3f} s / "
                                   f"{d['name']} {d['step_s']:.3f} s | {n['step_s'] / d['step_s']:.2f}x |")
        for base, other, what in (("bf16-512-b4-nocompile", "bf16-512-b4", "compile off → on (auto), bf16 512 b4"),
                                  ("bf16-1024-b4-nocompile", "bf16-1024-b4", "compile off → on (auto), bf16 1024 b4"),
                                  ("nf4-512-b1", "nf4-512-b1-compile", "compile off → on, nf4 512 b1"),
                                  ("nf4-512-b4", "nf4-512-b4-compile", "compile off → on, nf4 512 b4"),
                                  ("nf4-1024-b4", "nf4-1024-b4-compile", "compile off → on, nf4 1024 b4"),
                                  ("nf4-512-b4-eager", "nf4-512-b4", "CUDA graphs off → on, nf4 512 b4 (train stage)"),
                                  ("bf16-512-b4-eager", "bf16-512-b4", "CUDA graphs off → on, bf16 512 b4 (train stage)"),
                                  ("bf16-1024-b4", "bf16-1024-b4-nockpt", "checkpointing on → off, bf16 1024 b4")):
            a, b = _by(rows, fam, base), _by(rows, fam, other)
            if "compile" in what and a and b and a["compiled"] == b["compiled"]:
                continue  # both sides compiled (or neither): not a compile comparison
            if a and b and a["step_s"] and b["step_s"]:
                out.append(f"| {fam} | {what} | {a['step_s']:.3f} s → {b['step_s']:.3f} s | {a['step_s'] / b['step_s']:.2f}x faster |")
    return "\n".join(out)


def targets(rows: list[dict[str, Any]], items: dict[str, dict[str, Any]]) -> str:
    t = []
    r = _default(rows, "flux", "nf4-512-b4")
    if r:
        peak = r["peak"].get("allocated")
        ok = r["sps"] and r["sps"] >= 6.0 and peak is not None and peak <= 11.4
        t.append(f"| FLUX.1-dev nf4 512 px b4, 77-token captions: ≥ 6.0 samples/s at ≤ 11.4 GB | "
                 f"{_f(r['sps'], 2)} samples/s, {_f(peak, 2)} GB allocated ({_f(r['peak'].get('reserved'), 2)} reserved)"
                 f"{_run(r)} | {'yes' if ok else 'no'} |")
    q = _default(rows, "qwen-image", "nf4-512-b1")
    if q and q["step_s"]:
        t.append(f"| Qwen-Image nf4 512 px b1: ≤ 0.5 s per step | {q['step_s']:.3f} s ({_f(q['peak'].get('allocated'), 2)} GB "
                 f"allocated){_run(q)} | {'yes' if q['step_s'] <= 0.5 else 'no'} |")
    for fam in FAMILY_ORDER:
        for res in (512, 1024):
            for b in (1, 4):
                n, d = _default(rows, fam, f"nf4-{res}-b{b}"), _by(rows, fam, f"bf16-{res}-b{b}")
                if n and d and n["step_s"] and d["step_s"]:
                    ratio = n["step_s"] / d["step_s"]
                    t.append(f"| {NAMES[fam]} nf4 step ≤ 1.3x bf16 step ({res} px b{b}) | {ratio:.2f}x{_run(n)}{_graphs(n, d)} | "
                             f"{'yes' if ratio <= 1.3 else 'no'} |")
    e, d = _by(rows, "flux", "fp8-1024-b4"), _by(rows, "flux", "bf16-1024-b4")
    if e and d and e["step_s"] and d["step_s"]:
        step, peak = e["step_s"] / d["step_s"], e["peak"]["allocated"] / d["peak"]["allocated"]
        t.append(f"| FLUX fp8 1024 px b4: step ≤ 0.8x bf16's, peak ≤ 0.6x bf16's | {step:.2f}x step ({e['step_s']:.3f} s / "
                 f"{d['step_s']:.3f} s), {peak:.2f}x peak ({e['peak']['allocated']:.2f} / {d['peak']['allocated']:.2f} GB) | "
                 f"{'yes' if step <= 0.8 and peak <= 0.6 else 'no'} |")
    for fam in FAMILY_ORDER:  # fp8 targets: Qwen-Image 1024 px b1 fp8 ≤ 0.85x bf16; no fp8 step slower than bf16's
        for res in (512, 1024):
            for b in (1, 4):
                f8, bf = _by(rows, fam, f"fp8-{res}-b{b}"), _by(rows, fam, f"bf16-{res}-b{b}")
                if fam == "flux" and (res, b) == (1024, 4) or not (f8 and bf and f8["step_s"] and bf["step_s"]):
                    continue
                limit = 0.85 if (fam, res, b) == ("qwen-image", 1024, 1) else 1.0
                ratio = f8["step_s"] / bf["step_s"]
                t.append(f"| {NAMES[fam]} fp8 step ≤ {limit:.2f}x bf16 step ({res} px b{b}) | {ratio:.2f}x "
                         f"({f8['step_s']:.3f} s / {bf['step_s']:.3f} s) | {'yes' if ratio <= limit else 'no'} |")
    if d and d.get("mfu_rule") is not None:
        t.append(f"| FLUX bf16 1024 px b4 ≥ 60 % MFU | {_pct(d['mfu_rule'])} (4·P·T rule), {_pct(d['mfu_counted'])} (counted) "
                 f"| {'yes' if d['mfu_rule'] >= 0.6 else 'no'} |")
    nock = _by(rows, "flux", "bf16-1024-b4-nockpt")
    if nock and nock.get("mfu_rule") is not None:
        t.append(f"| (same, gradient checkpointing off) | {_pct(nock['mfu_rule'])} (4·P·T rule), {_pct(nock['mfu_counted'])} "
                 f"(counted), {_f(nock['peak'].get('allocated'), 1)} GB | {'yes' if nock['mfu_rule'] >= 0.6 else 'no'} |")
    for fam, limit in MAX_STAGE_PEAK.items():
        train = _default(rows, fam, "nf4-512-b1")
        stages = [items.get(f"{fam}/{k}") for k in ("encode/nf4", "latents/512", f"train/{train['name'] if train else 'nf4-512-b1'}")]
        if all(s and s["status"] == "ok" for s in stages):
            peaks = [s["summary"]["peak_vram_gb"]["allocated"] for s in stages]
            t.append(f"| {NAMES[fam]} max-over-stages peak at 512 px b1 nf4 (text encoder in nf4) ≤ {limit} GB | "
                     f"{max(peaks):.2f} GB allocated (encode {peaks[0]:.2f}, latents {peaks[1]:.2f}, train {peaks[2]:.2f}) | "
                     f"{'yes' if max(peaks) <= limit else 'no'} |")
    return TARGETS.format(rows="\n".join(t))


def _run(r: dict[str, Any]) -> str:
    """Names the run where it is not the plain one (the compiled nf4 row stands for the default)."""
    if r["name"].endswith("-compile"):
        return f" (run {r['name']}, compiled)"
    return " (nf4 uncompiled: run before `auto` compiled nf4)" if _predates_nf4_compile(r) else ""


def _graphs(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Says when only one side of a ratio replayed CUDA graphs (the other ran eager): not a like-for-like step."""
    used = [bool(r.get("graphs_used")) for r in (a, b)]
    if used[0] == used[1]:
        return ""
    return f" ({a['precision']} under CUDA graphs, {b['precision']} eager)" if used[0] else \
        f" ({a['precision']} eager, {b['precision']} under CUDA graphs)"


def profile_section(items: dict[str, dict[str, Any]]) -> str:
    out = []
    for rid, row in sorted(items.items()):
        if row["kind"] != "profile" or row["status"] != "ok":
            continue
        s = row["summary"]
        out.append(f"### {rid}\n\nCommand: `{row['cmd']}`\n")
        sm = s.get("same_math", {})
        out.append(f"- same math, one batch before any update: loss eager {sm.get('eager_loss')} vs graphed "
                   f"{sm.get('graphed_loss')} (equal: {sm.get('loss_equal')}); LoRA gradients bit-equal: "
                   f"{sm.get('grads_equal')} (max |diff| {sm.get('grad_max_abs_diff')}); eager repeat equal: "
                   f"{sm.get('eager_repeat_equal')}")
        lines = ["| path | median step s | samples/s | peak GB alloc / reserved | profiled wall ms/step | GPU kernel ms/step | "
                 "host op ms/step | kernel launches/step |", "|---|---|---|---|---|---|---|---|"]
        for path in ("eager", "graphs"):
            p = s.get(path)
            if not p:
                continue
            pr = p["profile"]
            lines.append(f"| {path} | {p['median_s']} | {p['samples_per_second']} | {p.get('peak_allocated_gb')} / "
                         f"{p.get('peak_reserved_gb')} | {pr['wall_ms_per_step_profiled']} | {pr['gpu_kernel_ms_per_step']}"
                         f"{'' if 'gpu_ms_by_kernel_kind' in pr else ' (kernels counted twice: see the reading below)'} | "
                         f"{pr['host_op_ms_per_step']} | {pr['launches_per_step']} |")
        out.append("\n".join(lines))
        if s.get("speedup"):
            out.append(f"\nSpeed-up of the step from CUDA graphs: **{s['speedup']}x**.\n")
        for path in ("eager", "graphs"):
            p = s.get(path)
            if not p:
                continue
            pr = p["profile"]
            out.append(f"\n{path}, host time by namespace (ms/step): {pr['host_ms_by_namespace']}\n")
            if pr.get("gpu_ms_by_kernel_kind"):
                out.append(f"{path}, GPU time by kernel kind (ms/step): {pr['gpu_ms_by_kernel_kind']}\n")
            out.append(f"| {path}: top operators by GPU time | calls/step | GPU ms/step | self CPU ms/step |\n|---|---|---|---|")
            out.extend(f"| `{r['name']}` | {r['calls']} | {r['gpu_ms']} | {r['self_cpu_ms']} |" for r in pr["top_gpu"][:10])
            out.append(f"\n| {path}: top operators by host time | calls/step | self CPU ms/step | GPU ms/step |\n|---|---|---|---|")
            out.extend(f"| `{r['name']}` | {r['calls']} | {r['self_cpu_ms']} | {r['gpu_ms']} |" for r in pr["top_host"][:10])
    return "\n".join(out) or "(no profile ran)"


def verify_section(items: dict[str, dict[str, Any]]) -> str:
    out = []
    for rid, row in sorted(items.items()):
        if row["kind"] == "export":
            out.append(f"- `{rid}`: {row['status']}; `{row.get('cmd', '')}`; product verify: "
                       f"{row.get('summary', {}).get('verified', row.get('summary', {}).get('verify', 'see manifest'))}")
        if row["kind"] == "verify":
            s = row.get("summary", {})
            out.append(f"- `{rid}`: {row['status']}; `{row.get('cmd', '')}`\n  - {s.get('pipeline_class')}.from_pretrained "
                       f"(real {s.get('denoiser')} weights, {s.get('device')}) + `load_lora_weights`: "
                       f"{s.get('tensors_in_file')} tensors in the file, {s.get('lora_tensors_loaded')} LoRA tensors in the "
                       f"model; missing {s.get('missing')}, unexpected {s.get('unexpected')}; warnings about keys: "
                       f"{s.get('key_warnings')}; max |loaded − file| = {s.get('max_abs_diff_vs_file')}; **ok: {s.get('ok')}**")
    return "\n".join(out) or "(not run)"


def not_run(items: dict[str, dict[str, Any]]) -> str:
    def why(row: dict[str, Any]) -> str:
        text = row.get("reason") or (row.get("log_tail") or "").strip()[-300:]
        return " ".join(text.split())  # one line per item
    rows = [f"- `{rid}`: {row['status']} — {why(row)}" for rid, row in sorted(items.items()) if row["status"] != "ok"]
    families = {rid.split("/")[0] for rid in items}
    rows += [f"- `{rid}`: not run yet (in the plan, in no result file)" for rid in sorted(_planned() - set(items))
             if rid.split("/")[0] in families]
    return "\n".join(rows) or "(everything in the plan ran)"


def probe_section(probes: list[dict[str, Any]]) -> str:
    """bench/block_probe.py results: measured per precision, and the 57-block projection (labelled)."""
    out = []
    for p in probes:
        blocks = f"{p['double_blocks']} double + {p['single_blocks']} single blocks"
        scale = 19 / p["double_blocks"] if p["double_blocks"] * 2 == p["single_blocks"] else None
        out.append(f"### FLUX.1-dev width, {blocks} ({p['params'] / 1e9:.2f} B parameters), {p['px']} px, batch "
                   f"{p['batch']}, {p['text_tokens']} text tokens — {p['gpu']}, torch {p['torch']}\n\n"
                   f"Command: `python {p['command']}`\n")
        out.append("| base | eager step s | CUDA graphs step s | speed-up | loss eager = graphed | LoRA grads max abs diff "
                   "(eager vs graphed) | eager run twice bit-equal | peak GB allocated (eager) |"
                   + (" projected 57-block step s, eager → graphs (x{:.1f}) | projected samples/s, eager → graphs |".format(scale)
                      if scale else "") + "\n|" + "---|" * (8 + (2 if scale else 0)))
        for prec in ("nf4", "bf16"):
            r = p.get(prec, {})
            if "error" in r or not r:
                out.append(f"| {prec} | failed: {r.get('error', 'not run')} |")
                continue
            sm, e, g = r["same_math"], r["eager"]["median_s"], r["graphs"]["median_s"]
            row = (f"| {prec} | {e:.4f} | {g:.4f} | {e / g:.2f}x | {sm['loss_equal']} ({sm['loss_eager']:.6f}) | "
                   f"{sm['grad_max_abs_diff']:.2g} | {sm['eager_repeat_equal']} | {r['eager']['peak_allocated_gb']} |")
            if scale:
                row += (f" {e * scale:.3f} → {g * scale:.3f} | {p['batch'] / (e * scale):.2f} → {p['batch'] / (g * scale):.2f} |")
            out.append(row)
        n, b = p.get("nf4", {}), p.get("bf16", {})
        if "eager" in n and "eager" in b:
            out.append(f"\nnf4 / bf16 step time at these shapes: eager {n['eager']['median_s'] / b['eager']['median_s']:.2f}x, "
                       f"with CUDA graphs {n['graphs']['median_s'] / b['graphs']['median_s']:.2f}x.\n")
    return "\n".join(out) or "(no probe ran)"


def meta_export_section(checks: list[dict[str, Any]]) -> str:
    rows = ["| family | pipeline | denoiser params (B) | LoRA tensors in file | loaded by the pipeline's loader | ok |",
            "|---|---|---|---|---|---|"]
    rows += [f"| {c['family']} | {c['pipeline_class']} | {c['denoiser_params_b']} | {c['tensors_in_file']} | "
             f"{c['lora_tensors_loaded']} | {c['ok']} |" for c in checks]
    return "\n".join(rows)


APPENDIX = "APPENDIX.md"


def write_report(files: list[Path]) -> dict[str, str]:
    """{"RESULTS.md": targets and one headline table per family, "APPENDIX.md": every table, profile
    and run}; both from the result files alone (plus the hand-written bench/analysis.md)."""
    kinds: dict[str, list[Any]] = {"bench": [], "probe": [], "meta": [], "multigpu": [], "memory": [], "fp8": [],
                                   "peers": [], "dtype": [], "tiling": [], "swap": [], "gpu_probe": [], "other": []}
    for f in files:
        kind = _kind(json.loads(f.read_text()))
        kinds[kind].append(f if kind in ("bench", "multigpu", "memory") else json.loads(f.read_text()))
    from bench.peers import report_section as peers_section

    peers = "\n" + peers_section(kinds["peers"])
    extra = []
    if kinds["multigpu"]:
        from bench.multigpu import report as multigpu_report

        extra.append(multigpu_report(kinds["multigpu"]))
    extra += ["## Probe: full-width FLUX blocks, eager against CUDA graphs\n\n" + probe_section(kinds["probe"]) + "\n"]
    extra += [dtype_section(d) for d in kinds["dtype"]] + [tiling_section(d) for d in kinds["tiling"]]
    extra += [swap_section(d) for d in sorted(kinds["swap"], key=lambda d: d.get("date_utc", ""))]
    extra += [gpu_probe_section(kinds["gpu_probe"])] if kinds["gpu_probe"] else []
    export = ("## Export key layout at full size (CPU, meta device)\n\n`python bench/verify_export.py --meta <family> "
              "--out bench/results/export-meta-<family>.json`\n\n" + meta_export_section(kinds["meta"]) + "\n")
    analysis = Path(__file__).with_name("analysis.md")
    if not kinds["bench"]:
        head = "# Benchmark results\n\nThe full-size benchmark (`bench/bench.py run`) has not run yet.\n"
        return {"RESULTS.md": head + peers + "\n" + export, APPENDIX: "\n".join(extra)}
    meta, items, metas = load(kinds["bench"])
    rows = train_rows(items, {})
    memory_targets: list[str] = []
    for name, files_of_kind in (("memory", kinds["memory"]), ("fp8", kinds["fp8"])):
        written = Path(__file__).with_name(f"{name}.md")  # the hand-written reading of those result files
        if files_of_kind and name == "memory":
            from bench.memory import report as memory_report, targets as memory_targets_of

            export += "\n## Memory budgets\n\n" + MEMORY_INTRO + memory_report(files_of_kind) + "\n"
            memory_targets = memory_targets_of(files_of_kind, NAMES)
        if files_of_kind and written.exists():
            export += "\n" + written.read_text()
    return {"RESULTS.md": _headline_report(rows, items, peers + "\n" + export, memory_targets),
            APPENDIX: _appendix(meta, items, metas, rows, analysis) + "\n" + "\n".join(extra)}


MEMORY_INTRO = """Each stage run as its own process under `gpu.vram_budget_gb` (a number is a cap enforced with
`torch.cuda.set_per_process_memory_fraction`; "auto" is the free memory), full-size random weights,
batch 1, on one H200. Commands: `bash bench/device.sh memory memory-512` (bench/suites.py: one
`python3 bench/memory.py run --families <family> --res <px> --budgets <GB,...>` call per family and px;
`python bench/run.py --list memory` prints them); each file's `meta.command` has the call that wrote it.
A newer call's row replaces an older one. "same plan" rows reuse the measurement of the budget the planner chose
identically for. A call with `--set` overrides (partial checkpointing, graphs forced on) is a variant of the
presets' defaults and has a table of its own ("with ..."); without an "auto" (or unswapped) row of its own,
its "x auto" ("x unswapped") is over the defaults' row. "x auto" is train samples/s over the same family's "auto" row; "x unswapped"
over its measured row of the same precision with no block swapped (block swap's own cost).

"""


def dtype_section(d: dict[str, Any]) -> str:
    """bench/dtype_probe.py: one eager nf4 step per input dtype, and the profile of a checkpointed one."""
    out = [f"## Probe: {d['family']} nf4 step, eager, {d['res']} px b1 ({d.get('device', '?')})\n",
           "`python bench/dtype_probe.py --family " + d["family"] + f" --res {d['res']}`. "
           f"diffusers' `model.dtype` is {d['model.dtype']}; `lora.base_dtype` is {d['base_dtype']}.\n",
           "| inputs cast to | step s (median) | peak GB | loss |", "|---|---|---|---|"]
    out += [f"| {name} | {r['step_s_median']} | {r['peak_gb']} | {r['loss']:.6f} |" for name, r in d["rows"].items()]
    prof = d.get("profile")
    if prof:
        out += ["", f"Two checkpointed `base_dtype` steps profiled: the longest kernels per step "
                    f"({prof.get('ms_per_step', prof.get('cuda_ms_per_step'))} ms of kernels per step).\n",
                "| ms | % | calls | kernel |", "|---|---|---|---|"]
        out += [f"| {r['ms']} | {r['pct']} | {r['calls']} | `{r['name'][:90]}` |" for r in prof["top"][:12]]
    return "\n".join(out) + "\n"


def tiling_section(d: dict[str, Any]) -> str:
    """bench/tiling.py: what the tiled encode (cache-latents' last resort) changes in the posterior."""
    out = [f"## Tiled VAE encode against untiled ({d.get('device', '?')}, {d.get('weights', '')})\n",
           f"`python bench/tiling.py --out tiling.json` ({d.get('seconds')} s). One synthetic image ({d.get('image')}), "
           f"{d.get('precision')}, each through the product's `family.encode_posterior` after `memory.apply_vae_plan`. "
           "Error = relative RMS of the posterior mean against the untiled fp32 one.\n",
           "| VAE (families) | px | tiles | tiled: mean rel. RMS | tiled: logvar RMS | bf16: mean rel. RMS | "
           "peak GB untiled / tiled / bf16 | planner tiles it |", "|---|---|---|---|---|---|---|---|"]
    for v in d["vaes"]:
        for px, s in v.get("sizes", {}).items():
            if "tiled_vs_untiled" not in s:
                continue
            t, b = s["tiled_vs_untiled"], s["bf16_vs_fp32_untiled"]
            out.append(f"| {v['vae_class']} ({', '.join(v['families'])}) | {px} | {s.get('encoder_calls_tiled')} | "
                       f"{t['mean_rel_rms']:.3f} | {t['logvar_rms']:.3f} | {b['mean_rel_rms']:.3f} | "
                       f"{s['peak_gb_untiled']:.2f} / {s['peak_gb_tiled']:.2f} / {s['peak_gb_bf16']:.2f} | "
                       f"{'yes' if v.get('planner_tiles_this_class') else 'no'} |")
    return "\n".join(out) + "\n"


SWAP_CONFIGS = {"resident_graphs": "resident, compiled, CUDA graphs", "resident_compiled": "resident, compiled",
                "resident_eager": "resident, eager", "swap_graphs": "swapped, compiled, CUDA graphs",
                "swap_compiled": "swapped, compiled", "swap_eager": "swapped, eager"}


def swap_section(d: dict[str, Any]) -> str:
    """bench/swap_probe.py: a block-swapped step against the unswapped one, on full-width blocks."""
    slots = any("slot_gb" in (d.get(k) or {}).get("swap", {}) for k in SWAP_CONFIGS)
    how = "two reused device slots" if slots else "copies allocated per call (the swap before the slots)"
    out = [f"## Block swap on full-width Qwen-Image blocks: {how} ({d.get('date_utc', '')})\n",
           f"`python3 {d.get('command', 'bench/swap_probe.py')}` ({d.get('gpu')}, torch {d.get('torch')}): "
           f"{d.get('blocks')} blocks, {d.get('swapped')} swapped, {d.get('precision')}, {d.get('px')} px, batch 1, "
           f"{d.get('text_tokens')} text tokens, LoRA r16, checkpointing, fused AdamW; median of timed steps. Copies are "
           "counted on the host (a graph replay copies without counting).\n",
           "| configuration | step s | vs resident, same launch mode | peak GB | H2D GB/s (one block) | copies / prefetched |",
           "|---|---|---|---|---|---|"]
    base = {"graphs": d.get("resident_graphs", {}).get("median_s"), "compiled": d.get("resident_compiled", {}).get("median_s"),
            "eager": d.get("resident_eager", {}).get("median_s")}
    for key, label in SWAP_CONFIGS.items():
        r = d.get(key)
        if not r or "median_s" not in r:
            continue
        ref = base[key.split("_")[1]]
        swap, copy = r.get("swap", {}), r.get("copy", {})
        out.append(f"| {label} | {r['median_s']:.4f} | {r['median_s'] / ref:.2f}x | {r.get('peak_allocated_gb')} | "
                   f"{copy.get('gb_s', '')} | {swap.get('copies', '')} / {swap.get('prefetch_hits', '')} |")
    return "\n".join(out) + "\n"


def gpu_probe_section(probes: list[dict[str, Any]]) -> str:
    """bench/sdpa_probe.py and bench/cudnn_flux_probe.py (where cuDNN attention dies, what it saves) and
    bench/fp8_tiny_probe.py (narrow fp8 shapes): one row per case."""
    out = ["## Probes: cuDNN attention and narrow fp8 shapes\n"]
    for d in probes:
        if "shapes" in d:
            bad = [r for r in d["shapes"] if not (r["y_finite"] and r["dx_finite"]) or max(r["y_rel"], r["dx_rel"]) > 0.1]
            out.append(f"`python3 bench/fp8_tiny_probe.py`: {len(d['shapes'])} (rows, in, out) shapes of the fp8 Linear, "
                       f"{len(bad)} with a non-finite or >10 % off output or input gradient; the tiny FLUX LoRA step: "
                       + "; ".join(d.get("model", [])) + "\n")
            if d.get("attention_modes"):  # tests/core/test_fp8.py's step under each attention setting
                out.append("| attention (`_lora_step(model, attention)`) | base | steps with every LoRA gradient finite |\n|---|---|---|")
                out += [f"| {m['attention']} | {m['base']} | {m['finite']} of {m['of']} |" for m in d["attention_modes"]]
                out.append("")
            continue
        when = f" ({d['date']})" if d.get("date") else ""
        out.append(f"`python3 bench/{d['probe']}`{when}:\n\n| case | backend | ok | ms / s | TFLOP/s | error | "
                   f"to_q gradients against flash's (blocks finite, min cosine, max relative error) |\n|---|---|---|---|---|---|---|")
        for r in d["rows"]:
            err = r.get("err", "")
            err = (err[0] if isinstance(err, list) and err else str(err))[:120]
            grads = r.get("grads_vs_flash") or []
            vs = (f"{sum(g['finite'] for g in grads)}/{len(grads)}, {min(g['cos'] for g in grads)}, "
                  f"{max(g['rel'] for g in grads)}") if grads else ""
            out.append(f"| {r['case']} | {r.get('backend', 'cuDNN' + (', launch blocking' if r.get('launch_blocking') == '1' else ''))} | "
                       f"{r['ok']} | {r.get('ms', r.get('s', ''))} | {r.get('tflops', '')} | {err} | {vs} |")
        out.append("")
    return "\n".join(out) + "\n"


def _kind(data: Any) -> str:
    """Which benchmark wrote a result file (each has its own layout); "other" for a layout no section reads
    (a test run's record, bench/comfyui_files.py's key listing)."""
    if not isinstance(data, dict):
        return "other"
    items = data.get("items", [])
    if data.get("probe") in ("sdpa_probe.py", "cudnn_flux_probe.py") or {"shapes", "model"} <= data.keys():
        return "gpu_probe"
    if "double_blocks" in data:
        return "probe"
    if "swapped" in data and "blocks" in data:
        return "swap"
    if "checked_with" in data:
        return "meta"
    if {"micro", "fidelity", "torchao", "loads"} & data.keys():  # bench/fp8*.py: read in bench/fp8.md
        return "fp8"
    if "base_dtype" in data:
        return "dtype"
    if "vaes" in data:
        return "tiling"
    if data.get("rows") and "side" in data["rows"][0]:
        return "peers"
    if items and "budget" in items[0]:
        return "memory"
    if any(r.get("id") == "caches-2gpu" for r in items):
        return "multigpu"
    return "bench" if "meta" in data and "items" in data else "other"


INTRO = ("Full-size random-weight architectures on one H200, measured by `bench/bench.py` (the product's own "
         "stage commands as child processes). Real architectures (bench/full_configs.py), synthetic images with "
         "77-token captions, LoRA r16 on the family's default attention targets, fp32 LoRA weights, fused AdamW, "
         "gradient checkpointing on unless said, 8 steps of which the first 3 are excluded from samples/s. MFU is counted against bf16's 790 "
         "TFLOP/s in every row, fp8's included (their block matmuls run at fp8's higher rate: an fp8 row can pass 100 %). "
         "Written by `python bench/bench.py report --write bench/RESULTS.md` (every file of bench/results), which also "
         f"writes [{APPENDIX}]({APPENDIX}): every run's command, the full train and stage tables, comparisons, "
         "profiles and what did not run.\n")


def _headline_report(rows: list[dict[str, Any]], items: dict[str, dict[str, Any]], export: str,
                     memory_targets: list[str]) -> str:
    target_rows = "\n".join([targets(rows, items), *memory_targets])  # the memory budgets' rows: bench/memory.py
    sections = ["# Benchmark: full-size random-weight architectures on the H200\n", INTRO,
                "## Targets\n\n" + target_rows + "\n"]
    for fam in FAMILY_ORDER:
        table = headline_table(rows, items, fam)
        if table:
            sections.append(f"## {NAMES[fam]}\n\n{table}\n")
    sections += ["## Exported LoRA loads into the real pipeline\n\n" + verify_table(items) + "\n", export]
    return "\n".join(sections)


def verify_table(items: dict[str, dict[str, Any]]) -> str:
    """Each family's nf4-trained export, loaded by its pipeline on the GPU (commands in the appendix)."""
    rows = ["| run | pipeline | LoRA tensors in file / loaded | missing / unexpected keys | max abs(loaded − file) | ok |",
            "|---|---|---|---|---|---|"]
    for rid, row in sorted(items.items()):
        s = row.get("summary", {})
        if row["kind"] == "verify" and row["status"] == "ok":
            rows.append(f"| {rid} | {s.get('pipeline_class')} | {s.get('tensors_in_file')} / {s.get('lora_tensors_loaded')} | "
                        f"{len(s.get('missing') or [])} / {len(s.get('unexpected') or [])} | {s.get('max_abs_diff_vs_file')} | "
                        f"{s.get('ok')} |")
    return "\n".join(rows) if len(rows) > 2 else "(not run)"


def headline_rows(rows: list[dict[str, Any]], fam: str) -> list[dict[str, Any]]:
    """The row standing for today's defaults at each measured shape (compiled nf4 where it ran), nf4 then fp8 then
    bf16, 512 then 1024 px, batch 1 then 4."""
    found = (_default(rows, fam, f"{p}-{res}-b{b}") for p in ("nf4", "fp8", "bf16") for res in (512, 1024) for b in (1, 4))
    return [r for r in found if r and r["step_s"]]


def cache_peaks(items: dict[str, dict[str, Any]], fam: str) -> list[tuple[str, float]]:
    """(stage/run, GB allocated) of the family's cache stages' latest rows."""
    return [(k.split("/", 1)[1], v["summary"]["peak_vram_gb"]["allocated"]) for k, v in sorted(items.items())
            if k.startswith(fam + "/") and v["kind"] in ("encode", "latents") and v["status"] == "ok"
            and (v.get("summary", {}).get("peak_vram_gb") or {}).get("allocated") is not None]


def ran_eager(r: dict[str, Any]) -> bool:
    """A row measured without today's defaults' speed-ups: an nf4 base left uncompiled, or no CUDA graph captured."""
    return _predates_nf4_compile(r) or not r.get("graphs_used")


def swapped_note(r: dict[str, Any]) -> str:
    """", 46 of 60 blocks swapped" where the row's plan swapped blocks to host memory (its peak is then the
    resident blocks' and two slots', not the whole base's), else ""."""
    return f", {r['swapped']} of {r.get('blocks')} blocks swapped" if r.get("swapped") else ""


def gpu_note(r: dict[str, Any]) -> str:
    """" (H100)" where the row ran on a GPU other than the H200 the tables are for, else ""."""
    gpu = r.get("gpu") or ""
    return "" if not gpu or "H200" in gpu else f" ({'H100' if 'H100' in gpu else gpu})"


DOCS_TRAIN_HEAD = "| base | px | batch | step s | samples/s | train peak GB (allocated) | run |"


def docs_train_table(rows: list[dict[str, Any]], items: dict[str, dict[str, Any]], fam: str) -> list[str]:
    """docs/performance.md's table of a family (`headline_rows`, † on rows measured eager, the blocks a row's plan
    swapped beside its peak, the GPU beside a run not measured on the H200) and its cache stages' line."""
    lines = [DOCS_TRAIN_HEAD, "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['precision']} | {r['res']} | {r['batch']} | {r['step_s']:.3f}{' †' if ran_eager(r) else ''} | "
              f"{_f(r['sps'], 2)} | {_f(r['peak'].get('allocated'), 2)}{swapped_note(r)} | `{r['name']}`{gpu_note(r)} |"
              for r in headline_rows(rows, fam)]
    stages = cache_peaks(items, fam)
    return lines + (["", "Cache stages, peak GB allocated: " + ", ".join(f"{k} {v:.2f}" for k, v in stages) + "."]
                    if stages else [])


SUITE_LINE = re.compile(r"^`bash bench/device\.sh ([\w.-]+)` \(one row: ")


def sync_performance_doc(text: str, files: list[Path]) -> str:
    """docs/performance.md with each family's train table (the table after its "`bash bench/device.sh <family>`
    (one row: ..." line) and the "Cache stages, ..." line after it rebuilt from the latest results
    (`docs_train_table`); everything else as it was."""
    bench = [f for f in files if _kind(json.loads(f.read_text())) == "bench"]
    _, items, _ = load(bench)
    rows = train_rows(items, None)
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        out.append(lines[i])
        m = SUITE_LINE.match(lines[i])
        i += 1
        if not m or i >= len(lines) or lines[i] != "" or not lines[i + 1].startswith("|"):
            continue
        end = i + 1
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        if end + 1 < len(lines) and lines[end] == "" and lines[end + 1].startswith("Cache stages, "):
            end += 2
        out += [""] + docs_train_table(rows, items, m.group(1))
        i = end
    return "\n".join(out)


def headline_table(rows: list[dict[str, Any]], items: dict[str, dict[str, Any]], fam: str) -> str:
    """Today's defaults per shape (compiled nf4 where it ran) and bf16 beside them, then each stage's peak."""
    lines = [f"| {r['precision']} | {r['res']} | {r['batch']} | {r['step_s']:.3f} | {_f(r['sps'], 2)} | "
             f"{_f(r['peak'].get('allocated'), 2)} | {_pct(r.get('mfu_rule'))} | {r['name']} |" for r in headline_rows(rows, fam)]
    if not lines:
        return ""
    head = ["| base | px | batch | step s | samples/s | train peak GB (allocated) | MFU (4·P·T rule) | run |",
            "|---|---|---|---|---|---|---|---|"]
    stages = cache_peaks(items, fam)
    tail = ("\n\nCache stages' peaks (GB allocated): " + ", ".join(f"{k} {v:.2f}" for k, v in stages) + ".") if stages else ""
    notes = [f"- {k}: {v['note']}" for k, v in sorted(items.items()) if k.startswith(fam + "/") and v.get("note")]
    return "\n".join(head + lines) + tail + ("\n\n" + "\n".join(notes) if notes else "")


def _appendix(meta: dict[str, Any], items: dict[str, dict[str, Any]], metas: list[dict[str, Any]],
              rows: list[dict[str, Any]], analysis: Path) -> str:
    versions = ", ".join(f"{k} {meta.get(k)}" for k in ("python", "torch", "cuda", "diffusers", "transformers", "peft",
                                                         "bitsandbytes", "zarr", "accelerate"))
    calls = "\n".join(f"- `{m['command']}` — {m['date_utc']} UTC, {m.get('gpu', 'CPU')} (driver {(m.get('driver') or '–').splitlines()[0]}), "
                      f"file `{m['file']}`" for m in metas)
    builds = "\n".join(f"- {fam}: built in {b['seconds']} s, {b['bytes'] / 1e9:.1f} GB on disk, parameters (B): "
                       f"{ {k: round(v, 3) for k, v in b['params_b'].items()} }" for m in metas for fam, b in m["builds"].items())
    sections = [
        "# Benchmark appendix: every run, table and profile\n",
        "The headline tables and targets are in [RESULTS.md](RESULTS.md); this file is written beside it from the "
        "same result files.\n",
        f"## Runs\n\nEach family ran on one GPU; the oldest calls ran two families side by side, one "
        "per GPU of a 2 x H200 host (their host-side work shares its 32 CPU cores).\n\n"
        f"{calls}\n\nSoftware: {versions}.\n\n{builds}\n",
        "## Train stage\n\nStep time is the median gap between steady `step` events; samples/s is the stage's own "
        "steady-state figure from its manifest; peak VRAM is torch's max allocated / reserved over the stage (model "
        "load included). MFU = useful FLOPs / step time / 790 TFLOP/s (bf16's rate, for fp8 rows too: their "
        "block matmuls run at fp8's higher rate, so an fp8 row can pass 100 %); useful = forward + input gradients "
        "(2 x forward), the 4·P·T rule (4 x params x tokens + attention) and the counted one (Linear FLOPs from "
        "a meta-device forward + attention) side by side; recompute not counted.\n\n" + table_train(rows) + "\n",
        "Commands (each run with `python pipeline.py ...` from the repo root on the GPU machine):\n\n" +
        "\n".join(f"- {r['id']}: `{r['cmd']}`" for r in rows if r["cmd"]) + "\n",
        "## Comparisons\n\n" + comparisons(rows) + "\n",
        "## Every stage: wall time and peak VRAM\n\n" + table_stages(items) + "\n",
        "## Profile: where an nf4 step's time goes\n\n" + profile_section(items) + "\n",
        "## Exported LoRA loads into the real pipeline: commands\n\n" + verify_section(items) + "\n",
        "## Not run or failed\n\n" + not_run(items) + "\n",
    ]
    if analysis.exists():
        sections.append(analysis.read_text())
    return "\n".join(sections)
