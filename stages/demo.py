"""The built-in demo: tiny random-weight model + drawn-shapes dataset, every stage on CPU.

    lorapipe demo [--family flux]        (what `make demo` runs)

Builds (once) a tiny model of the family's real architecture with the real diffusers/transformers
classes and saves it as an ordinary pipeline folder under artifacts/demo-assets/, writes a small
dataset of drawn shapes with captions, runs `pipeline.py run` (each stage a child process), then the
`sample` stage (its own process: the same prompts and seeds through the family's real pipeline,
base | kept checkpoints | final LoRA, into artifacts/<run>/samples/grid.png) and `report` (loss, LR
and samples/s over steps into artifacts/<run>/report.png).

The base model has random weights, so its images are noise: the grid shows that the adapter loads
and changes the output the same way for every seed, not pretty pictures. The edit families' demo
models are the exception (their DEMO_MODEL_VARIANT, weights set so that the base reproduces the
control, stages/tiny/copy_edit.py): their grids show the edit learnt, and the sample stage measures
it (stages/edit_error.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "artifacts" / "demo-assets"  # where the demo configs (configs/demo*.toml) read model and data


def _shown(path: Path) -> Path:
    """A path as the demo prints it: relative to the working folder where it lies inside it."""
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def demo_config(family: str) -> Path:
    """The family's demo config (its DEMO_CONFIG, under configs/)."""
    from stages.families import family_part

    return ROOT / "configs" / family_part(family).DEMO_CONFIG


def build_assets(family: str) -> None:
    from stages.core.runtime import quiet_libraries
    from stages.families import library_notices
    from stages.families import demo_model_variant
    from stages.tiny.models import build_tiny_pipeline
    from stages.tiny.shapes import make_clip_dataset, make_demo_dataset, make_edit_dataset

    quiet_libraries(notices=library_notices())  # the build saves pipelines: no loading bars or torchvision notices, as in every stage
    variant = demo_model_variant(family)
    model = ASSETS / variant
    if not (model / "model_index.json").exists():
        print(f"demo: building tiny {variant} pipeline in {_shown(model)}", flush=True)
        build_tiny_pipeline(variant, model, seed=0)
    if demo_data_kind(family) == "edit":  # edit families: control -> target pairs (the shape turns blue)
        sizes = demo_edit_sizes(family)
        data = ASSETS / ("data-edit" + "".join(f"-{w}x{h}" for w, h in sizes or ()))
        if not data.exists():
            print(f"demo: drawing the edit pairs in {_shown(data)}", flush=True)
            make_edit_dataset(data, n=12, seed=0, **({"sizes": sizes} if sizes else {}))
        return
    if demo_data_kind(family) == "clips":  # video families: moving-shape clips and two stills
        data = ASSETS / "data-clips"
        if not data.exists():
            print(f"demo: drawing the moving-shapes clips in {_shown(data)}", flush=True)
            make_clip_dataset(data, n=8, seed=0)
        return
    data = ASSETS / "data"
    if not data.exists():
        print(f"demo: drawing the shapes dataset in {_shown(data)}", flush=True)
        make_demo_dataset(data, n=12, seed=0)


def demo_edit_sizes(family: str) -> tuple[tuple[int, int], ...] | None:
    """The edit pairs' image sizes where the family names them (DEMO_EDIT_SIZES; its demo config reads
    `data-edit-<w>x<h>...`), else None: make_edit_dataset's mixed aspects in `data-edit`."""
    from stages.families import demo_hint

    return demo_hint(family, "DEMO_EDIT_SIZES", None)


def demo_data_kind(family: str) -> str:
    """"shapes" (captioned drawings), "edit" (edit pairs) or "clips" (moving shapes): the family's DEMO_DATA,
    shapes by default."""
    from stages.families import demo_hint

    return demo_hint(family, "DEMO_DATA", "shapes")


# The tiny models render 64 px in milliseconds per step; 8 steps keep the demo's grid quick.
DEMO_SAMPLE = ("sample.steps=8", "sample.every_n_checkpoints=1")


def _pipeline(*args: str) -> None:
    code = subprocess.call([sys.executable, str(ROOT / "pipeline.py"), *args])
    if code != 0:
        raise SystemExit(code)


def run_demo(family: str = "flux", steps: int | None = None) -> None:
    from stages.core.config import load_config

    build_assets(family)
    config = str(demo_config(family))
    # the run's settings: the preset with these (both commands give the same, so the second changes none)
    extra = [a for s in DEMO_SAMPLE + ((f"train.steps={steps}",) if steps else ()) for a in ("--set", s)]
    _pipeline("run", "--config", config, *extra)
    _pipeline("run", "--only", "sample", "--config", config, *extra)  # skipped when up to date
    cfg = load_config(config, {"train.steps": steps} if steps else None)
    _pipeline("report", cfg.run, "--artifacts", cfg.artifacts)
    print(f"demo: sample grid (base | checkpoints | LoRA) -> {shown_grid(cfg.run_dir / 'samples')}")
    closing_edit_line(cfg.run_dir / "samples")


def shown_grid(samples: Path) -> Path:
    """The grid to look at: a video family's animated grid.webp (its grid.png holds each clip's middle frame only),
    else grid.png."""
    from stages.sample import CLIP_GRID, GRID

    return samples / CLIP_GRID if (samples / CLIP_GRID).exists() else samples / GRID


def closing_edit_line(samples: Path) -> None:
    """Edit families: how much closer the LoRA's outputs came to the targets than the base's, as the
    sample stage measured it on this run's own renders (stages/edit_error.py)."""
    from stages.core.artifacts import read_manifest

    manifest = read_manifest(samples) or {}
    if "edit_summary" in manifest:
        print(f"demo: {manifest['edit_summary']}")
