"""1 GPU against 2: FLUX LoRA training throughput and per-GPU peak memory through torchrun.

    python bench/multigpu.py run --out $OUT/multigpu.json            # on the 2-GPU machine
    python bench/multigpu.py run --tiny --out /tmp/multigpu.json     # the same plumbing on CPU (gloo)
    python bench/multigpu.py report /path/multigpu.json              # -> the bench/RESULTS.md section

The pipeline: the full-size FLUX.1-dev transformer, VAE and CLIP-L from bench/full_configs.py
(random bf16 weights, built on the GPU); T5 has T5-XXL's width (4096, what the transformer reads)
but 2 layers instead of 24, since its depth never reaches a training step and building, saving and
loading 9.5 GB of it would cost minutes of a short lease. The caches are built by
`pipeline.py run --gpus 2` (encode-captions and cache-latents as 2 NCCL ranks). Each training
config then runs as `pipeline.py train` (1 GPU) and `torchrun --standalone --nproc-per-node 2
pipeline.py train` (2 GPUs), with the same per-GPU batch: 2 GPUs see twice the samples per step.
samples/s is the trainer's own steady-state figure (first steps excluded), from lora/final.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RES, STEPS, WARMUP, BATCH, TOKENS = 1024, 8, 3, 1, 77
# (precision, GPUs), most important first: a cut-off call keeps the earlier pairs
PLAN = [("bf16", 1), ("bf16", 2), ("nf4", 1), ("nf4", 2)]
# NVLink multicast stays off on the lent machines (it can take the host's GPUs down for others)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def build_pipeline(folder: Path, tiny: bool) -> dict[str, float]:
    """Save the benchmark's FLUX pipeline in folder; returns parameter counts (billions)."""
    import torch

    from stages.tiny.models import build_tiny_components, build_tiny_pipeline

    if tiny:
        build_tiny_pipeline("flux-dev", folder, seed=0)
        return {}
    import diffusers
    from transformers import T5Config, T5EncoderModel

    from bench.full_configs import FULL, T5_XXL, default_dtype

    tiny_parts = build_tiny_components("flux-dev")
    parts = {k: v for k, v in tiny_parts.items() if not isinstance(v, torch.nn.Module)}  # tokenizers, scheduler
    tok = tiny_parts["tokenizer_2"]
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        for name in ("transformer", "vae", "text_encoder"):
            parts[name] = FULL["flux"][name](tiny_parts).eval()
        parts["text_encoder_2"] = T5EncoderModel(T5Config(**{**T5_XXL, "num_layers": 2}, pad_token_id=tok.pad_token_id,
                                                          eos_token_id=tok.eos_token_id,
                                                          decoder_start_token_id=tok.pad_token_id)).eval()
    counts = {k: round(sum(p.numel() for p in v.parameters()) / 1e9, 3) for k, v in parts.items()
              if isinstance(v, torch.nn.Module)}
    diffusers.FluxPipeline(**parts).save_pretrained(str(folder), safe_serialization=True)
    del parts
    torch.cuda.empty_cache()
    return counts


def sets(args: argparse.Namespace, model: Path, run: str, precision: str) -> list[str]:
    values = {"model": model, "run": run, "artifacts": Path(args.work) / "artifacts", "data.path": Path(args.work) / "data",
              "data.resolution": 64 if args.tiny else RES, "data.cache_variants": 1,
              "captions.max_sequence_length": TOKENS, "train.steps": STEPS, "runtime.warmup_steps_excluded": WARMUP,
              "train.batch_size": BATCH, "runtime.checkpoint_every": 0, "train.lr_warmup_steps": 0,
              "train.base_precision": "fp32" if args.tiny else precision, "runtime.log_every": 1}
    if args.tiny:
        values["device"] = "cpu"
    out = ["--config", str(ROOT / "configs" / "flux-dev.toml")]
    for k, v in values.items():
        out += ["--set", f"{k}={v}"]
    return out


