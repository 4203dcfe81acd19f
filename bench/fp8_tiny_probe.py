"""Which narrow shapes make the fp8 Linear's forward or input gradient wrong on this GPU (a probe).

On the H200 the tiny-model fp8 LoRA tests (tests/core/test_fp8.py, layers 16-64 wide with min_width=16)
got NaN LoRA gradients in their fp8 blocks while full-size models trained. This sweeps
`_Fp8LinearFn` over (rows, in, out) against the dense bf16 matmul and prints every shape whose
output or input gradient is not finite or is off by more than 10 %.

    python3 bench/fp8_tiny_probe.py --out $OUT/fp8-tiny-probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from stages.core.fp8 import Fp8Linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: plumbing only


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rows_out = []
    for m, k, n in itertools.product((16, 32, 64, 128), (16, 32, 48, 64, 128, 256), (16, 32, 48, 64, 128, 256)):
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False).to(DEV, torch.bfloat16)
        fp8 = Fp8Linear.from_linear(lin, DEV)
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
        y, ref = fp8(x), lin(x)
        (dx,), (dx_ref,) = torch.autograd.grad(y, x, g), torch.autograd.grad(ref, x, g)
        row = {"m": m, "k": k, "n": n, "y_finite": bool(y.isfinite().all()), "dx_finite": bool(dx.isfinite().all()),
               "y_rel": round(rel(y, ref), 4), "dx_rel": round(rel(dx, dx_ref), 4)}
        rows_out.append(row)
        if not (row["y_finite"] and row["dx_finite"]) or row["y_rel"] > 0.1 or row["dx_rel"] > 0.1:
            print("BAD", json.dumps(row), flush=True)
    print(f"{len(rows_out)} shapes, {sum(1 for r in rows_out if r['y_rel'] > 0.1 or r['dx_rel'] > 0.1 or not (r['y_finite'] and r['dx_finite']))} bad")
    found = locate()
    print("\n".join(found))
    modes = attention_modes()
    print(json.dumps(modes))
    with open(a.out, "w") as f:
        json.dump({"probe": "fp8_tiny_probe.py", "shapes": rows_out, "model": found, "attention_modes": modes}, f, indent=1)


def _test_module() -> tuple[Any, Path]:
    """tests/core/test_fp8.py (its step and its tiny FLUX, not copies) and a fresh folder for the tiny model's files."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_fp8  # noqa: E402

    return test_fp8, Path(tempfile.mkdtemp())


def _tiny_flux(test_fp8: Any, assets: Path, base: str) -> torch.nn.Module:
    """The test's tiny FLUX, its block Linears fp8 (min_width=16, as the test) for base "fp8"."""
    from stages.core.fp8 import inside_repeated_blocks, quantize_denoiser_fp8

    model = test_fp8._flux(assets)
    if base == "fp8":
        quantize_denoiser_fp8(model, inside_repeated_blocks(model), DEV, min_width=16)
    return model


def attention_modes(repeats: int = 3) -> list[dict]:
    """tests/core/test_fp8.py's step, bf16 then fp8, `repeats` times under each attention setting (its `attention`
    argument: torch's defaults, the train stage's flags without cuDNN SDPA, cuDNN SDPA with the stage's guard):
    which ones gave a NaN gradient. Where the cuDNN settings fail and "train" does not, the NaN is cuDNN's, not fp8's."""
    test_fp8, assets = _test_module()
    out = []
    for attention in ("torch", "train", "guard"):
        for base in ("bf16", "fp8"):
            ok = 0
            for _ in range(repeats):
                try:
                    test_fp8._lora_step(_tiny_flux(test_fp8, assets, base), attention)
                    ok += 1
                except AssertionError:
                    pass
            out.append({"attention": attention, "base": base, "finite": ok, "of": repeats})
    return out


def locate() -> list[str]:
    """tests/core/test_fp8.py's own LoRA step (`_lora_step`) on the tiny FLUX (fp8 blocks, min_width=16), eager, with a hook on
    every module: the first modules whose output or input gradient is not finite, in the order they ran, then the
    step's result or its assertion (which names the adapter weights without a finite non-zero gradient)."""
    test_fp8, assets = _test_module()
    try:  # the test's order: the bf16 step first, on the same device (torch's flags, as the test had them)
        bf16_loss = test_fp8._lora_step(_tiny_flux(test_fp8, assets, "bf16"), "torch")
    except AssertionError:
        bf16_loss = float("nan")
    model = _tiny_flux(test_fp8, assets, "fp8")
    found: list[str] = []

    def bad(t) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(t.isfinite().all())

    for name, mod in model.named_modules():
        def fwd(m, i, o, name=name):
            outs = o if isinstance(o, tuple) else (o,)
            if any(bad(t) for t in outs) and len(found) < 12:
                found.append(f"forward {name} ({type(m).__name__}) in finite={not any(bad(t) for t in i)}")

        def bwd(m, gi, go, name=name):
            if any(bad(t) for t in gi) and len(found) < 12:
                found.append(f"backward {name} ({type(m).__name__}) grad_out finite={not any(bad(t) for t in go)}")
        mod.register_forward_hook(fwd)
        mod.register_full_backward_hook(bwd)
    try:
        return found + [f"test_fp8._lora_step on {test_fp8.MATMUL_DEVICE}: loss {test_fp8._lora_step(model, 'torch'):.4f} (bf16 "
                        f"{bf16_loss:.4f}), every adapter weight fp32 with a finite non-zero gradient"]
    except AssertionError as e:
        return found + [f"test_fp8._lora_step on {test_fp8.MATMUL_DEVICE}: {str(e)[:600]}"]


if __name__ == "__main__":
    main()
