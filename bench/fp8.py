"""fp8 base weights against bf16 and nf4 on a full-size random-weight FLUX.1-dev transformer, one process.

    python bench/fp8.py --out fp8.json [--fidelity-steps 50 --deadline 420]
    python bench/fp8.py --out smoke.json --smoke          # CPU, two narrow blocks: the code paths only

(a) `micro`: one frozen Linear's forward + input gradient, `Fp8Linear` (compiled, so the per-row
    quantization fuses) against a bf16 matmul, at FLUX.1 shapes.
(b) `step`: LoRA r16 on the attention projections, fp32 LoRA weights, gradient checkpointing,
    regional compile, fused AdamW, 512 text tokens: median step time and peak VRAM at 512 px
    batch 1 and 1024 px batch 4, bf16 and fp8 bases.
(c) `fidelity`: from the same initial LoRA and the same batches (512 px, batch 1, eager), N steps
    per base: the per-step loss relative to bf16's and the cosine of the step-1 LoRA gradients,
    for fp8 and nf4.
(d) `text_encoder`: T5-XXL (random weights) in bf16 and with fp8 Linears: embedding cosine and error.

One model is built once; its block Linears are kept on the CPU and each base (bf16, fp8 via
`quantize_denoiser_fp8`'s own `Fp8Linear.from_linear`, nf4 via bitsandbytes) is made from them
layer by layer, so all three bases share the exact same weights. Items run in that order until
`--deadline` seconds have passed; the JSON is rewritten after each, and says what was cut.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stages.core.fp8 import Fp8Linear, fp8_eligible, inside_repeated_blocks, quantize_denoiser_fp8, text_encoder_keep  # noqa: E402
from bench.fp8_torchao import rel  # noqa: E402
from stages.families.base import BatchMeta  # noqa: E402

NO_META = BatchMeta(None, None, None)  # FLUX's loss reads only the batch's (absent) loss mask

MICRO_SHAPES = [(m, k, n) for m in (4096, 16384) for k, n in ((3072, 3072), (3072, 12288), (12288, 3072), (3072, 21504))]
SMOKE_FLUX = dict(num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=2, joint_attention_dim=256)


def cuda_ms(fn: Callable[[], Any], iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def micro(m: int, k: int, n: int) -> dict[str, Any]:
    dense = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    fp8 = torch.compile(Fp8Linear.from_linear(dense, "cuda"), dynamic=False)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, layer in (("bf16", dense), ("fp8", fp8)):
        def fwd_bwd() -> torch.Tensor:
            x.grad = None
            y = layer(x)
            y.backward(g)
            return y
        for _ in range(3):
            y = fwd_bwd()
        out[f"{name}_ms"] = round(cuda_ms(fwd_bwd, 20), 4)
        out[f"{name}_y"], out[f"{name}_dx"] = y.detach().float(), x.grad.detach().float()
    res = {"M": m, "K": k, "N": n, "bf16_ms": out["bf16_ms"], "fp8_ms": out["fp8_ms"],
           "speedup": round(out["bf16_ms"] / out["fp8_ms"], 3), "rel_err_y": rel(out["fp8_y"], out["bf16_y"]),
           "rel_err_dx": rel(out["fp8_dx"], out["bf16_dx"])}
    res["fp8_tflops"] = round(4 * m * k * n / out["fp8_ms"] / 1e9, 1)  # forward + input gradient
    return res


def text_encoder(device: str, smoke: bool) -> dict[str, Any]:
    from bench.full_configs import build_module

    if smoke:
        from stages.tiny.models import build_tiny_components

        t5 = build_tiny_components("flux-dev")["text_encoder_2"].to(device, torch.bfloat16)
    else:
        torch.manual_seed(0)
        t5 = build_module("flux", "text_encoder_2", device)
    ids = torch.randint(0, 32000 if not smoke else 100, (2, 512), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ref = t5(input_ids=ids).last_hidden_state.float()
        quantize_denoiser_fp8(t5, text_encoder_keep(t5), device, min_width=16 if smoke else 256)
        got = t5(input_ids=ids).last_hidden_state.float()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    res = {"fp8_linears": sum(isinstance(mod, Fp8Linear) for mod in t5.modules()),
           "cosine_min": round(float(cos.min()), 5), "cosine_mean": round(float(cos.mean()), 5),
           "max_abs_err": round(float((got - ref).abs().max()), 4), "ref_abs_max": round(float(ref.abs().max()), 4),
           "rel_err": round(float((got - ref).norm() / ref.norm()), 5)}
    del t5
    return res


class Bases:
    """The transformer with LoRA, and its block Linears on the CPU, from which each base is made."""

    def __init__(self, model: nn.Module, device: str):
        keep = inside_repeated_blocks(model)
        self.device, self.slots = device, []
        for parent_name, parent in list(model.named_modules()):
            for child_name, child in list(parent.named_children()):
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                if type(child) is nn.Linear and fp8_eligible(child) and not keep(name, child):
                    self.slots.append((parent, child_name, child.to("cpu")))

    def use(self, kind: str) -> None:
        make = {"bf16": self._dense, "fp8": lambda lin: Fp8Linear.from_linear(lin, self.device), "nf4": self._nf4}[kind]
        for parent, child_name, original in self.slots:
            setattr(parent, child_name, make(original))
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def _dense(self, lin: nn.Linear) -> nn.Linear:
        with torch.device("meta"):
            new = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
        new.weight = nn.Parameter(lin.weight.detach().to(self.device), requires_grad=False)
        if lin.bias is not None:
            new.bias = nn.Parameter(lin.bias.detach().to(self.device), requires_grad=False)
        return new

    def _nf4(self, lin: nn.Linear) -> nn.Module:
        import bitsandbytes as bnb

        with torch.device("meta"):
            new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                    compute_dtype=torch.bfloat16, quant_type="nf4")
        new.weight = bnb.nn.Params4bit(lin.weight.detach().clone(), requires_grad=False, quant_type="nf4",
                                       compress_statistics=True).to(self.device)
        if lin.bias is not None:
            new.bias = nn.Parameter(lin.bias.detach().to(self.device), requires_grad=False)
        return new


class FluxBench:
    """Full-size FLUX.1-dev transformer (random weights), LoRA r16 on attention, checkpointing."""

    def __init__(self, device: str, smoke: bool):
        from diffusers import FluxTransformer2DModel

        from bench.full_configs import FLUX_DEV_TRANSFORMER, default_dtype
        from stages.core import fastpath, lora
        from stages.core.config import TrainConfig
        from stages.families.flux.family import Flux

        self.device, self.fam, self.tcfg = device, Flux(), TrainConfig(guidance_scale=1.0, dropout=0.0)
        self.text_width = (SMOKE_FLUX if smoke else FLUX_DEV_TRANSFORMER)["joint_attention_dim"]
        torch.manual_seed(0)
        with torch.device(device), default_dtype(torch.bfloat16):
            self.model = FluxTransformer2DModel(**{**FLUX_DEV_TRANSFORMER, **(SMOKE_FLUX if smoke else {})})
        self.model.requires_grad_(False)
        torch.manual_seed(1)
        self.params = lora.attach_lora(self.model, lora.lora_config(16, 16, 0.0, list(Flux.default_lora_targets)))
        self.initial = [p.detach().clone() for p in self.params]
        self.model.enable_gradient_checkpointing(fastpath.checkpoint_function(0.0))
        self.model.train()
        self.bases = Bases(self.model, device)

    def batch(self, seed: int, b: int, px: int) -> tuple[torch.Tensor, ...]:
        g, h = torch.Generator().manual_seed(seed), px // 8
        x0, noise = torch.randn(b, 16, h, h, generator=g), torch.randn(b, 16, h, h, generator=g)
        cond = {"prompt_embeds": torch.randn(b, 512, self.text_width, generator=g), "pooled": torch.randn(b, 768, generator=g)}
        t = torch.rand(b, generator=g)
        return x0.to(self.device), noise.to(self.device), t.to(self.device), {k: v.to(self.device) for k, v in cond.items()}

    def fresh_optimizer(self) -> torch.optim.Optimizer:
        with torch.no_grad():
            for p, p0 in zip(self.params, self.initial):
                p.copy_(p0)
        return torch.optim.AdamW(self.params, lr=1e-4, fused=self.device == "cuda")

    def step(self, opt: torch.optim.Optimizer, drawn: tuple[torch.Tensor, ...]) -> float:
        x0, noise, t, cond = drawn
        loss = self.fam.loss(self.model, x0, noise, t, cond, NO_META, self.tcfg).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def set_compiled(self, on: bool) -> None:
        if on:
            self.model.compile_repeated_blocks(fullgraph=False)
            return
        for module in self.model.modules():  # as the trainer's _uncompile does
            if getattr(module, "_compiled_call_impl", None) is not None:
                module._compiled_call_impl = None

    def fidelity(self, steps: int, deadline: float) -> dict[str, Any]:
        """`steps` eager steps at 512 px batch 1 from the initial LoRA; the step-1 LoRA gradient kept."""
        opt, losses, grad = self.fresh_optimizer(), [], None
        for i in range(steps):
            if time.time() > deadline:
                break
            x0, noise, t, cond = self.batch(1000 + i, 1, 512)
            loss = self.fam.loss(self.model, x0, noise, t, cond, NO_META, self.tcfg).mean()
            loss.backward()
            if grad is None:
                grad = torch.cat([p.grad.detach().float().flatten() for p in self.params])
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        return {"losses": losses, "grad": grad}

    def timing(self, px: int, batch: int, warm: int = 2, n: int = 5) -> dict[str, Any]:
        opt, drawn = self.fresh_optimizer(), self.batch(7, batch, px)
        t0 = time.time()
        for _ in range(warm):
            self.step(opt, drawn)
        sync(self.device)
        warm_s = time.time() - t0
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            self.step(opt, drawn)
            sync(self.device)
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.device == "cuda" else 0.0
        return {"px": px, "batch": batch, "median_s": round(med, 4), "samples_per_s": round(batch / med, 3),
                "step_s": [round(x, 4) for x in times], "peak_allocated_gb": round(peak, 3), "warmup_s": round(warm_s, 1)}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    n = min(len(run["losses"]), len(ref["losses"]))
    a, b = torch.tensor(run["losses"][:n]), torch.tensor(ref["losses"][:n])
    rel = (a - b).abs() / b.abs()
    cos = torch.nn.functional.cosine_similarity(run["grad"], ref["grad"], dim=0) if run["grad"] is not None else None
    return {"steps": n, "loss_rel_diff_max": round(float(rel.max()), 5), "loss_rel_diff_mean": round(float(rel.mean()), 5),
            "loss_rel_diff_per_step": [round(float(x), 5) for x in rel],
            "grad_cosine_step1": None if cos is None else round(float(cos), 5)}


class Recorder:
    def __init__(self, out: Path, deadline_s: float):
        self.out, self.start, self.deadline = out, time.time(), time.time() + deadline_s
        self.result: dict[str, Any] = {"command": "python " + " ".join(sys.argv),
                                       "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                                       "torch": torch.__version__, "cut": [], "errors": {}}
        if torch.cuda.is_available():
            self.result["gpu"] = torch.cuda.get_device_name(0)

    def item(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one item unless past the deadline; record its result or its error, then save."""
        if time.time() > self.deadline:
            self.result["cut"].append(name)
            return None
        t = time.time()
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - keep the other items' numbers
            self.result["errors"][name] = f"{type(e).__name__}: {str(e)[:600]}"
            value = None
        print(f"[{time.time() - self.start:6.1f}s] {name} ({time.time() - t:.1f}s): {_short(value)}", flush=True)
        self.save()
        return value

    def save(self) -> None:
        self.out.write_text(json.dumps(self.result, indent=1))


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps({k: v for k, v in value.items() if not isinstance(v, (list, torch.Tensor))})[:300]
    return str(value)[:300]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--fidelity-steps", type=int, default=50)
    ap.add_argument("--deadline", type=float, default=420.0, help="start no item after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="CPU, narrow 2-block FLUX, tiny shapes: code paths only")
    ap.add_argument("--fidelity-only", action="store_true", help="skip the layer timings, the text encoder and the "
                    "step times: the fidelity runs alone (the 50-step run within one device call)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    rec = Recorder(Path(args.out), args.deadline)
    res = rec.result
    torch._dynamo.config.cache_size_limit = 64  # 3 bases x 2 shapes per block class; never fall back silently
    from stages.core.runtime import torch_flags

    with torch_flags(True, False, True):
        if not (args.smoke or args.fidelity_only):
            res["micro"] = [rec.item(f"micro {s}", lambda s=s: micro(*s)) for s in MICRO_SHAPES]
        if not args.fidelity_only:
            res["text_encoder"] = rec.item("text_encoder", lambda: text_encoder(device, args.smoke))
        bench = rec.item("build", lambda: FluxBench(device, args.smoke))
        shapes = ((64, 1),) if args.smoke else ((1024, 4), (512, 1))
        runs: dict[str, Any] = {}
        res["step"], res["fidelity"] = {}, {}
        # fidelity first (eager, bf16 as the reference, nf4 before fp8 so both get their steps), then
        # the compiled step times, fp8 then bf16 (four base swaps in all)
        for kind in ("bf16", "fp8") if args.smoke else ("bf16", "nf4", "fp8"):
            if bench is None:
                break
            rec.item(f"use {kind}", lambda: bench.bases.use(kind))
            runs[kind] = rec.item(f"fidelity {kind}", lambda: bench.fidelity(1 if args.smoke else args.fidelity_steps, rec.deadline))
            if runs[kind] is not None:
                res["fidelity"][kind] = {"steps": len(runs[kind]["losses"]), "losses": runs[kind]["losses"]}
                if kind != "bf16" and runs.get("bf16"):
                    res["fidelity"][kind]["vs_bf16"] = compare(runs[kind], runs["bf16"])
        for kind in () if args.fidelity_only else ("fp8", "bf16"):
            if bench is None or time.time() > rec.deadline:
                break
            if kind == "bf16":
                rec.item("use bf16", lambda: bench.bases.use("bf16"))
            bench.set_compiled(not args.smoke)
            res["step"][kind] = {f"{px}x{b}": rec.item(f"step {kind} {px}px b{b}", lambda px=px, b=b: bench.timing(px, b))
                                 for px, b in shapes}
    rec.save()


if __name__ == "__main__":
    main()
