"""torchao's float8 against the product's Fp8Linear and bf16: one frozen Linear, forward + input gradient.

    pip install --no-deps --target /tmp/tao .whl/extra/torchao-0.18.0-*.whl && PYTHONPATH=/tmp/tao:/tmp/site:$PWD python3 bench/fp8_torchao.py --out $OUT/fp8-torchao-h200.json
    python bench/fp8_torchao.py --cpu-dry --out /tmp/fp8-torchao-dry.json   # CPU, tiny shapes: the plumbing only

What LoRA training runs on a frozen base Linear: y = x W^T + b with W frozen (requires_grad False),
x requiring grad, then the backward for x only. At FLUX.1 shapes (M = 4096 and 16384 tokens;
K x N = 3072x3072, 3072x12288, 12288x3072, 3072x21504, 15360x3072), eager and compiled
(`torch.compile` of the layer call, a fresh dynamo cache per case), for:
  - `bf16`: the nn.Linear itself (the reference);
  - `product`: stages/core/fp8.py's `Fp8Linear` (e4m3 weight stored once with per-output-channel
    scales, per-row activation / gradient scales, `torch._scaled_mm`);
  - `torchao_rowwise`: `torchao.float8.convert_to_float8_training` with
    `Float8LinearConfig.from_recipe_name("rowwise")`, the weight left frozen (torchao keeps it in
    bf16 and casts it to float8 on every call);
  - `torchao_quantize_perrow`: `torchao.quantization.quantize_` with
    `Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())` (an inference tensor: the case
    records "unsupported: <error>" when no input gradient comes out of it);
  - then, while time is left: `torchao_tensorwise` and `torchao_rowwise_with_gw_hp` (the other
    float8 training recipes).

Per case: `wall_ms` (median of per-call CUDA-event times, the layer called as a program would: the
host's launch overhead shows at small shapes), `gpu_ms` (the same calls queued behind a GPU sleep so
the host runs ahead: kernel time alone, what CUDA graphs would see; `gpu_bound` says whether the host
really stayed ahead), `retained_mb` (memory the forward keeps for the backward beyond its output),
`weight_bytes` (what the layer stores for W: values and scales, bias not counted), relative errors of
y and of dx against the bf16 layer and against an fp32 matmul, and `first_call_s` (compile included).
Cases run in that order until `--deadline` seconds have passed; the JSON is rewritten after each,
and `cut` lists what did not run.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stages.core.fp8 import Fp8Linear  # noqa: E402

M_TOKENS = (4096, 16384)
KN = ((3072, 3072), (3072, 12288), (12288, 3072), (3072, 21504), (15360, 3072))
DRY_M, DRY_KN = (32,), ((64, 64), (64, 128))
TIER1 = ("bf16", "product", "torchao_rowwise", "torchao_quantize_perrow")
TIER2 = ("torchao_tensorwise", "torchao_rowwise_with_gw_hp")
MODES = ("eager", "compiled")


# ---- the layers -----------------------------------------------------------------------------------

def _torchao_training(recipe: str) -> Callable[[nn.Linear, str], nn.Module]:
    def make(dense: nn.Linear, device: str) -> nn.Module:
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        if device != "cuda":  # --cpu-dry: torchao's emulated float8 matmul, the plumbing only
            config = dataclasses.replace(config, emulate=True)
        holder = nn.Sequential(dense)  # the new layer shares dense's frozen weight Parameter
        convert_to_float8_training(holder, config=config)
        layer = holder[0]
        if type(layer).__name__ != "Float8Linear":
            raise RuntimeError(f"convert_to_float8_training left a {type(layer).__name__}")
        return layer
    return make


def _torchao_quantize(dense: nn.Linear, device: str) -> nn.Module:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    holder = nn.Sequential(copy.deepcopy(dense))  # quantize_ replaces the weight in place
    # set_inductor_config=False: torchao's recommended inductor settings are global and would change
    # how every later case compiles
    quantize_(holder, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False))
    layer = holder[0]
    if not hasattr(layer.weight, "qdata"):
        raise RuntimeError(f"quantize_ left the weight a {type(layer.weight).__name__} (not float8)")
    return layer


MAKERS: dict[str, Callable[[nn.Linear, str], nn.Module]] = {
    "bf16": lambda dense, device: dense,
    "product": lambda dense, device: Fp8Linear.from_linear(dense, device),
    "torchao_rowwise": _torchao_training("rowwise"),
    "torchao_quantize_perrow": _torchao_quantize,
    "torchao_tensorwise": _torchao_training("tensorwise"),
    "torchao_rowwise_with_gw_hp": _torchao_training("rowwise_with_gw_hp"),
}


def tensor_bytes(t: torch.Tensor) -> int:
    """A tensor's storage bytes; a tensor subclass (torchao's Float8Tensor) counts its inner tensors."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(layer: nn.Module) -> int:
    """What the layer stores for W (values and scales), its bias not counted."""
    tensors = list(layer.named_parameters()) + list(layer.named_buffers())
    return sum(tensor_bytes(t) for name, t in tensors if name != "bias" and t is not None)


