"""diffusers' own LoRA training scripts side by side with the product, on the same model folder and images.

    python bench/peers.py run --family flux2-klein --model /dev/shm/m/flux2-klein --data /tmp/peers-data \
        --res 1024 --batch 1 --steps 20 --out $OUT/peers-klein.json
    python bench/peers.py run --tiny --family flux2-klein --model /tmp/m/klein --data /tmp/d --out /tmp/p.json  # CPU
    python bench/peers.py steps LOG_OR_STEPS_FILE          # what the parser reads from a peer's log

The peers are diffusers' examples/dreambooth scripts, carried as files in the
git-ignored .carry-peers/ (bench/peers.md: which upstream commit, how to fetch). `run` copies the
family's script into --work (applying PATCHES, none needed with diffusers 0.42.1) and runs it as a
child process (plain python, one process, accelerate's Accelerator inside, HF_HUB_OFFLINE=1) with:
- the product's settings where the script has them: resolution, batch, steps, LoRA rank/alpha 16 on the
  product's default target modules (--lora_layers), gradient checkpointing, bf16 mixed precision, the
  same caption length (--max_sequence_length), nf4 base through the script's own
  --bnb_quantization_config_path (FLUX.2 klein; the Kontext script has no quantization option, so it
  trains a bf16 base), --cache_latents (the script's fastest setting: no VAE in the step);
- the same images and captions (and Kontext's control images): an imagefolder (metadata.jsonl plus
  links to the product's files), read through `datasets` or, where that is not installed, through the
  small stand-in in bench/peer_datasets (used only while the script builds its dataset);
- bench/peer_site/sitecustomize.py on PYTHONPATH: after every optimizer step it writes the step's end
  time (after a CUDA synchronize) and that step's own peak CUDA memory (max_memory_allocated, reset at
  each step), so the step time is measured per step, not read from tqdm's smoothed rate (whose last
  value includes the final save). If that file is missing, the tqdm lines of the log are the fallback.

Steady step time = median of the step intervals after --warmup steps; samples/s = batch / that.
Peak = the largest per-step peak after the first step (training only; the script's text encoding
and latent caching before step 1 are reported separately as its process peak).

The product side runs `pipeline.py encode-captions`, `cache-latents` and `train` (bench.bench's Runner)
on the same folder, with its preset plus the same settings, and reports each stage's wall time and
peak, the train stage's steady step time (same median rule, from its step events) and samples/s, and
the wall time of all three stages for the same number of steps. The JSON is rewritten after each
row, so a cut-off run keeps what it measured; a failed child's log tail is recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCRIPTS = ROOT / ".carry-peers"
SITE = ROOT / "bench" / "peer_site"
DATASETS_STANDIN = ROOT / "bench" / "peer_datasets"
PATCHES: list[tuple[str, str]] = []  # (regex, replacement) applied to the run copy; none needed on diffusers 0.42.1


@dataclass(frozen=True)
class Peer:
    script: str
    upstream_commit: str  # huggingface/diffusers commit the carried copy was read at
    nf4: bool  # the script has a bitsandbytes option for the denoiser
    controls: int  # control images per item (edit families)
    extra: tuple[str, ...] = ()


PEERS = {
    "flux2-klein": Peer("train_dreambooth_lora_flux2_klein.py", "027e8eebf33896eecb64c74836258c52593259d5", True, 0,
                        # the pipeline's hidden-state layers (Flux2KleinPipeline in diffusers 0.42.1; the
                        # script's own default, 10 20 30, differs from its pipeline's)
                        ("--text_encoder_out_layers", "9", "18", "27", "--skip_final_inference")),
    "flux-kontext": Peer("train_dreambooth_lora_flux_kontext.py", "01310e78bf9862c563cd6f273560e6264b709ea7", False, 1,
                         ("--guidance_scale", "1.0")),  # configs/flux-kontext.toml's train.guidance_scale
    # its README asks for --disable_training_autocast (bf16 autocast corrupts Ideogram 4's forward); the product
    # never autocasts
    "ideogram4": Peer("train_dreambooth_lora_ideogram4.py", "071190daca865a4d04deac0e02cda5b8c5d6f6fa", True, 0,
                      ("--disable_training_autocast", "--skip_final_inference")),
}


# ---- parsing (unit-tested in tests/bench/test_peers.py) ------------------------------------------------


def read_steps(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The sitecustomize file: its step rows and its exit row (None if the process was cut off)."""
    steps, exit_row = [], None
    if not path.exists():
        return steps, exit_row
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if row.get("event") == "step":
            steps.append(row)
        elif row.get("event") == "exit":
            exit_row = row
    return steps, exit_row


