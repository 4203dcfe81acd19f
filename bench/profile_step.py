"""Where a training step's time goes, eager against CUDA graphs, in one process (bench.py runs it).

    python bench/profile_step.py --out prof.json --config configs/flux-dev.toml --model M --run R \
        --set train.base_precision=nf4 --set train.batch_size=4 ...

Loads the denoiser once through the product's Trainer (same config as `train`), then:
1. same math: loss and LoRA gradients of one batch, eager and replayed from a CUDA graph, before
   any update, compared bit for bit;
2. step time: median of 5 synchronized `Trainer.step()` calls, eager then graphed;
3. torch.profiler over 2 steps of each: wall time against GPU kernel time, and the top operators
   by host (self CPU) time and by GPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def loss_and_grads(tr: Any, drawn: tuple[Any, ...]) -> tuple[float, list[Any]]:
    loss = tr.compute_loss(*drawn)
    loss.backward()
    grads = [p.grad.detach().clone() for p in tr.params]
    tr.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def same_math(tr: Any, graphed: Any) -> dict[str, Any]:
    _, drawn = tr.draw_next()
    ref_loss, ref = loss_and_grads(tr, drawn)
    again_loss, again = loss_and_grads(tr, drawn)
    out: dict[str, Any] = {"eager_repeat_equal": again_loss == ref_loss and all(a.equal(b) for a, b in zip(again, ref)),
                           "eager_repeat_grad_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(again, ref))}
    if graphed is not None:
        tr.denoiser = graphed
        for _ in range(3):  # first: eager (shape seen once), second: capture + replay, third: replay
            got_loss, got = loss_and_grads(tr, drawn)
        tr.denoiser = tr.model
        out.update(graphed_loss=got_loss, eager_loss=ref_loss, loss_equal=got_loss == ref_loss,
                   grads_equal=all(a.equal(b) for a, b in zip(got, ref)),
                   grad_max_abs_diff=max(float((a - b).abs().max()) for a, b in zip(got, ref)))
    return out


def timed(tr: Any, warm: int, n: int) -> dict[str, Any]:
    import torch

    for _ in range(warm):
        tr.step()
    if tr.rt.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        tr.step()  # ends with float(loss): waits for the GPU
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    out = {"step_s": [round(x, 4) for x in times], "median_s": round(med, 4),
           "samples_per_second": round(tr.tcfg.batch_size / med, 3)}
    if tr.rt.is_cuda:
        out["peak_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        out["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    return out


def _device_us(e: Any) -> float:
    return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)


def _kernel_kind(name: str) -> str:
    n = name.lower()
    for kind, marks in (("nf4 dequantize", ("dequantize",)), ("nf4 gemv/gemm (bitsandbytes)", ("kgemm_4bit", "gemm_4bit")),
                        ("matmul", ("nvjet", "gemm", "cutlass", "cublas", "sm90_xmma", "wgmma")),
                        ("attention", ("flash", "fmha", "attention", "efficient")),
                        ("copy / dtype cast", ("copy", "memcpy", "memset")),
                        ("norm", ("norm",)), ("optimizer", ("adam", "foreach", "multi_tensor")),
                        ("triton (compiled)", ("triton",)), ("elementwise", ("elementwise", "reduce"))):
        if any(m in n for m in marks):
            return kind
    return "other"


def profiled(tr: Any, n: int = 2) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tr.rt.is_cuda else [])
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(n):
            tr.step()
    wall = (time.perf_counter() - t) / n
    events = prof.key_averages()
    rows = [{"name": e.key[:90], "calls": e.count // n, "self_cpu_ms": round(e.self_cpu_time_total / 1e3 / n, 2),
             "gpu_ms": round(_device_us(e) / 1e3 / n, 2)} for e in events]
    # GPU time = the device-side events only (kernels, copies); a host op's or a replayed graph's own
    # "device time" is the same kernels again
    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    gpu_ms = sum(_device_us(e) for e in kernels) / 1e3 / n
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = _kernel_kind(e.key)
        by_kind[kind] = round(by_kind.get(kind, 0.0) + _device_us(e) / 1e3 / n, 2)
    cpu_ms = sum(r["self_cpu_ms"] for r in rows)
    groups: dict[str, float] = {}
    for r in rows:
        key = r["name"].split("::")[0] if "::" in r["name"] else ("cuda runtime" if r["name"].startswith("cuda") else "other")
        groups[key] = round(groups.get(key, 0.0) + r["self_cpu_ms"], 2)
    return {"wall_ms_per_step_profiled": round(wall * 1e3, 1), "gpu_kernel_ms_per_step": round(gpu_ms, 1),
            "host_op_ms_per_step": round(cpu_ms, 1), "host_ms_by_namespace": groups, "gpu_ms_by_kernel_kind": by_kind,
            "launches_per_step": sum(r["calls"] for r in rows if r["name"].startswith(("cudaLaunchKernel", "cuLaunchKernel"))),
            "top_host": sorted(rows, key=lambda r: -r["self_cpu_ms"])[:18],
            "top_gpu": sorted(rows, key=lambda r: -r["gpu_ms"])[:18]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    from stages.core import fastpath
    from stages.core.config import load_config, parse_override
    from stages.core.events import EventLog
    from stages.core.runtime import torch_flags
    from stages.train.trainer import Trainer

    import torch

    os.environ[fastpath.ENV] = "off"  # the Trainer starts eager; graphs are switched in below
    cfg = load_config(args.config, {**dict(parse_override(s) for s in args.sets), "run": args.run, "model": args.model})
    tr = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "profile"))
    result: dict[str, Any] = {"batch_size": cfg.train.batch_size, "precision": cfg.train.base_precision,
                              "resolution": cfg.data.resolution}
    with torch_flags(cfg.runtime.enable_tf32, cfg.runtime.cudnn_benchmark, disable_cudnn_attention=True):
        torch.manual_seed(cfg.seed)
        t = time.time()
        tr.setup_model()
        result["setup_s"] = round(time.time() - t, 1)
        graphed = fastpath.GraphedDenoiser(tr.model, tr.params, tr.log) if tr.rt.is_cuda else None
        result["same_math"] = same_math(tr, graphed)
        result["eager"] = {**timed(tr, warm=2, n=5), "profile": profiled(tr)}
        if graphed is not None:
            tr.denoiser = graphed
            result["graphs"] = {**timed(tr, warm=1, n=5), "profile": profiled(tr), **graphed.summary()}
            result["speedup"] = round(result["eager"]["median_s"] / result["graphs"]["median_s"], 3)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("eager", "graphs")}, indent=1))


if __name__ == "__main__":
    main()