def weight_kind(layer: nn.Module) -> str:
    w = layer.weight
    return f"{type(layer).__name__}, weight {type(w).__name__} {getattr(w, 'qdata', w).dtype}"


# ---- timing ---------------------------------------------------------------------------------------

class Clock:
    """CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.cycles_per_ms = self._calibrate() if self.cuda else 0.0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _calibrate(self) -> float:
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        torch.cuda.synchronize()
        return 20_000_000 / start.elapsed_time(end)

    def per_call_ms(self, fn: Callable[[], Any], iters: int) -> list[float]:
        if not self.cuda:
            out = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t) * 1e3)
            return out
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in pairs]

    def gpu_bound_ms(self, fn: Callable[[], Any], iters: int, host_ms_guess: float) -> tuple[float, bool]:
        """The calls queued behind a GPU sleep long enough for the host to enqueue them all: the time
        between the events is then the kernels' alone. Returns (ms per call, whether the host did
        finish enqueueing before the sleep ended)."""
        sleep_ms = min(2000.0, iters * host_ms_guess * 1.2 + 10)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(sleep_ms * self.cycles_per_ms))
        t = time.perf_counter()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        host_ms = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters, host_ms < 0.9 * sleep_ms


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a.float() - b.float()).norm() / b.float().norm()), 6)


class Shape:
    """One (M, K, N): the frozen dense layer, the input and output gradient, and the references."""

    def __init__(self, m: int, k: int, n: int, device: str, seed: int):
        torch.manual_seed(seed)
        self.m, self.k, self.n, self.device = m, k, n, device
        self.dense = nn.Linear(k, n, bias=True, device=device, dtype=torch.bfloat16).requires_grad_(False)
        self.x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        self.g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        w32 = self.dense.weight.float()
        self.y32 = self.x.detach().float() @ w32.t() + self.dense.bias.float()
        self.dx32 = self.g.float() @ w32
        with torch.enable_grad():
            y = self.dense(self.x)
            y.backward(self.g)
        self.y16, self.dx16 = y.detach(), self.x.grad.detach().clone()
        self.x.grad = None

    def free(self) -> None:
        for name in ("dense", "x", "g", "y32", "dx32", "y16", "dx16"):
            setattr(self, name, None)


def measure(shape: Shape, layer: nn.Module, mode: str, clock: Clock, args: argparse.Namespace) -> dict[str, Any]:
    x, g = shape.x, shape.g
    if mode == "compiled":
        torch._dynamo.reset()  # a fresh cache per case: no guard pile-up from earlier cases
        fn = torch.compile(layer, dynamic=False, backend=args.backend)
    else:
        fn = layer
    last: dict[str, torch.Tensor] = {}

    def fwd_bwd() -> None:
        x.grad = None
        y = fn(x)
        if y.grad_fn is None:
            raise RuntimeError("the output has no grad_fn: no gradient flows back to the input")
        y.backward(g)
        last["y"] = y

    t = time.perf_counter()
    fwd_bwd()
    clock.sync()
    first_s = time.perf_counter() - t
    if x.grad is None:
        raise RuntimeError("backward left x.grad None: no input gradient")
    for _ in range(args.warmup - 1):
        fwd_bwd()
    clock.sync()
    res: dict[str, Any] = {"first_call_s": round(first_s, 2)}
    if clock.cuda:  # what the forward keeps alive for the backward, beyond its output
        x.grad, last["y"] = None, None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = fn(x)
        torch.cuda.synchronize()
        res["retained_mb"] = round((torch.cuda.memory_allocated() - before - y.numel() * y.element_size()) / 2**20, 2)
        y.backward(g)
        del y
    times = clock.per_call_ms(fwd_bwd, args.iters)
    res["wall_ms"] = round(statistics.median(times), 4)
    res["wall_ms_min"] = round(min(times), 4)
    if clock.cuda:
        gpu_ms, bound = clock.gpu_bound_ms(fwd_bwd, args.iters, res["wall_ms"])
        res["gpu_ms"], res["gpu_bound"] = round(gpu_ms, 4), bound
    y, dx = last["y"].detach(), x.grad.detach()
    if not bool(torch.isfinite(y).all()) or not bool(torch.isfinite(dx).all()):
        res["nonfinite"] = True
    res.update(rel_err_y=rel(y, shape.y16), rel_err_dx=rel(dx, shape.dx16),
               rel_err_y_fp32=rel(y, shape.y32), rel_err_dx_fp32=rel(dx, shape.dx32))
    res["tflops"] = round(4 * shape.m * shape.k * shape.n / (res.get("gpu_ms") or res["wall_ms"]) / 1e9, 1)
    x.grad = None
    return res


# ---- the run --------------------------------------------------------------------------------------

def torchao_status(device: str) -> tuple[str | None, str | None]:
    """(version, None) when torchao imports, else (None, the reason). On the CPU (--cpu-dry) its
    training recipes run emulated (`emulate=True`) and quantize_ records whatever error it gives."""
    try:
        import torchao
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return None, f"torchao not importable ({type(e).__name__}: {str(e)[:200]}); on the GPU install the wheel (usage line)"
    return torchao.__version__, None


class Recorder:
    def __init__(self, out: Path, deadline_s: float):
        self.out, self.start, self.deadline = out, time.time(), time.time() + deadline_s
        self.result: dict[str, Any] = {"command": "python " + " ".join(sys.argv),
                                       "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                                       "torch": torch.__version__, "cases": [], "unsupported": {},
                                       "skipped": {}, "cut": []}

    def save(self) -> None:
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1))
        tmp.replace(self.out)

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.start:6.1f}s] {msg}", flush=True)


def summarize(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Speedups against bf16 in the same mode at the same shape, and their geometric means."""
    base = {(c["M"], c["K"], c["N"], c["mode"]): c for c in cases if c["variant"] == "bf16" and "wall_ms" in c}
    per: dict[str, dict[str, list[float]]] = {}
    for c in cases:
        ref = base.get((c["M"], c["K"], c["N"], c["mode"]))
        if ref is None or "wall_ms" not in c:
            continue
        for key in ("wall_ms", "gpu_ms"):
            if key in c and key in ref:
                c[f"speedup_{key[:-3]}"] = round(ref[key] / c[key], 3)
                per.setdefault(f"{c['variant']} {c['mode']}", {}).setdefault(key[:-3], []).append(ref[key] / c[key])
    return {name: {f"geomean_speedup_{k}": round(math.exp(sum(map(math.log, v)) / len(v)), 3) for k, v in d.items()}
            | {"shapes": max(len(v) for v in d.values())} for name, d in sorted(per.items())}