def steady(times: list[float], warmup: int) -> dict[str, Any]:
    """Step durations from step end times: the median of the intervals after `warmup` steps (the
    interval before step k+1 is step k+1's time, so step 1, which has no start, is never counted)."""
    intervals = [b - a for a, b in zip(times, times[1:])]  # intervals[i] = duration of step i + 2
    kept = intervals[max(0, warmup - 1):]
    if not kept:
        return {"step_s": None, "steps_timed": 0}
    return {"step_s": round(statistics.median(kept), 4), "steps_timed": len(kept),
            "step_s_min": round(min(kept), 4), "step_s_max": round(max(kept), 4)}


def peer_summary(steps: list[dict[str, Any]], exit_row: dict[str, Any] | None, batch: int, warmup: int) -> dict[str, Any]:
    out = steady([s["t"] for s in steps], warmup)
    out["steps_done"] = len(steps)
    out["samples_per_s"] = round(batch / out["step_s"], 4) if out["step_s"] else None
    train = [s for s in steps[1:]]  # step 1's interval also holds everything before it (loading, encoding)
    out["peak_gb"] = max((s["peak_alloc_gb"] for s in train), default=None)
    out["peak_reserved_gb"] = max((s["peak_reserved_gb"] for s in train), default=None)
    if exit_row:
        out["process_peak_gb"] = exit_row.get("process_peak_alloc_gb")
        out["process_peak_reserved_gb"] = exit_row.get("process_peak_reserved_gb")
    elif steps:
        out["process_peak_gb"] = max(s["peak_alloc_gb"] for s in steps)
    return out


TQDM = re.compile(r"Steps:\s*\d+%\|[^|]*\|\s*(\d+)/(\d+)\s*\[([\d:]+)<[^,\]]*,\s*([\d.]+|\?)\s*(s/it|it/s)")


def parse_tqdm(text: str) -> list[dict[str, Any]]:
    """tqdm's `Steps:` refreshes in a log (split on carriage returns): step n of total, elapsed seconds
    and the displayed rate in seconds per step (tqdm's smoothed average, not one step's time)."""
    rows = []
    for part in re.split(r"[\r\n]", text):
        m = TQDM.search(part)
        if not m or m.group(4) == "?":
            continue
        n, total, rate, unit = int(m.group(1)), int(m.group(2)), float(m.group(4)), m.group(5)
        secs = sum(int(x) * 60 ** i for i, x in enumerate(reversed(m.group(3).split(":"))))
        rows.append({"n": n, "total": total, "elapsed_s": secs, "s_per_step": rate if unit == "s/it" else 1.0 / rate})
    return rows


def tqdm_step_s(rows: list[dict[str, Any]]) -> float | None:
    """The rate tqdm showed at the last refresh before the final step (the final one includes the save)."""
    before_end = [r for r in rows if r["n"] < r["total"]]
    return round(before_end[-1]["s_per_step"], 4) if before_end else None


def product_summary(train: dict[str, Any], batch: int, warmup: int) -> dict[str, Any]:
    """The train stage's manifest and step events (bench.bench.collect) in the peer's terms."""
    steps = sorted(train.get("steps", []), key=lambda s: s["step"])
    out = steady([s["ts"] for s in steps], warmup)
    out["steps_done"] = len(steps)
    out["samples_per_s"] = round(batch / out["step_s"], 4) if out["step_s"] else None
    out["manifest_samples_per_s"] = train.get("samples_per_second")
    peak = train.get("peak_vram_gb")
    out["peak_gb"] = peak.get("allocated") if isinstance(peak, dict) else peak
    out["peak_reserved_gb"] = peak.get("reserved") if isinstance(peak, dict) else None
    out["compiled"], out["runtime"] = train.get("compiled"), train.get("runtime")
    return out


# ---- data ----------------------------------------------------------------------------------------


def ensure_data(data: Path, n: int, side: int, controls: int) -> list[Path]:
    """The product's folder (make_dataset's layout, controls beside targets); made if it has no images."""
    from bench.bench import make_dataset

    images = sorted(p for p in data.glob("img_*.png") if "_control" not in p.name)
    if not images or (controls and not (data / images[0].name.replace(".png", "_control.png")).exists()):
        make_dataset(data, n=n, side=side, controls=controls)
        images = sorted(p for p in data.glob("img_*.png") if "_control" not in p.name)
    return images


