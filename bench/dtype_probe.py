"""A/B probe of the dtype the family feeds an nf4 base under fp32 adapters (stages.core.lora.base_dtype).

    python bench/dtype_probe.py --family flux2-klein --res 1024 --out $OUT/dtype-probe.json   # H200
    python bench/dtype_probe.py --family flux2-klein --tiny --out /tmp/dtype-probe.json        # CPU plumbing

Builds the family's full-size denoiser with random bf16 weights on the GPU, quantizes it to nf4
(stages.core.nf4_blocks, nothing swapped), attaches the default LoRA (r16, fp32 weights, as train
does), turns on gradient checkpointing, and times the family's own `loss` + backward over random
inputs (batch 1, 512 text tokens), eager, twice: inputs cast to diffusers' `model.dtype` (what the
families did before: an fp32 adapter weight's dtype for FLUX.2 klein) and to `base_dtype` (now).
On the GPU it then times `base_dtype` without gradient checkpointing (its step and peak), and
profiles two checkpointed steps (torch.profiler): the top CUDA kernels by time go in the JSON
under "profile", to say where a step's time goes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="flux2-klein")
    ap.add_argument("--res", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from peft import LoraConfig

    from stages.core import lora, nf4_blocks
    from stages.core.config import TrainConfig
    from stages.families import demo_variant, get_family
    from stages.families.base import BatchMeta

    family = get_family(a.family)
    device = torch.device("cpu" if a.tiny else "cuda")
    if a.tiny:
        from stages.tiny.models import build_tiny_components

        model = build_tiny_components(demo_variant(a.family))[family.denoiser_components[0]].to(torch.bfloat16)
        res, text = 64, 8
    else:
        from bench.full_configs import build_module

        model = build_module(a.family, family.denoiser_components[0], "cuda")
        res, text = a.res, 512
    model = nf4_blocks.quantize_nf4_by_block(model, False, device, 0)
    lora.attach_lora(model, LoraConfig(r=16, lora_alpha=16, target_modules=list(family.default_lora_targets)))
    model.enable_gradient_checkpointing()
    model.train()
    cfg = model.config
    channels = cfg.in_channels // 4 if a.family.startswith("flux") else cfg.in_channels
    side = res // 8
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, channels, side, side, generator=g).to(device)
    noise = torch.randn(x0.shape, generator=g).to(device)
    cond = {"prompt_embeds": torch.randn(1, text, cfg.joint_attention_dim, generator=g).to(device, torch.bfloat16)}
    size = torch.tensor([[res, res]])
    meta = BatchMeta(original_size=size, crop_top_left=torch.zeros_like(size), target_size=size)
    t = torch.tensor([0.5], device=device)
    module = sys.modules[type(family).loss.__module__]  # where the loss reads base_dtype (flux2_dit for FLUX.2)
    rows = {"model.dtype (before)": (lambda m: m.dtype, True),
            "base_dtype (now)": (lora.base_dtype, True)}
    if not a.tiny:
        rows["base_dtype, no checkpointing"] = (lora.base_dtype, False)
    out: dict = {"family": a.family, "res": res, "text_tokens": text, "device": torch.cuda.get_device_name(0) if not a.tiny else "cpu",
                 "model.dtype": str(model.dtype), "base_dtype": str(lora.base_dtype(model)), "rows": {}}
    for name, (pick, checkpointing) in rows.items():
        module.base_dtype = pick
        if not checkpointing:
            model.disable_gradient_checkpointing()
        times = []
        if not a.tiny:
            torch.cuda.reset_peak_memory_stats()
        for i in range(a.warmup + a.steps):
            if not a.tiny:
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = family.loss(model, x0, noise, t, cond, meta, TrainConfig())
            loss.backward()
            if not a.tiny:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        steady = sorted(times[a.warmup:])
        out["rows"][name] = {"step_s_median": round(steady[len(steady) // 2], 4), "step_s_all": [round(x, 4) for x in times],
                             "loss": float(loss.detach()), "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 3) if not a.tiny else 0.0}
        print(name, json.dumps(out["rows"][name]), flush=True)
    module.base_dtype = lora.base_dtype
    if not a.tiny:
        model.enable_gradient_checkpointing()
        from stages.core.profiling import profiled

        with profiled(2, cuda=True) as table:
            for _ in range(2):
                family.loss(model, x0, noise, t, cond, meta, TrainConfig()).backward()
                model.zero_grad(set_to_none=True)
        out["profile"] = table()
        print("\n".join(f"{r['ms']:9.1f} ms {r['pct']:5.1f}% x{r['calls']:<5} {r['name']}" for r in out["profile"]["top"]), flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