def table(cases: list[dict[str, Any]]) -> str:
    """Markdown: one row per shape and mode, one column per variant: kernel ms / per-call ms (x bf16's
    kernel-time speedup), or the error's first words."""
    variants = list(dict.fromkeys(c["variant"] for c in cases))
    rows = list(dict.fromkeys((c["M"], c["K"], c["N"], c["mode"]) for c in cases))
    by = {(c["M"], c["K"], c["N"], c["mode"], c["variant"]): c for c in cases}
    lines = ["| M | K x N | mode | " + " | ".join(variants) + " |", "|---|---|---|" + "---|" * len(variants)]
    for m, k, n, mode in rows:
        cells = []
        for v in variants:
            c = by.get((m, k, n, mode, v))
            if c is None:
                cells.append("")
            elif "error" in c:
                cells.append("error: " + c["error"][:60].replace("|", "/"))
            else:
                speed = c.get("speedup_gpu", c.get("speedup_wall"))
                cells.append(f"{c.get('gpu_ms', '-')} / {c['wall_ms']} (x{speed})")
        lines.append(f"| {m} | {k}x{n} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def inductor_patched() -> bool:
    """Whether torchao's convert_to_float8_training has patched inductor's min/max codegen (it does so
    process-wide, the first time it runs; the product's compiled cases after it compile under it)."""
    patch = sys.modules.get("torchao.float8._inductor_patch")
    return bool(getattr(patch, "_PATCHED", False))


LOGGED = ("wall_ms", "gpu_ms", "gpu_bound", "rel_err_y", "rel_err_dx", "weight_bytes", "retained_mb", "first_call_s", "error")


def run_case(shape: Shape, variant: str, mode: str, clock: Clock, args: argparse.Namespace,
             res: dict[str, Any]) -> dict[str, Any]:
    """Build the variant's layer from the shape's dense one, measure it, add the case to `res`. An
    error is the case's result; a torchao form that fails on the GPU is `unsupported` from then on."""
    device = shape.device
    case: dict[str, Any] = {"variant": variant, "mode": mode, "M": shape.m, "K": shape.k, "N": shape.n}
    if variant.startswith("torchao") and device != "cuda":
        case["emulated_on_cpu"] = True
    try:
        layer = MAKERS[variant](shape.dense, device)
        case["layer"], case["weight_bytes"] = weight_kind(layer), weight_bytes(layer)
        case["inductor_minmax_patched"] = inductor_patched()
        case.update(measure(shape, layer, mode, clock, args))
    except Exception as e:  # noqa: BLE001 - record it and go on with the other cases
        case["error"] = f"{type(e).__name__}: {str(e).strip()[:500]}"
        if variant.startswith("torchao") and device == "cuda":  # e.g. no input gradient through it
            res["unsupported"][f"{variant} {mode}"] = f"unsupported: {case['error']}"
    shape.x.grad = None
    res["cases"].append(case)
    res["summary"] = summarize(res["cases"])
    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-dry", action="store_true", help="CPU, tiny shapes, aot_eager compile: the plumbing only")
    ap.add_argument("--deadline", type=float, default=120.0, help="start no case after this many seconds (H200: ~140 s in all)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per case (median)")
    ap.add_argument("--warmup", type=int, default=3, help="calls before timing (the first compiles)")
    ap.add_argument("--variants", default=",".join(TIER1 + TIER2), help="comma-separated, in priority tiers")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--m", default=None, help="comma-separated token counts (default 4096,16384)")
    ap.add_argument("--backend", default=None, help="torch.compile backend (default inductor; aot_eager in --cpu-dry)")
    args = ap.parse_args()
    device = "cpu" if args.cpu_dry else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: run with --cpu-dry for the plumbing check")
    args.backend = args.backend or ("aot_eager" if args.cpu_dry else "inductor")
    if args.cpu_dry:
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 2)
    ms = [int(v) for v in args.m.split(",")] if args.m else list(DRY_M if args.cpu_dry else M_TOKENS)
    shapes = [(m, k, n) for m in ms for k, n in (DRY_KN if args.cpu_dry else KN)]
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in MAKERS]
    if unknown:
        sys.exit(f"unknown --variants {unknown}; known: {', '.join(MAKERS)}")
    modes = [v for v in args.modes.split(",") if v]

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out, args.deadline)
    res = rec.result
    version, why_not = torchao_status(device)
    res["torchao"] = {"version": version, "skip_reason": why_not}
    res.update(device=device, backend=args.backend, iters=args.iters, warmup=args.warmup, bias=True,
               dtype="bfloat16", shapes=[list(s) for s in shapes])
    if device == "cuda":
        res["gpu"] = torch.cuda.get_device_name(0)
        res["capability"] = list(torch.cuda.get_device_capability(0))
    torch._dynamo.config.cache_size_limit = 64
    from stages.core.runtime import torch_flags

    clock = Clock(device)
    # bf16 and the product first at every shape, torchao's own forms after, its extra recipes last
    tiers = [[v for v in TIER1 if v in variants], [v for v in variants if v not in TIER1]]
    with torch_flags(True, False, True):
        for tier in tiers:
            for m, k, n in shapes:
                if why_not:
                    res["skipped"].update({v: why_not for v in tier if v.startswith("torchao")})
                todo = [(v, mode) for v in tier for mode in modes if not (why_not and v.startswith("torchao"))]
                if not todo:
                    continue
                if time.time() > rec.deadline:
                    res["cut"] += [f"{v} {mode} {m}x{k}x{n}" for v, mode in todo]
                    continue
                shape = Shape(m, k, n, device, seed=m + k + n)
                for variant, mode in todo:
                    name = f"{variant} {mode} {m}x{k}x{n}"
                    if f"{variant} {mode}" in res["unsupported"]:
                        continue
                    if time.time() > rec.deadline:
                        res["cut"].append(name)
                        continue
                    t = time.time()
                    case = run_case(shape, variant, mode, clock, args, res)
                    rec.log(f"{name} ({time.time() - t:.1f}s): " + json.dumps({k2: v2 for k2, v2 in case.items() if k2 in LOGGED})[:400])
                    rec.save()
                shape.free()
                if device == "cuda":
                    torch.cuda.empty_cache()
    for what, why in res["skipped"].items():
        print(f"skipped {what}: {why}")
    for what, why in res["unsupported"].items():
        print(f"{what}: {why[:300]}")
    print(json.dumps(res.get("summary", {}), indent=1))
    res["table_md"] = table(res["cases"])
    print("cells: kernel ms / per-call ms (x bf16 kernel-time speedup, same mode)\n" + res["table_md"])
    res["total_s"] = round(time.time() - rec.start, 1)
    rec.save()


if __name__ == "__main__":
    main()
