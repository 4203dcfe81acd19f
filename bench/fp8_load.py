"""Host and GPU memory of train's fp8 load: the folder's shards streamed tensor by tensor
(stages/core/fp8.py `load_fp8_streamed`) against reading the bf16 base whole and quantizing it layer by
layer (`from_pretrained(torch_dtype=bf16)` + `quantize_denoiser_fp8`, what a single-file checkpoint still
takes). A FLUX.1-dev transformer at full width with fewer blocks (random weights, saved in 2 GB shards),
each load in its own process; its peak anonymous host memory (sampled RssAnon: the
mmapped shard pages the kernel can drop are not counted; VmHWM, which counts them, beside it) and, on
CUDA, the GPU peak.

    python bench/fp8_load.py --out fp8-load.json [--layers 2 --single-layers 4] [--device cuda] [--file-dtype float32]

On the CPU the fp8 weights themselves land in host memory, so both figures include them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(folder: Path, layers: int, single_layers: int, file_dtype: str) -> float:
    """A full-width FLUX.1-dev transformer with `layers` + `single_layers` blocks, saved in `file_dtype`
    (released FLUX.1 files are bf16; some conversions ship fp32); its bf16 GB."""
    import torch
    from diffusers import FluxTransformer2DModel

    from stages.families.flux.full import TRANSFORMER

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**{**TRANSFORMER, "num_layers": layers, "num_single_layers": single_layers})
    model.to(getattr(torch, file_dtype)).save_pretrained(folder, max_shard_size="2GB")
    return sum(p.numel() * 2 for p in model.parameters()) / 2**30


def _status_kb(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(f"{field}:"))
    return int(line.split()[1])


class AnonPeak(threading.Thread):
    """The peak of RssAnon (memory the process owns, not the safetensors files' mmapped pages, which the
    kernel can drop), sampled every 2 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kb, self.done = 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.002):
            self.peak_kb = max(self.peak_kb, _status_kb("RssAnon"))


def load(folder: Path, mode: str, device: str) -> dict[str, float]:
    """One load in this process (a child of `main`): its seconds and peaks."""
    import torch
    from diffusers import FluxTransformer2DModel

    from stages.core import fp8
    from stages.core.model_source import ModelSource

    sampler = AnonPeak()
    sampler.start()
    start = time.perf_counter()
    if mode == "streamed":
        src = ModelSource(str(folder.parent))
        model = fp8.load_fp8_streamed(FluxTransformer2DModel, src.weight_files(folder.name),
                                      src.component_config(folder.name), device)
        assert model is not None, "the folder's keys did not match the model's"
    else:
        model = FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16)
        model = fp8.quantize_denoiser_fp8(model, fp8.inside_repeated_blocks(model), device)
    out = {"seconds": round(time.perf_counter() - start, 2),
           "host_anon_peak_gb": round(max(sampler.peak_kb, _status_kb("RssAnon")) / 2**20, 3),
           "host_peak_gb_with_file_pages": round(_status_kb("VmHWM") / 2**20, 3),
           "fp8_gb": round(fp8.fp8_bytes(model) / 2**30, 3)}
    if device == "cuda":
        out["gpu_peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--single-layers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--file-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--child", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(load(Path(args.child[0]), args.child[1], args.device)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "transformer"
        bf16_gb = build(folder, args.layers, args.single_layers, args.file_dtype)
        rows = {}
        for mode in ("whole", "streamed"):
            cmd = [sys.executable, __file__, "--out", args.out, "--device", args.device, "--child", str(folder), mode]
            rows[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    result = {"command": " ".join(sys.argv), "device": args.device, "file_dtype": args.file_dtype,
              "blocks": [args.layers, args.single_layers],
              "bf16_gb": round(bf16_gb, 3), "loads": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