def peer_folder(images: list[Path], folder: Path, controls: int) -> tuple[Path, str]:
    """An imagefolder for the scripts' --dataset_name: links to the same files and a metadata.jsonl with
    the same captions. Returns the folder and the first caption (the scripts' required --instance_prompt)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    lines = []
    for img in images:
        (folder / img.name).symlink_to(img.resolve())
        row = {"file_name": img.name}
        if controls:
            ctrl = img.with_name(img.stem + "_control.png")
            (folder / ctrl.name).symlink_to(ctrl.resolve())
            row["control_image_file_name"] = ctrl.name
        row["text"] = img.with_suffix(".txt").read_text().strip()
        lines.append(json.dumps(row))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder, json.loads(lines[0])["text"]


# ---- the peer ------------------------------------------------------------------------------------


def prepare_script(fam: str, scripts: Path, work: Path) -> Path:
    src = scripts / PEERS[fam].script
    if not src.is_file():
        raise FileNotFoundError(f"{src} is missing: carry diffusers' examples/dreambooth/{PEERS[fam].script} "
                                f"(bench/peers.md says how) in .carry-peers/")
    text = src.read_text()
    for pattern, repl in PATCHES:
        text = re.sub(pattern, repl, text)
    dst = work / f"peer-{PEERS[fam].script}"
    dst.write_text(text)
    return dst


def peer_command(fam: str, script: Path, a: argparse.Namespace, data: Path, prompt: str, out_dir: Path,
                 targets: list[str]) -> list[str]:
    peer = PEERS[fam]
    cmd = [sys.executable, str(script), "--pretrained_model_name_or_path", str(a.model), "--dataset_name", str(data),
           "--image_column", "image", "--caption_column", "text", "--instance_prompt", prompt,
           "--output_dir", str(out_dir), "--resolution", str(a.res), "--train_batch_size", str(a.batch),
           "--max_train_steps", str(a.steps), "--rank", "16", "--lora_alpha", "16", "--lora_layers", ",".join(targets),
           "--gradient_checkpointing", "--mixed_precision", "no" if a.tiny else "bf16", "--learning_rate", "1e-4",
           "--lr_scheduler", "constant", "--lr_warmup_steps", "0", "--weighting_scheme", "logit_normal", "--seed", "0",
           "--center_crop", "--max_sequence_length", str(a.text_tokens), "--checkpointing_steps", "1000000",
           *peer.extra]
    if not a.peer_no_cache_latents:
        cmd.append("--cache_latents")
    if peer.controls:
        cmd += ["--cond_image_column", "control_image"]
    if peer.nf4 and not a.tiny:  # bitsandbytes through diffusers needs CUDA
        qcfg = out_dir.parent / f"peer-{fam}-nf4.json"
        qcfg.write_text(json.dumps({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                    "bnb_4bit_use_double_quant": True}))  # = the product's nf4 (train.nf4_double_quant)
        cmd += ["--bnb_quantization_config_path", str(qcfg)]
    return cmd


def _datasets_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("datasets") is not None


def _imports(module: str, env: dict[str, str]) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True).returncode == 0


def watch(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: float, lora: Path, steps_file: Path,
          steps: int) -> tuple[int, str]:
    """Run a peer to its end, killed at `timeout` s, stopped once its LoRA file is saved after `steps` optimizer
    steps (what follows, a model card or a final-inference reload, is not training). Returns (rc, how it stopped)."""
    t0 = time.time()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        stopped = ""
        while proc.poll() is None:
            time.sleep(1.0)
            if time.time() - t0 > timeout:
                proc.kill()
                stopped = f"killed at the {timeout:.0f}s limit"
                break
            if lora.exists() and len(read_steps(steps_file)[0]) >= steps:
                time.sleep(3.0)
                if proc.poll() is None:
                    proc.terminate()
                    stopped = "stopped after its LoRA was saved (the rest is not training)"
        return proc.wait(), stopped


def run_peer(a: argparse.Namespace, fam: str, data: Path, prompt: str, targets: list[str], left: float) -> dict[str, Any]:
    work = Path(a.work)
    out_dir = work / f"peer-out-{fam}-{a.res}-b{a.batch}"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    steps_file, log = out_dir / "steps.jsonl", work / f"peer-{fam}-{a.res}-b{a.batch}.log"
    script = prepare_script(fam, Path(a.scripts), work)
    cmd = peer_command(fam, script, a, data, prompt, out_dir, targets)
    extra = [p for p in a.peer_pythonpath.split(os.pathsep) if p]
    path = [str(SITE)] + ([] if _datasets_available() else [str(DATASETS_STANDIN)]) + extra
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "LORAPIPE_PEER_STEPS": str(steps_file),
           "PYTHONPATH": os.pathsep.join(path + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    if a.peer_no_cudnn_sdpa:
        env["LORAPIPE_PEER_NO_CUDNN_SDPA"] = "1"
    tv = _imports("torchvision", {**env, "LORAPIPE_PEER_STEPS": ""})
    if not tv:  # e.g. a CUDA torchvision wheel beside a CPU torch: skip its C-op registrations
        env["LORAPIPE_PEER_TV_STANDIN"] = "1"
        if not _imports("torchvision.transforms", {**env, "LORAPIPE_PEER_STEPS": ""}):
            raise RuntimeError("the peer scripts need torchvision (transforms); none imports here"
                               + ("" if extra else ": pass --peer-pythonpath DIR with a torchvision install"))
    row: dict[str, Any] = {"side": "diffusers script", "script": PEERS[fam].script, "upstream_commit": PEERS[fam].upstream_commit,
                           "precision": "fp32" if a.tiny else ("nf4" if PEERS[fam].nf4 else "bf16"),
                           "cmd": " ".join(cmd[1:]).replace(str(ROOT) + "/", ""),
                           "datasets": "installed" if _datasets_available() else "bench/peer_datasets stand-in",
                           "torchvision": "ok" if tv else "C ops skipped (CPU stand-in)",
                           "cudnn_sdpa": "off (as the product's train stage)" if a.peer_no_cudnn_sdpa else "torch's default"}
    lora = out_dir / "pytorch_lora_weights.safetensors"
    t0 = time.time()
    rc, stopped = watch(cmd, work, env, log, max(30.0, min(a.peer_timeout_s, left)), lora, steps_file, a.steps)
    steps, exit_row = read_steps(steps_file)
    row.update(rc=rc, wall_s=round(time.time() - t0, 2), lora_saved=lora.exists(), stopped=stopped)
    row.update(peer_summary(steps, exit_row, a.batch, a.warmup))
    text = log.read_text(errors="replace")
    row["tqdm_step_s"] = tqdm_step_s(parse_tqdm(text))
    if row["step_s"] is None and row["tqdm_step_s"]:  # no per-step file: tqdm's rate, flagged
        row["step_s"], row["step_source"] = row["tqdm_step_s"], "tqdm"
        row["samples_per_s"] = round(a.batch / row["step_s"], 4)
    else:
        row["step_source"] = "optimizer-step hook"
    row["status"] = "ok" if row["steps_done"] >= a.steps and row["step_s"] else "failed"
    if row["status"] != "ok":
        row["log_tail"] = text[-3000:]
    row["log"] = str(log)
    return row


# ---- the product ---------------------------------------------------------------------------------


# "<precision>+<flag>+...": a product train run with the train keys (and environment) each flag sets,
# an A/B row beside the plain one.
VARIANT_FLAGS: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "cudnn": ({}, {"runtime.cudnn_attention": True}),
    "nockpt": ({}, {"runtime.gradient_checkpointing": False}),
    # checkpointed blocks keep their attention outputs (no attention in the recompute)
    "keepattn": ({}, {"runtime.keep_attention": True}),
    "profile": ({}, {"runtime.profile_steps": 2}),
    # eager steps only (no CUDA graph capture, whose private pool the caching allocator cannot hand back)
    "nographs": ({}, {"runtime.cuda_graphs": "off"}),
    # the caching allocator with expandable segments (what the product sets itself under a cap, memory.allocator_for_cap):
    # for uncapped rows
    "expandable": ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, {}),
    # the script's own train peak (allocated GB, from its row in this run) as the train stage's budget (a cap on
    # what the product may reserve, so its allocated peak stays below the script's), with
    # the planner choosing how many blocks to checkpoint within it: the product's answer to "at <= its peak"
    "fitpeer": ({}, {"runtime.gradient_checkpointing": "auto"}),
    # the same with the script's reserved peak as the cap: the cap limits what the product's caching allocator
    # reserves, and the script's allocated peak can be below the product's reserved one at full checkpointing
    # (klein 1024 px: the script 5.09 GB allocated / 5.75 reserved, the product 3.77 / 5.25); the row is then
    # compared allocated to allocated as every row
    "fitreserved": ({}, {"runtime.gradient_checkpointing": "auto"}),
}


def _events_tail(run_dir: Path, t0: float, n: int = 25) -> list[str]:
    """The last `n` events (as JSON lines, cut to 400 characters) that this stage run wrote to the run's
    events.jsonl: where a failed stage got to (its plan, the capture, the step it died in), which the log's last
    lines do not say."""
    from bench.bench import events_since

    return [json.dumps(e)[:400] for e in events_since(run_dir, t0)][-n:]


def variant_flag(flag: str) -> tuple[dict[str, str], dict[str, Any]] | None:
    """A flag's (environment, train keys): VARIANT_FLAGS', or `fp8blocks<N>` (train.fp8_blocks = N: the first N
    blocks of an fp8 base in fp8, the rest nf4); None for an unknown flag."""
    if flag in VARIANT_FLAGS:
        return VARIANT_FLAGS[flag]
    if flag.startswith("fp8blocks") and flag[len("fp8blocks"):].isdigit():
        return {}, {"train.fp8_blocks": int(flag[len("fp8blocks"):])}
    return None


def peer_row_from(path: Path, fam: str, res: int, batch: int) -> dict[str, Any]:
    """The script's finished row from an earlier peers JSON of the same family and shape (--peer-row)."""
    earlier = json.loads(path.read_text())
    shape = (earlier.get("family"), earlier.get("res"), earlier.get("batch"))
    if shape != (fam, res, batch):
        raise SystemExit(f"--peer-row {path}: it holds {shape[0]} at {shape[1]} px batch {shape[2]}, "
                         f"this run is {fam} at {res} px batch {batch}")
    peers = [r for r in earlier.get("rows", []) if r.get("side") != "product" and r.get("status") == "ok"]
    if not peers:
        raise SystemExit(f"--peer-row {path}: no finished row of the script in that file")
    return {**peers[-1], "from_file": str(path)}


