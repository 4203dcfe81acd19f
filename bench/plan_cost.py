"""Seconds each GPU stage process spends planning before it loads weights, on CPU.

    python bench/plan_cost.py --family qwen-image --work /tmp/plan-cost      # this checkout
    PYTHONPATH=<another checkout> python bench/plan_cost.py ...               # the same measured on other code

A GPU stage plans more than once before it loads anything: its own plan (`memory.plan_stage`), and
the fingerprints of its cache and the upstream ones (`layout_parts` asks what cache-latents or
encode-captions would plan, and under "auto" that plans train too). Each plan builds its components
on the meta device. This times what each stage's `run` computes before loading, on a config-only
full-size model (the family's full-size configs from bench/full_configs.py, no weights), with a GPU
simulated (`pick_device` -> cuda, budget "auto" = 80 GB: nothing here touches CUDA). The component
classes are imported once before timing; each process is timed as fresh (the meta cache emptied),
best of 3.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.pop(0)  # bench/ itself (its bench.py would shadow the package)
sys.path.append(str(ROOT))  # after PYTHONPATH, so another checkout's stages/ can be measured


def config_only_model(family: str, folder: Path) -> Path:
    """The family's tiny pipeline folder with every component's config.json replaced by the full-size one
    and no weights (planning reads configs only)."""
    from bench.full_configs import FULL, build_module
    from stages.families import demo_variant
    from stages.tiny.models import build_tiny_pipeline

    if (folder / "model_index.json").exists():
        return folder
    build_tiny_pipeline(demo_variant(family), folder, seed=0)
    for name in FULL[family]:
        module = build_module(family, name, "meta")
        for f in (folder / name).glob("*.safetensors*"):
            f.unlink()
        module.save_config(folder / name) if hasattr(module, "save_config") else module.config.save_pretrained(folder / name)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen-image")
    ap.add_argument("--work", default="/tmp/plan-cost")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    import stages
    from stages import cache_latents, encode_captions
    from stages.core import memory, runtime
    from stages.core.config import load_config
    from stages.core.model_source import model_source
    from stages.demo import demo_config
    from stages.families import get_family
    from stages.tiny.shapes import make_demo_dataset

    work = Path(a.work) / a.family
    model = config_only_model(a.family, work / "model")
    data = work / "data"
    if not data.is_dir():
        make_demo_dataset(data, n=4, seed=0)
    cfg = load_config(demo_config(a.family), overrides={"model": str(model), "data.path": str(data),
                                                        "artifacts": str(work / "artifacts"),
                                                        "captions.text_encoder_precision": "auto"})
    runtime.pick_device = lambda name: torch.device("cuda")
    memory.resolve_budget = lambda setting, device, enforce=True: memory.Budget(80.0, "auto")

    class Log:
        def emit(self, *args: Any, **kwargs: Any) -> None:
            pass

    family, src = get_family(a.family), model_source(cfg)
    for c in family.text_components + family.vae_components + family.denoiser_components[:1]:
        if not c.startswith(("tokenizer", "processor")):
            memory.meta_component(src, c)  # imports the class (once per process either way)
    processes = {  # what each stage's run computes before it loads weights
        "encode-captions": lambda: (memory.plan_stage(cfg, family, "encode-captions", Log()),
                                    encode_captions.layout_parts(cfg), encode_captions.layout_parts(cfg)),
        "cache-latents": lambda: (memory.plan_stage(cfg, family, "cache-latents", Log()),
                                  cache_latents.layout_parts(cfg), cache_latents.layout_parts(cfg)),
        "train": lambda: (encode_captions.fingerprint_parts(cfg), cache_latents.fingerprint_parts(cfg),  # check_upstream
                          memory.plan_stage(cfg, family, "train", Log())),
    }
    out: dict[str, Any] = {"family": a.family, "code": str(Path(stages.__file__).parent.parent), "planning_s": {}}
    for stage, work_fn in processes.items():
        times = []
        for _ in range(a.repeats):
            memory.sizes._META_CACHE.clear()  # as a fresh process
            start = time.perf_counter()
            work_fn()
            times.append(time.perf_counter() - start)
        out["planning_s"][stage] = round(min(times), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