def call(cmd: list[str], log: Path) -> tuple[int, float, str]:
    env = {**os.environ, **NCCL_ENV, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "LORAPIPE_PLAIN": "1"}
    t = time.time()
    with log.open("w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    return rc, round(time.time() - t, 1), log.read_text()[-3000:] if rc else ""


def train_cmd(gpus: int, stage_args: list[str]) -> list[str]:
    launch = [sys.executable]
    if gpus > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    return launch + [str(ROOT / "pipeline.py"), "train", *stage_args]


def summarize(final: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [e for e in events if e["event"] == "step"]
    gaps = [b["ts"] - a["ts"] for a, b in zip(steps[WARMUP - 1:], steps[WARMUP:])]
    return {"samples_per_second": final.get("samples_per_second"), "world_size": final.get("world_size"),
            "global_batch_size": final.get("global_batch_size"), "step_s_median": sorted(gaps)[len(gaps) // 2] if gaps else None,
            "peak_vram_gb_per_rank": final.get("peak_vram_gb_per_rank"), "loss_last": final.get("loss_last"),
            "precision_resolved": final.get("precision"), "runtime": final.get("runtime"), "seconds": final.get("seconds")}


def run(args: argparse.Namespace) -> None:
    work, out = Path(args.work), Path(args.out)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.budget_s
    argv = sys.argv[1:]  # the command, less `--out PATH` (a path on the machine that ran it)
    shown = [a for i, a in enumerate(argv) if a != "--out" and (i == 0 or argv[i - 1] != "--out")]
    results: dict[str, Any] = {"meta": {**machine(), "command": "python bench/multigpu.py " + " ".join(shown)}, "items": []}

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1, default=str))

    model = Path(args.models) / "flux-multigpu"
    t = time.time()
    results["build"] = {"params_b": build_pipeline(model, args.tiny), "seconds": round(time.time() - t, 1)}
    from bench.bench import make_dataset, stage_manifest

    make_dataset(work / "data", n=8, side=96 if args.tiny else RES)
    save()
    caches = [sys.executable, str(ROOT / "pipeline.py"), "run", "--gpus", "2", "--only", "encode-captions",
              "--only", "cache-latents", *sets(args, model, "mg", "bf16")]
    rc, wall, tail = call(caches, work / "logs" / "caches.log")
    results["items"].append({"id": "caches-2gpu", "rc": rc, "wall_s": wall, "log_tail": tail})
    save()
    if rc:
        raise SystemExit(f"caches failed:\n{tail}")
    for precision, gpus in PLAN:
        if precision not in args.precisions.split(","):
            continue
        if time.time() > deadline:
            results["items"].append({"id": f"train-{precision}-{gpus}gpu", "status": "not run: --budget-s spent"})
            continue
        run_dir = work / "artifacts" / "mg"
        since = time.time()
        rc, wall, tail = call(train_cmd(gpus, sets(args, model, "mg", precision)),
                              work / "logs" / f"train-{precision}-{gpus}.log")
        row: dict[str, Any] = {"id": f"train-{precision}-{gpus}gpu", "precision": precision, "gpus": gpus, "rc": rc,
                               "wall_s": wall, "log_tail": tail}
        if rc == 0:
            final = json.loads(stage_manifest(run_dir, "train").read_text())
            events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
            row.update(summarize(final, [e for e in events if e["stage"] == "train" and e["ts"] >= since]))
        results["items"].append(row)
        save()
        print(f"[multigpu] {row['id']}: rc {rc} {wall}s sps {row.get('samples_per_second')}", flush=True)
    save()
    shutil.rmtree(model, ignore_errors=True)


def machine() -> dict[str, Any]:
    import torch

    info = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True)
        info["topology"] = topo.stdout.strip()[:600]
    return info


def report(paths: list[Path]) -> str:
    """The bench/RESULTS.md section, from one or more results files (a later file's row wins)."""
    files = [json.loads(p.read_text()) for p in paths]
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    status: dict[str, str] = {}
    runs = []
    for data in files:
        rows.update({(r["precision"], r["gpus"]): r for r in data["items"] if r.get("gpus") and r.get("rc") == 0})
        status.update({r["id"]: r.get("status") or f"failed (exit {r.get('rc')})" for r in data["items"]})
        ran = sorted({r["precision"] for r in data["items"] if r.get("gpus")})
        cmd = data["meta"].get("command", "python bench/multigpu.py run")
        runs.append(f"{', '.join(ran) or 'caches only'}: `{cmd}` on {data['meta'].get('gpus')} x "
                    f"{data['meta'].get('gpu')}, torch {data['meta'].get('torch')}, {data['meta'].get('date_utc')} UTC")
    data = files[-1]
    lines = ["## Several GPUs: 1 vs 2 H200", "",
             "; ".join(runs) + ". FLUX.1-dev full-size transformer "
             f"(random bf16 weights), LoRA r16 on attention q/k/v/out, {RES} px, {TOKENS} text tokens, per-GPU "
             f"batch {BATCH}, gradient checkpointing, {STEPS} steps ({WARMUP} excluded from samples/s). 2 GPUs: "
             "`torchrun --standalone --nproc-per-node 2 pipeline.py train`, NCCL.", "",
             "| base | GPUs | global batch | samples/s | scaling | median step s | peak VRAM per GPU, allocated / reserved GB |",
             "|---|---|---|---|---|---|---|"]
    for precision in ("bf16", "nf4"):
        for gpus in (1, 2):
            r = rows.get((precision, gpus))
            if r is None:
                lines.append(f"| {precision} | {gpus} | | {status.get(f'train-{precision}-{gpus}gpu', 'not run')} | | | |")
                continue
            one = rows.get((precision, 1), {}).get("samples_per_second")
            scale = f"{r['samples_per_second'] / one:.2f}x" if one and gpus > 1 else ("1.00x" if gpus == 1 else "")
            peaks = ", ".join(f"{p['allocated']:.1f} / {p['reserved']:.1f}" for p in r.get("peak_vram_gb_per_rank") or [])
            step = f"{r['step_s_median']:.3f}" if r.get("step_s_median") else ""
            lines.append(f"| {precision} | {gpus} | {r['global_batch_size']} | {r['samples_per_second']:.3f} | {scale} | "
                         f"{step} | {peaks} |")
    caches = [r for d in files for r in d["items"] if r["id"] == "caches-2gpu"]
    lines += ["", "Caches (encode-captions + cache-latents, 8 images, `run --gpus 2`), once per call: "
              + ", ".join(f"{c.get('wall_s')} s wall, exit {c.get('rc')}" for c in caches) + ". Target: scaling >= 1.9x."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--work", default="/tmp/lorapipe-multigpu")
    r.add_argument("--models", default="/dev/shm" if Path("/dev/shm").is_dir() else "/tmp")
    r.add_argument("--budget-s", type=float, default=1e9, help="start no training config after this many seconds")
    r.add_argument("--tiny", action="store_true", help="tiny model on CPU, 2 gloo processes (plumbing check)")
    r.add_argument("--precisions", default="bf16,nf4", help="comma list of base precisions to train")
    p = sub.add_parser("report")
    p.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.cmd == "report":
        print(report([Path(f) for f in args.files]), end="")
        return
    run(args)


if __name__ == "__main__":
    main()
