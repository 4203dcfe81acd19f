"""Where a block-swapped step's time goes: a Qwen-Image transformer at full width but few blocks.

    python bench/swap_probe.py --out swap-probe.json [--blocks 8 --swapped 6 --px 1024]

The memory table's Qwen-Image 8 GB row swaps 36 of 60 nf4 blocks and trains at 0.50x the unswapped step.
This splits that gap, one process, the product's own pieces (nf4_blocks.quantize_nf4_by_block,
blockswap.install_block_swap, lora.attach_lora, fastpath.checkpoint_function / GraphedDenoiser,
regional compile, the family's loss): per configuration the median of timed full steps (forward,
backward, AdamW), the peak, the swap's copy/prefetch counters and dynamo's recompile counters; the
host-to-device copy rate of one swapped block (pinned, synchronous); and a profile of the swapped
step (GPU kernel time against copy time, so overlap shows). Nothing here is projected to 60 blocks
in RESULTS.md without saying so.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIGS = {  # name -> (swapped, compiled, graphs)
    "resident_graphs": (False, True, True),
    "resident_compiled": (False, True, False),
    "resident_eager": (False, False, False),
    "swap_graphs": (True, True, True),
    "swap_compiled": (True, True, False),
    "swap_eager": (True, False, False),
}


def one(host_model: Any, name: str, swapped: int, compiled: bool, graphs: bool, px: int, steps: int) -> dict[str, Any]:
    import torch
    import torch._dynamo

    from stages.core import blockswap, fastpath, lora, nf4_blocks
    from stages.core.config import TrainConfig
    from stages.core.profiling import kernel_table
    from stages.families.qwen_image.family import QwenImage

    fam = QwenImage()
    dev = torch.device(DEVICE)
    tcfg = TrainConfig(guidance_scale=1.0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    t0 = time.time()
    model = nf4_blocks.quantize_nf4_by_block(copy.deepcopy(host_model), True, dev, swapped)
    torch.manual_seed(0)  # the same LoRA init in every configuration: their losses compare
    params = lora.attach_lora(model, lora.lora_config(16, 16, 0.0, list(fam.default_lora_targets)))
    swap = blockswap.install_block_swap(model, swapped, dev)
    blockswap.move_unswapped(model, swap, dev)
    model.enable_gradient_checkpointing(fastpath.checkpoint_function(0.0))
    model.train()
    if compiled:
        model.compile_repeated_blocks(fullgraph=False)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    out: dict[str, Any] = {"setup_s": round(time.time() - t0, 2)}
    lat = px // 8
    g = torch.Generator().manual_seed(0)
    x0, noise = (torch.randn(1, 16, lat, lat, generator=g).to(dev) for _ in range(2))
    t_ = torch.rand(1, generator=g).to(dev)
    cond = {"prompt_embeds": torch.randn(1, 77, 3584, generator=g).to(dev), "prompt_length": torch.tensor([77], device=dev)}
    meta = SimpleNamespace(loss_mask=None)
    log = SimpleNamespace(emit=lambda event, **k: out.setdefault("warnings", []).append(k.get("message", "")[:400]))
    warmup = fastpath.SWAP_WARMUP_ITERS if swapped else fastpath.WARMUP_ITERS  # as the trainer captures
    den = fastpath.GraphedDenoiser(model, params, log, warmup=warmup) if graphs else model

    def step() -> float:
        loss = fam.loss(den, x0, noise, t_, cond, meta, tcfg).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    t0 = time.time()
    losses = [step() for _ in range(3)]
    sync()
    out["warmup_s"] = round(time.time() - t0, 2)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        losses.append(step())
        sync()
        times.append(time.perf_counter() - t)
    out.update(median_s=round(statistics.median(times), 4), step_s=[round(x, 4) for x in times], losses=losses,
               peak_allocated_gb=round(torch.cuda.max_memory_allocated() / 2**30, 3) if dev.type == "cuda" else None,
               dynamo={k: dict(v) for k, v in torch._dynamo.utils.counters.items() if k in ("recompiles", "stats", "graph_break")})
    if swap is not None:
        out["swap"] = swap.summary()
    if graphs:
        out["graphs"] = den.summary()
    if name in ("swap_compiled", "swap_graphs", "resident_compiled") and dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / 2
        table = kernel_table(prof, 2, True, top=12)
        out["profile"] = {"wall_ms_per_step": round(wall * 1000, 1), **table, "runtime_calls": runtime_calls(prof, 2)}
        with warnings.catch_warnings(record=True) as caught:  # the syncs torch itself knows of, one step
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out["sync_warnings"] = sorted({str(w.message)[:200] for w in caught if "synchroniz" in str(w.message)})
    if swap is not None and dev.type == "cuda":  # the copy rate of one swapped block, synchronous, pinned host -> GPU
        block = swap.blocks[-1]
        nbytes = blockswap.frozen_bytes(block)
        for _ in range(2):
            swap._copy_into_slot(len(swap.blocks) - 1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            swap._copy_into_slot(len(swap.blocks) - 1)
        torch.cuda.synchronize()
        per = (time.perf_counter() - t) / 5
        out["copy"] = {"block_mb": round(nbytes / 2**20, 1), "ms": round(per * 1000, 2), "gb_s": round(nbytes / per / 1e9, 1)}
    del model, den, opt, swap, params
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


DEVICE = "cuda"


def runtime_calls(prof: Any, steps: int) -> dict[str, list[float]]:
    """The CUDA runtime/driver calls the host made per step: {name: [calls, host ms]}, longest first
    (a cudaStreamSynchronize or cudaEventSynchronize here is the host waiting for the GPU)."""
    calls = {e.key: [round(e.count / steps, 1), round(e.cpu_time_total / 1000 / steps, 2)]
             for e in prof.key_averages() if e.key.startswith(("cuda", "cu"))}
    return dict(sorted(calls.items(), key=lambda kv: -kv[1][1])[:20])


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--swapped", type=int, default=6)
    ap.add_argument("--px", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (eager configurations)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    import torch
    from diffusers import QwenImageTransformer2DModel

    from bench.full_configs import default_dtype
    from stages.families.qwen_image.full import TRANSFORMER

    with torch.device(DEVICE), default_dtype(torch.bfloat16):
        model = QwenImageTransformer2DModel(**{**TRANSFORMER, "num_layers": args.blocks})
    host = model.to("cpu").requires_grad_(False)
    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
    result: dict[str, Any] = {"command": " ".join(sys.argv), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                              "gpu": gpu, "torch": torch.__version__, "blocks": args.blocks,
                              "swapped": args.swapped, "px": args.px, "text_tokens": 77, "precision": "nf4",
                              "params": sum(p.numel() for p in host.parameters())}
    for name, (swapped, compiled, graphs) in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        try:
            with _tf32():
                result[name] = one(host, name, args.swapped if swapped else 0, compiled, graphs, args.px, args.steps)
        except Exception as e:  # noqa: BLE001 - keep the other configurations' numbers
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
        print(name, json.dumps({k: v for k, v in result[name].items() if k != "profile"})[:600], flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


def _tf32() -> Any:
    from stages.core.runtime import torch_flags

    return torch_flags(True, False, True)


if __name__ == "__main__":
    main()