def run_product(a: argparse.Namespace, fam: str, data: Path, variant: str, runner: Any, res_sets: dict[str, Any],
                rows: dict[str, Any], peer_peak: dict[str, Any] | None = None,
                kinds: tuple[str, ...] = ("encode", "latents", "train")) -> dict[str, Any]:
    """One product row: encode-captions, cache-latents (each once per run: `rows` keeps their rows for the next
    variant) and train. `kinds` ("encode", "latents"): the caches only (a peer that trains on them runs next)."""
    from bench.bench import KILLED_AFTER_MANIFEST, Item, collect, finished_before_kill

    precision, *flags = variant.split("+")
    parsed = {f: variant_flag(f) for f in flags}
    unknown = [f for f, known in parsed.items() if known is None]
    if unknown:
        raise SystemExit(f"unknown product variant flag(s) {unknown}; known: {', '.join(VARIANT_FLAGS)}, fp8blocks<N>")
    env = {k: v for known in parsed.values() for k, v in known[0].items()}
    run = f"peers-{fam}-{a.res}"
    row: dict[str, Any] = {"side": "product", "precision": "fp32" if a.tiny else variant, "stages": {}}
    total = 0.0
    for kind, stage in (("encode", "encode-captions"), ("latents", "cache-latents"), ("train", "train")):
        if kind not in kinds:
            continue
        sets = dict(res_sets)
        if kind == "train":
            sets.update({"train.base_precision": precision, "train.batch_size": a.batch})
            sets.update({k: v for known in parsed.values() for k, v in known[1].items()})
            fit = [f for f in flags if f in ("fitpeer", "fitreserved")]
            if fit:
                cap = (peer_peak or {}).get("peak_reserved_gb" if fit[0] == "fitreserved" else "peak_gb")
                if not cap:
                    row["status"], row["reason"] = "skipped", f"{fit[0]}: the script's row has no peak in this run"
                    return row
                from stages.core.memory import CUDA_CONTEXT_GB  # a --vram number counts the process's context too:
                row["allocator_gb"] = math.floor(cap * 100) / 100  # the product's allocator gets the script's peak
                sets["gpu.vram_budget_gb"] = row["budget_gb"] = round(row["allocator_gb"] + CUDA_CONTEXT_GB, 2)
        item = Item(f"{fam}/{kind}/{variant}-{a.res}-b{a.batch}", kind, a.res, sets, run=run)
        cached = rows.get(kind)
        if kind != "train" and cached is not None:  # caches do not depend on the base precision
            row["stages"][kind] = cached
            total += cached.get("wall_s") or 0.0
            continue
        # each variant measures a fresh training: --restart sets the previous variant's adapter of this run aside
        cmd = runner.stage_cmd(fam, item, stage, Path(a.model), ["--force"] if kind != "train" else ["--restart"])
        t0 = time.time()
        rc, wall, tail = runner.call(cmd, env if kind == "train" else {}, f"peers-{fam}-{kind}-{variant}")
        total += wall
        info: dict[str, Any] = {"rc": rc, "wall_s": wall, "cmd": " ".join(cmd[1:]).replace(str(ROOT) + "/", "")}
        if rc != 0 and finished_before_kill(Path(res_sets["artifacts"]) / run, kind, t0, a.steps):
            info["note"] = KILLED_AFTER_MANIFEST.format(rc=rc, steps=a.steps)
            rc = 0
        if rc != 0:
            info["log_tail"] = tail
            info["events_tail"] = _events_tail(Path(res_sets["artifacts"]) / run, t0)
            row["stages"][kind] = info
            row["status"] = _status({**row, "status": f"failed at {stage}"})
            return row
        summary = collect(Path(res_sets["artifacts"]) / run, kind, t0)
        peak = summary.get("peak_vram_gb")
        info.update(seconds=summary.get("seconds"), peak_gb=peak.get("allocated") if isinstance(peak, dict) else peak)
        if kind == "train":
            info.update(product_summary(summary, a.batch, a.warmup))
            info["loss_first"], info["loss_last"] = summary.get("loss_first"), summary.get("loss_last")
            if "profile" in summary:  # the `profile` flag (runtime.profile_steps)
                info["profile"] = summary["profile"]
        else:
            rows[kind] = info
        row["stages"][kind] = info
    if "train" not in kinds:
        row["status"] = "ok"
        return row
    train = row["stages"]["train"]
    row.update({k: train.get(k) for k in ("step_s", "samples_per_s", "peak_gb", "peak_reserved_gb", "steps_done",
                                          "manifest_samples_per_s", "compiled")})
    row["wall_s"] = train["wall_s"]
    row["total_wall_s"] = round(total, 2)  # encode + latents + train: the peer does all three in one process
    row["status"] = "ok" if row.get("step_s") else "failed"
    return row


