"""Where cuDNN's SDPA backward dies on this stack, and what it would save (a GPU probe, not a test).

FLUX.1 Kontext at 1024 px (8,704 tokens, 24 heads of 128) crashed in cuDNN attention's backward every
time (bench/LOG.md); klein at 4,608 tokens ran. Each case here runs in its own process (an
illegal memory access poisons the CUDA context) and reports ok/crash and the forward+backward time
of cuDNN against flash attention for the same shape.

    python3 bench/sdpa_probe.py --out $OUT/sdpa-probe.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CASES = [
    # (name, seq, heads, layout): layout "bshd" is diffusers' (B, S, H, D) projection viewed as (B, H, S, D)
    ("s4608-bshd", 4608, 24, "bshd"),
    ("s8192-bshd", 8192, 24, "bshd"),
    ("s8704-bshd", 8704, 24, "bshd"),
    ("s8704-contig", 8704, 24, "contig"),
    ("s8704-h12x2", 8704, 24, "split2"),
    ("s8704-q2", 8704, 24, "qsplit2"),
    ("s8704-pad8960", 8704, 24, "pad"),
    ("s9216-bshd", 9216, 24, "bshd"),
    ("s12288-bshd", 12288, 24, "bshd"),
]


def one(seq: int, heads: int, layout: str, backend: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    g = torch.Generator(device="cuda").manual_seed(0)

    def make() -> torch.Tensor:
        t = torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        if layout == "contig":
            return t.transpose(1, 2).contiguous().requires_grad_(True)
        return t.requires_grad_(True)

    q, k, v = make(), make(), make()
    dout = torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16, generator=g)

    def attn() -> torch.Tensor:
        qq, kk, vv = (t if layout == "contig" else t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(be):
            if layout == "split2":
                h = heads // 2
                out = torch.cat([F.scaled_dot_product_attention(qq[:, i:i + h], kk[:, i:i + h], vv[:, i:i + h])
                                 for i in (0, h)], dim=1)
            elif layout == "qsplit2":  # queries in two halves, each against every key: the same result
                h = seq // 2
                out = torch.cat([F.scaled_dot_product_attention(qq[:, :, i:i + h], kk, vv) for i in (0, h)], dim=2)
            elif layout == "pad":
                pad = (-seq) % 256 + 256  # a key/value tail masked out: 8,704 -> 8,960
                kp = F.pad(kk, (0, 0, 0, pad)); vp = F.pad(vv, (0, 0, 0, pad))
                mask = torch.zeros(1, 1, 1, seq + pad, device="cuda", dtype=torch.bfloat16)
                mask[..., seq:] = float("-inf")
                out = F.scaled_dot_product_attention(qq, kp, vp, attn_mask=mask)
            else:
                out = F.scaled_dot_product_attention(qq, kk, vv)
        return out if layout == "contig" else out.transpose(1, 2)

    times = []
    for i in range(6):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        out = attn()
        out.backward(dout if layout != "contig" else dout.transpose(1, 2))
        torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
        q.grad = k.grad = v.grad = None
    times = sorted(times[2:])
    flops = 4 * seq * seq * 128 * heads * 3.5  # forward 1x, backward 2.5x
    med = times[len(times) // 2]
    return {"ok": True, "ms": round(med * 1e3, 2), "tflops": round(flops / med / 1e12, 1)}


def run_case(argv: list[str], env: dict[str, str] | None = None) -> dict:
    """One case in its own Python process (a CUDA error poisons the process's context): the JSON line it
    printed last, or {"ok": False} with its exit status and its last error lines."""
    try:
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "err": "timeout"}
    last = (r.stdout.strip().splitlines() or [""])[-1]
    if r.returncode == 0 and last.startswith("{"):
        return json.loads(last)
    errs = [ln for ln in r.stderr.splitlines() if "Error" in ln or "error" in ln]
    return {"ok": False, "rc": r.returncode, "err": errs[-3:] or r.stderr[-600:]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--case", default=None)
    p.add_argument("--backend", default="cudnn")
    a = p.parse_args()
    if a.case:
        name, seq, heads, layout = next(c for c in CASES if c[0] == a.case)
        print(json.dumps(one(seq, heads, layout, a.backend)))
        return
    rows = []
    for name, *_ in CASES:
        for backend in ("cudnn", "flash"):
            row = run_case([__file__, "--out", a.out, "--case", name, "--backend", backend])
            row.update(case=name, backend=backend)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(a.out, "w") as f:
        json.dump({"probe": __file__.split("/")[-1], "rows": rows}, f, indent=1)  # a dict: bench.py report reads every file of bench/results


if __name__ == "__main__":
    main()
