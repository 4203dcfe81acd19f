"""The built-in demo: tiny random-weight model + drawn-shapes dataset, every stage on CPU.

    python pipeline.py demo [--family flux]        (what `make demo` runs)

Builds (once) a tiny model of the family's real architecture with the real diffusers/transformers
classes and saves it as an ordinary pipeline folder under artifacts/demo-assets/, writes a small
dataset of drawn shapes with captions, runs `pipeline.py run` (each stage a child process), then
renders the same prompts with and without the trained LoRA through the family's real pipeline and
`load_lora_weights`, into artifacts/<run>/samples/before_after.png.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path("artifacts/demo-assets")
TINY_VARIANT = {"flux": "flux-dev", "qwen-image": "qwen-image", "z-image": "z-image", "sdxl": "sdxl"}


def demo_config(family: str) -> Path:
    return ROOT / "configs" / ("demo.toml" if family == "flux" else f"demo-{family}.toml")


def build_assets(family: str) -> None:
    from stages.tiny.models import build_tiny_pipeline
    from stages.tiny.shapes import make_demo_dataset

    model = ASSETS / TINY_VARIANT[family]
    if not (model / "model_index.json").exists():
        print(f"demo: building tiny {TINY_VARIANT[family]} pipeline in {model}", flush=True)
        build_tiny_pipeline(TINY_VARIANT[family], model, seed=0)
    data = ASSETS / "data"
    if not data.exists():
        print(f"demo: drawing the shapes dataset in {data}", flush=True)
        make_demo_dataset(data, n=12, seed=0)


def render_before_after(cfg, prompts: list[str], out: Path, size: int = 64, steps: int = 4) -> Path:
    """The same prompts and seeds through the family's pipeline, without then with the LoRA."""
    import diffusers
    import numpy as np
    import torch
    from PIL import Image

    from stages.core.artifacts import read_json

    export = cfg.run_dir / "export"
    manifest = read_json(export / "manifest.json")
    pipe = getattr(diffusers, manifest["pipeline_class"]).from_pretrained(cfg.model)
    rows = []
    for with_lora in (False, True):
        if with_lora:
            pipe.load_lora_weights(str(export), weight_name="pytorch_lora_weights.safetensors")
        images = [pipe(p, height=size, width=size, num_inference_steps=steps, output_type="np",
                       generator=torch.Generator().manual_seed(i)).images[0] for i, p in enumerate(prompts)]
        rows.append(np.concatenate(images, axis=1))
    grid = (np.clip(np.concatenate(rows, axis=0), 0, 1) * 255).round().astype("uint8")
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).resize((grid.shape[1] * 2, grid.shape[0] * 2), Image.Resampling.NEAREST).save(out)
    return out


def run_demo(family: str = "flux", steps: int | None = None) -> None:
    from stages.core.config import load_config
    from stages.core.dataset import scan

    build_assets(family)
    config = demo_config(family)
    extra = ["--set", f"train.steps={steps}"] if steps else []
    code = subprocess.call([sys.executable, str(ROOT / "pipeline.py"), "run", "--config", str(config), *extra])
    if code != 0:
        raise SystemExit(code)
    cfg = load_config(config, {"train.steps": steps} if steps else None)
    prompts = [it.caption for it in scan(cfg.data.path)][:3]
    out = render_before_after(cfg, prompts, cfg.run_dir / "samples" / "before_after.png")
    print(f"demo: base (top) vs LoRA (bottom) for {prompts} -> {out}")
