"""A FLUX transformer at full width but few blocks: eager against CUDA graphs, nf4 and bf16, one process.

    python bench/block_probe.py --out probe.json [--double 2 --single 4 --batch 4 --px 512]

For when the device time does not allow the full-size benchmark (bench/bench.py): the blocks are the
real FluxTransformer2DModel's at FLUX.1-dev width (3072, 24 heads, T5 width 4096), saved and loaded
back through the product's own loader (`stages.core.lora.load_denoiser_weights`, nf4 through
diffusers + bitsandbytes), LoRA r16 on the attention projections, fp32 LoRA weights, gradient
checkpointing with `fastpath.checkpoint_function`, fused AdamW, the family's own loss. Per
precision: the loss and LoRA gradients of one batch, eager and graphed, compared bit for bit; then
the median of 6 full steps (forward, backward, clip, AdamW) each way. A step of the 57-block model
costs about (57 / blocks) times the per-block part of these, which RESULTS.md states as a
projection, never as a measurement.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(folder: Path, double: int, single: int) -> int:
    import torch
    from diffusers import FluxTransformer2DModel

    from bench.full_configs import FLUX_DEV_TRANSFORMER, default_dtype

    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = FluxTransformer2DModel(**{**FLUX_DEV_TRANSFORMER, "num_layers": double, "num_single_layers": single})
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(folder / "transformer"))
    (folder / "model_index.json").write_text("{}")
    del model
    torch.cuda.empty_cache()
    return params


def one_precision(folder: Path, precision: str, batch: int, px: int) -> dict[str, Any]:
    import torch

    from stages.core import fastpath, lora
    from stages.core.config import TrainConfig
    from stages.core.model_source import ModelSource
    from stages.core.runtime import make_runtime, torch_flags
    from stages.families.flux.family import Flux
    from stages.families.base import BatchMeta

    fam = Flux()
    tcfg = TrainConfig(nf4_double_quant=True, guidance_scale=1.0, dropout=0.0)
    rt = make_runtime("cuda", "bf16")
    out: dict[str, Any] = {}
    with torch_flags(True, False, True):
        torch.manual_seed(0)
        t = time.time()
        model = fam.load_denoiser(ModelSource(str(folder)), precision, rt, tcfg)
        out["load_s"] = round(time.time() - t, 2)
        params = lora.attach_lora(model, lora.lora_config(16, 16, 0.0, list(fam.default_lora_targets)))
        model.enable_gradient_checkpointing(fastpath.checkpoint_function(0.0))
        model.train()
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        h = w = px // 8
        g = torch.Generator().manual_seed(0)
        x0, noise = torch.randn(batch, 16, h, w, generator=g).cuda(), torch.randn(batch, 16, h, w, generator=g).cuda()
        t_ = torch.rand(batch, generator=g).cuda()
        cond = {"prompt_embeds": torch.randn(batch, 77, 4096, generator=g).cuda(), "pooled": torch.randn(batch, 768, generator=g).cuda()}

        def step(denoiser: Any, update: bool = True) -> tuple[float, list[Any]]:
            loss = fam.loss(denoiser, x0, noise, t_, cond, BatchMeta(None, None, None), tcfg).mean()
            loss.backward()
            grads = [p.grad.detach().clone() for p in params] if not update else []
            if update:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach()), grads

        graphed = fastpath.GraphedDenoiser(model, params, SimpleNamespace(emit=lambda *a, **k: out.setdefault("warnings", []).append(k)))
        ref = step(model, update=False)
        again = step(model, update=False)
        for _ in range(3):
            got = step(graphed, update=False)
        out["same_math"] = {"loss_eager": ref[0], "loss_graphed": got[0], "loss_equal": ref[0] == got[0],
                            "grads_equal": all(a.equal(b) for a, b in zip(ref[1], got[1])),
                            "grad_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(ref[1], got[1])),
                            "eager_repeat_equal": again[0] == ref[0] and all(a.equal(b) for a, b in zip(again[1], ref[1])),
                            "eager_repeat_grad_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(again[1], ref[1]))}
        for name, den in (("eager", model), ("graphs", graphed)):
            for _ in range(2):
                step(den)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(6):
                t = time.perf_counter()
                step(den)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            out[name] = {"median_s": round(statistics.median(times), 4), "step_s": [round(x, 4) for x in times],
                         "peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 2**30, 3)}
        out["graphs"].update(graphed.summary())
        out["speedup"] = round(out["eager"]["median_s"] / out["graphs"]["median_s"], 3)
    del model, graphed, opt
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--px", type=int, default=512)
    ap.add_argument("--folder", default="/tmp/flux-probe")
    args = ap.parse_args()
    import torch

    folder = Path(args.folder)
    shutil.rmtree(folder, ignore_errors=True)
    result: dict[str, Any] = {"command": " ".join(sys.argv), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "double_blocks": args.double, "single_blocks": args.single, "batch": args.batch, "px": args.px,
                              "text_tokens": 77, "params": build(folder, args.double, args.single)}
    for precision in ("nf4", "bf16"):
        try:
            result[precision] = one_precision(folder, precision, args.batch, args.px)
        except Exception as e:  # noqa: BLE001 - keep the other precision's numbers
            result[precision] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