def peer_side(a: argparse.Namespace, add: Callable[[dict[str, Any]], None], side: str,
              run_peer: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """The peer's row: run now (`run_peer`) where --sides has "peer", else the one --peer-row names (a product-only
    probe: the peer's row from an earlier run, which gives fitpeer/fitreserved its peak); added to the results and
    returned (None where the peer failed, named `side` in its row, or neither was asked for)."""
    if "peer" in a.sides.split(","):
        try:
            row = run_peer()
        except Exception as e:  # noqa: BLE001 - the product's rows still count
            add({"side": side, "status": "failed", "reason": f"{type(e).__name__}: {e}"})
            return None
        add(row)
        return row
    if a.peer_row:
        row = peer_row_from(Path(a.peer_row), a.family, a.res, a.batch)
        add(row)
        return row
    return None


def product_rows(precisions: list[str], deadline: float, add: Callable[[dict[str, Any]], None],
                 run_one: Callable[[str], dict[str, Any]]) -> None:
    """The product's train row of each variant in turn (`run_one(variant)`), added as it ends or fails; those the
    budget leaves no time for are added as skipped."""
    for precision in precisions:
        if time.time() > deadline - 20:
            add({"side": "product", "precision": precision, "status": "skipped", "reason": "budget"})
            continue
        try:
            add(run_one(precision))
        except Exception as e:  # noqa: BLE001
            add({"side": "product", "precision": precision, "status": "failed", "reason": f"{type(e).__name__}: {e}"})


def result_file(out: Path, result: dict[str, Any]) -> tuple[Callable[[], None], Callable[[dict[str, Any]], None]]:
    """(save, add) for a side by side's JSON: `save` rewrites `out` atomically; `add` appends a row to
    result["rows"], saves, and prints the row's figures as a `[peers]` line."""
    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(out)

    def add(row: dict[str, Any]) -> None:
        result["rows"].append(row)
        save()
        keys = ("side", "precision", "status", "step_s", "samples_per_s", "peak_gb", "wall_s", "total_wall_s", "stopped")
        print("[peers]", json.dumps({k: row.get(k) for k in keys if k in row}), flush=True)

    return save, add


def run(a: argparse.Namespace) -> None:
    from bench.bench import Runner, family_full, machine_info, run_args
    from stages.families import get_family

    fam = a.family
    if fam not in PEERS:
        raise SystemExit(f"no peer script for {fam!r}; known: {', '.join(PEERS)}")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + a.budget_s
    images = ensure_data(Path(a.data), n=8, side=96 if a.tiny else 1024, controls=PEERS[fam].controls)
    data, prompt = peer_folder(images, work / f"peer-data-{fam}", PEERS[fam].controls)
    targets = list(get_family(fam).default_lora_targets)
    result: dict[str, Any] = {
        "meta": {**machine_info(), "command": " ".join(sys.argv), "tiny": a.tiny},
        "family": fam, "res": a.res, "batch": a.batch, "steps": a.steps, "warmup": a.warmup,
        "text_tokens": a.text_tokens, "lora": {"rank": 16, "alpha": 16, "targets": targets},
        "gradient_checkpointing": True, "images": len(images), "model": str(a.model), "rows": []}

    save, add = result_file(Path(a.out), result)

    save()
    peer_peak = peer_side(a, add, "diffusers script", lambda: run_peer(a, fam, data, prompt, targets, deadline - time.time()))
    if "product" in a.sides.split(","):
        runner = Runner(run_args(work=str(work / "product"), budget_s=max(30.0, deadline - time.time()),
                                 out=str(work / "product" / "runner.json"), tiny=a.tiny, keep=True))
        runner.ensure_data = lambda controls=0, video=False: Path(a.data).resolve()  # the side-by-side data, not the bench's own
        res_sets = {**runner.base_sets(fam, a.res), "data.path": str(Path(a.data).resolve()),
                    "data.resolution": a.res, "captions.max_sequence_length": a.text_tokens,
                    "train.steps": a.steps, "runtime.warmup_steps_excluded": a.warmup, "train.rank": 16, "train.alpha": 16,
                    "runtime.gradient_checkpointing": True, "train.lr_scheduler": "constant"}
        cache_rows: dict[str, Any] = {}
        product_rows([p for p in a.product_precisions.split(",") if p], deadline, add,
                     lambda precision: run_product(a, fam, Path(a.data), precision, runner, res_sets, cache_rows, peer_peak))
    result["text_precision_product"] = family_full(fam).TEXT_PRECISION
    save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the peer script, then the product's stages; one JSON")
    r.add_argument("--family", required=True, choices=sorted(PEERS))
    r.add_argument("--model", required=True, help="a diffusers pipeline folder (bench.py build)")
    r.add_argument("--data", required=True, help="the product's data folder (made with make_dataset if empty)")
    r.add_argument("--out", required=True)
    r.add_argument("--res", type=int, default=1024)
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--steps", type=int, default=20)
    r.add_argument("--warmup", type=int, default=3, help="steps left out of the steady step time (both sides)")
    r.add_argument("--text-tokens", type=int, default=512, help="caption length, both sides (the scripts' default)")
    r.add_argument("--peer-no-cudnn-sdpa", action="store_true",
                   help="turn cuDNN SDPA off in the script's process (the product's train default); the Kontext "
                        "script's backward died in it on torch 2.11 + CUDA 13")
    r.add_argument("--product-precisions", default="nf4", help="base precisions of the product's train runs, e.g. nf4,bf16")
    r.add_argument("--sides", default="peer,product")
    r.add_argument("--peer-row", default="", help="with --sides product: the script's row from an earlier run's JSON "
                   "(shown beside the product's rows and giving fitpeer/fitreserved its peak; not a same-run comparison)")
    r.add_argument("--peer-no-cache-latents", action="store_true", help="let the script encode latents every step")
    r.add_argument("--peer-timeout-s", type=float, default=420.0)
    r.add_argument("--budget-s", type=float, default=560.0, help="no child starts or runs past this many seconds")
    r.add_argument("--work", default="/tmp/lorapipe-peers")
    r.add_argument("--scripts", default=str(SCRIPTS), help="where the carried diffusers scripts are")
    r.add_argument("--peer-pythonpath", default="", help="extra import paths for the script only (e.g. a torchvision "
                   "installed with pip --target where the venv lacks it)")
    r.add_argument("--tiny", action="store_true", help="tiny models on CPU: fp32, no nf4 (plumbing check)")
    s = sub.add_parser("steps", help="print what the parser reads from a peer's steps.jsonl or log")
    s.add_argument("file")
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    if a.cmd == "steps":
        p = Path(a.file)
        if p.suffix == ".jsonl":
            print(json.dumps(peer_summary(*read_steps(p), a.batch, a.warmup), indent=1))
        else:
            rows = parse_tqdm(p.read_text(errors="replace"))
            print(json.dumps({"refreshes": len(rows), "tqdm_step_s": tqdm_step_s(rows)}, indent=1))
        return
    if a.tiny:
        a.res = 64 if a.res == 1024 else a.res
    run(a)


# ---- report (bench/report.py's write_report calls it for every peers-*.json) ----------------------


def _fmt(v: Any, nd: int = 2) -> str:
    return "—" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _status(row: dict[str, Any]) -> str | None:
    """A product row's status, "failed at <stage>" read as "cut off by the budget at <stage>" when that stage's
    process was killed at the run's --budget-s deadline (rc -9), as bench/report.py reads bench rows."""
    status = row.get("status")
    if status and status.startswith("failed at ") and any(s.get("rc") == -9 for s in row.get("stages", {}).values()):
        return "cut off by the budget at " + status.removeprefix("failed at ")
    return status


def report_section(results: list[dict[str, Any]]) -> str:
    """The "Side by side with diffusers' scripts" section: per file, the script's row and each product
    row with samples/s over the script's, peak against the script's, and the target (>= 2x samples/s
    at <= the script's peak) met or not; then the product's cache stages and total wall time."""
    out = ["## Side by side with diffusers' scripts\n",
           "Same model folder, images, captions (and control images), resolution, batch, steps, LoRA rank 16 on the "
           "same modules, gradient checkpointing (`bench/peers.py`). Step s: median step time after the warm-up "
           "steps (the script's from an optimizer-step hook, the product's from its step events). Peak GB: "
           "max_memory_allocated during training steps (the script's own text encoding and latent caching before "
           "its first step are in its process peak). Target: >= 2x the script's samples/s at <= its peak.\n",
           "| family | px | batch | side | base | step s | samples/s | peak GB | x script | target met |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for res in results:
        if res.get("meta", {}).get("tiny"):
            continue
        rows = res.get("rows", [])
        peer = next((r for r in rows if r.get("side") != "product"), None)  # diffusers' script, or musubi-tuner
        px = f"{res['res']}, {res['frames']} frames" if res.get("frames") else res["res"]  # a video side by side
        head = f"| {res['family']} | {px} | {res['batch']} "
        if peer is not None:
            status = "" if peer.get("status") == "ok" else f" ({peer.get('status')})"
            if peer.get("from_file"):  # a product-only probe (--peer-row)
                status += f" (its row of `{Path(peer['from_file']).name}`, an earlier run)"
            who = "diffusers" if peer.get("side") == "diffusers script" else peer.get("side", "?")
            out.append(head + f"| {who} `{peer.get('script', '?')}`{status} | {peer.get('precision', '—')} | "
                              f"{_fmt(peer.get('step_s'), 3)} | {_fmt(peer.get('samples_per_s'))} | "
                              f"{_fmt(peer.get('peak_gb'), 1)} | {'1.00' if peer.get('samples_per_s') else '—'} | |")
        for r in rows:
            if r.get("side") != "product":
                continue
            ratio = met = None
            if r.get("samples_per_s") and peer and peer.get("samples_per_s"):
                ratio = r["samples_per_s"] / peer["samples_per_s"]
                if r.get("peak_gb") is not None and peer.get("peak_gb") is not None:
                    met = "yes" if ratio >= 2.0 and r["peak_gb"] <= peer["peak_gb"] else "no"
                    met += " (across runs)" if peer.get("from_file") else ""
            status = "" if r.get("status") == "ok" else f" ({_status(r)})"
            out.append(head + f"| product{status} | {r.get('precision', '—')} | {_fmt(r.get('step_s'), 3)} | "
                              f"{_fmt(r.get('samples_per_s'))} | {_fmt(r.get('peak_gb'), 1)} | {_fmt(ratio)} | {met or '—'} |")
            st = r.get("stages", {})
            if st:
                parts = [f"{k} {_fmt(st[k].get('wall_s'), 0)} s, peak {_fmt(st[k].get('peak_gb'), 1)} GB"
                         for k in ("encode", "latents", "train") if k in st]
                notes.append(f"- {res['family']} {res['res']} px b{res['batch']} product {r.get('precision')}: "
                             + "; ".join(parts) + f"; all three {_fmt(r.get('total_wall_s'), 0)} s for "
                             f"{res['steps']} steps")
        if peer is not None:
            what = ("loading, text encoding and latent caching included" if peer.get("side") == "diffusers script" else
                    f"loading included; its caches written from the product's in {_fmt(peer.get('caches_s'), 0)} s, "
                    f"the transformer converted in {_fmt(peer.get('convert_s'), 0)} s")
            notes.append(f"- {res['family']} {res['res']} px b{res['batch']} script: {_fmt(peer.get('wall_s'), 0)} s "
                         f"wall for {res['steps']} steps ({what}{', ' + peer['stopped'] if peer.get('stopped') else ''}); "
                         f"process peak {_fmt(peer.get('process_peak_gb'), 1)} GB; upstream commit "
                         f"{str(peer.get('upstream_commit', '?'))[:10]}; data via {peer.get('datasets', '?')}")
        notes.append(f"- command: `{res.get('meta', {}).get('command', '?')}`")
        notes += [f"- note ({res['family']} {res['res']} px b{res['batch']}): {n}" for n in res.get("notes", [])]
    if len(out) == 4:
        return "\n".join(out[:2]) + "\nNo side-by-side run yet (`bench/peers.py run` on the GPU machine).\n"
    return "\n".join(out) + "\n\n" + "\n".join(notes) + "\n"


if __name__ == "__main__":
    main()
