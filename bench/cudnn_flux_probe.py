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
    # name: (image tokens, checkpointing, batch, guard): image tokens are target + control, two squares;
    # guard: the train stage's wrapper under train.cudnn_attention = true (stages/core/runtime.py cudnn_safe_sdpa:
    # one output-gradient layout per cached cuDNN backward graph)
    "kontext-eager-guard": (8192, False, 1, True),
    "kontext-ckpt-guard": (8192, True, 1, True),
    "kontext-eager": (8192, False, 1, False),
    "half-size-eager": (4608, False, 1, False),
    "tiny": (32, True, 1, True),  # plumbing (PROBE_DEVICE=cpu)
}


def one(img: int, ckpt: bool, batch: int, guard: bool) -> dict:
    import torch
    from diffusers import FluxTransformer2DModel

    torch.backends.cuda.enable_cudnn_sdp(True)
    if guard:
        from stages.core.runtime import cudnn_safe_sdpa

        torch.nn.functional.scaled_dot_product_attention = cudnn_safe_sdpa(torch.nn.functional.scaled_dot_product_attention)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = FluxTransformer2DModel(num_layers=2, num_single_layers=2, guidance_embeds=True).to(torch.bfloat16)
    model.requires_grad_(False)
    for blk in list(model.transformer_blocks) + list(model.single_transformer_blocks):
        blk.attn.to_q.weight.requires_grad_(True)
    if ckpt:
        model.enable_gradient_checkpointing()
    model.train()
    txt = 512
    x = torch.randn(batch, img, 64, device=DEV, dtype=torch.bfloat16)
    enc = torch.randn(batch, txt, 4096, device=DEV, dtype=torch.bfloat16)
    pooled = torch.randn(batch, 768, device=DEV, dtype=torch.bfloat16)
    side = int((img // 2) ** 0.5)
    rows = torch.arange(side, device=DEV).repeat_interleave(side)
    cols = torch.arange(side, device=DEV).repeat(side)
    half = torch.stack([torch.zeros_like(rows), rows, cols], 1)
    img_ids = torch.cat([half, half + torch.tensor([1, 0, 0], device=DEV)]).float()  # target (0,r,c), control (1,r,c)
    txt_ids = torch.zeros(txt, 3, device=DEV)
    t = torch.full((batch,), 0.5, device=DEV, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    times = []
    for _ in range(3):
        sync(); t0 = time.perf_counter()
        out = model(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled, timestep=t, img_ids=img_ids,
                    txt_ids=txt_ids, guidance=torch.ones(batch, device=DEV), return_dict=False)[0]
        out[:, : img // 2].float().pow(2).mean().backward()
        sync(); times.append(time.perf_counter() - t0)
    return {"ok": True, "s": round(min(times), 4)}


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
        json.dump({"probe": __file__.split("/")[-1], "rows": rows}, f, indent=1)  # a dict: bench.py report reads bench/results/*.json


if __name__ == "__main__":
    main()
