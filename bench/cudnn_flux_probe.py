"""Does cuDNN attention crash inside a FLUX transformer at Kontext's 8,704 tokens, and when (a GPU probe).

bench/sdpa_probe.py found cuDNN's SDPA forward+backward alone fine at 4,608-12,288 tokens (24 heads of 128,
diffusers' layout), ~1.9x flash's speed, while FLUX.1 Kontext at 1024 px died in its first backward with it
(the product and diffusers' script). This runs a FluxTransformer2DModel of FLUX.1's widths with 2 double- and
2 single-stream blocks (random weights) one step each way, every case in its own process.

    python3 bench/cudnn_flux_probe.py --out $OUT/cudnn-flux-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.sdpa_probe import run_case  # noqa: E402  (one case a process)

DEV = os.environ.get("PROBE_DEVICE", "cuda")  # cpu: plumbing only

CASES = {
    # name: (image tokens, checkpointing, batch, guard[, (heads, head dim, text tokens)]): image tokens are target +
    # control, two squares; guard: the train stage's wrapper under runtime.cudnn_attention = true (stages/core/runtime.py
    # cudnn_safe_sdpa: one output-gradient layout per cached cuDNN backward graph); FLUX.1's 24 heads of 128 and 512
    # text tokens unless given
    "kontext-eager-guard": (8192, False, 1, True),
    "kontext-ckpt-guard": (8192, True, 1, True),
    "kontext-eager": (8192, False, 1, False),
    "half-size-eager": (4608, False, 1, False),
    # tests/core/test_fp8.py's tiny FLUX (2 heads of 16, 16 image and 16 text tokens, batch 2) got NaN gradients in its double
    # block's attention under cuDNN, with the guard and without (bench/results/fp8-tiny-probe-modes-h200.json): the
    # tiny widths at FLUX.1's depth here, then FLUX.1's widths at the tiny token count
    "tiny-widths-guard": (32, False, 2, True, (2, 16, 16)),
    "tiny-widths": (32, False, 2, False, (2, 16, 16)),
    "tiny-tokens-guard": (32, False, 2, True, (24, 128, 16)),
    # the tiny widths at 128 tokens (72 image, 56 text): cuDNN's SM90 backward has given NaN where the key length
    # leaves a partial 128-wide tile and a row's logsumexp is very negative (NVIDIA/cudnn-frontend#1072 and the pull
    # request #628 it cites; pytorch/pytorch#196678, there with a mask); 32 tokens leave one, 128 none, and so do Kontext's 8,704 and klein's 4,608 at 1024 px
    "tiny-widths-128-guard": (72, False, 2, True, (2, 16, 56)),
    # the tiny test models' own 32 tokens (one 4x4 image, no control, and 16 text tokens): the guarded probe
    # ran right at 48 (bench/results/cudnn-flux-probe-grads-h200.json) where the whole tiny models' step gives NaN
    "tiny-32-guard": (16, False, 2, True, (2, 16, 16)),
    "tiny-32": (16, False, 2, False, (2, 16, 16)),
    "tiny": (32, True, 1, True),  # plumbing (PROBE_DEVICE=cpu)
}


def one(img: int, ckpt: bool, batch: int, guard: bool, dims: tuple[int, int, int] = (24, 128, 512)) -> dict:
    """One case: three timed steps with cuDNN SDPA allowed, then the case's to_q weight gradients against the same
    step's with cuDNN SDPA off (flash / memory-efficient), block by block: finite, cosine, relative error."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.backends.cuda.enable_cudnn_sdp(True)
    if guard:
        from stages.core.runtime import cudnn_safe_sdpa

        torch.nn.functional.scaled_dot_product_attention = cudnn_safe_sdpa(torch.nn.functional.scaled_dot_product_attention)
    heads, head_dim, txt = dims
    torch.manual_seed(0)
    with torch.device(DEV):
        model = FluxTransformer2DModel(num_layers=2, num_single_layers=2, guidance_embeds=True, num_attention_heads=heads,
                                       attention_head_dim=head_dim,
                                       axes_dims_rope=(16, 56, 56) if head_dim == 128 else (4, 6, 6)).to(torch.bfloat16)
    model.requires_grad_(False)
    blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
    for blk in blocks:
        blk.attn.to_q.weight.requires_grad_(True)
    if ckpt:
        model.enable_gradient_checkpointing()
    model.train()
    x = torch.randn(batch, img, 64, device=DEV, dtype=torch.bfloat16)
    enc = torch.randn(batch, txt, 4096, device=DEV, dtype=torch.bfloat16)
    pooled = torch.randn(batch, 768, device=DEV, dtype=torch.bfloat16)
    control = int((img // 2) ** 0.5) ** 2 * 2 == img  # two squares: target and control; else one square image
    side = int((img // 2 if control else img) ** 0.5)
    rows = torch.arange(side, device=DEV).repeat_interleave(side)
    cols = torch.arange(side, device=DEV).repeat(side)
    half = torch.stack([torch.zeros_like(rows), rows, cols], 1)
    img_ids = (torch.cat([half, half + torch.tensor([1, 0, 0], device=DEV)]) if control else half).float()  # target (0,r,c), control (1,r,c)
    target = img // 2 if control else img
    txt_ids = torch.zeros(txt, 3, device=DEV)  # text tokens: `dims`
    t = torch.full((batch,), 0.5, device=DEV, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    times = []

    def step() -> list[torch.Tensor]:
        for blk in blocks:
            blk.attn.to_q.weight.grad = None
        out = model(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled, timestep=t, img_ids=img_ids,
                    txt_ids=txt_ids, guidance=torch.ones(batch, device=DEV), return_dict=False)[0]
        out[:, :target].float().pow(2).mean().backward()
        return [blk.attn.to_q.weight.grad.float() for blk in blocks]

    for _ in range(3):
        sync(); t0 = time.perf_counter()
        got = step()
        sync(); times.append(time.perf_counter() - t0)
    torch.backends.cuda.enable_cudnn_sdp(False)
    want = step()
    grads = [{"block": i, "finite": bool(g.isfinite().all()),
              "cos": round(float(torch.nn.functional.cosine_similarity(g.flatten(), w.flatten(), dim=0)), 6),
              "rel": round(float((g - w).norm() / w.norm().clamp(min=1e-30)), 6)} for i, (g, w) in enumerate(zip(got, want))]
    return {"ok": True, "s": round(min(times), 4), "grads_vs_flash": grads}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--case", default=None)
    p.add_argument("--only", default=None, help="comma-separated cases")
    a = p.parse_args()
    if a.case:
        print(json.dumps(one(*CASES[a.case])))
        return
    rows = []
    for name in (c for c in CASES if c != "tiny" and (not a.only or c in a.only.split(","))):
        for blocking in ("0", "1"):
            row = run_case([__file__, "--out", a.out, "--case", name], env=dict(os.environ, CUDA_LAUNCH_BLOCKING=blocking))
            row.update(case=name, launch_blocking=blocking)
            print(json.dumps(row)[:700], flush=True)
            rows.append(row)
            if row["ok"]:
                break  # blocking launches only to name a crash
    with open(a.out, "w") as f:
        json.dump({"probe": __file__.split("/")[-1], "date": time.strftime("%Y-%m-%d", time.gmtime()), "rows": rows}, f, indent=1)  # a dict: bench.py report reads bench/results/*.json


if __name__ == "__main__":
    main()
