"""How each export file loads in ComfyUI, per family: keys loaded and strength, by `stages.core.comfyui`'s check.

    .venv/bin/python bench/comfyui_files.py [--out bench/results/comfyui-files.json]

Trains nothing: a random LoRA (rank 4, alpha 8, so a file that loses alpha loads at half strength) on
each family's default targets of its tiny model, written as the diffusers, ComfyUI and kohya files the
export writes, each read through ComfyUI's key map for that family. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def files_for(family: str, folder: Path) -> dict[str, dict]:
    import diffusers
    from peft.utils import get_peft_model_state_dict

    from stages.core import comfyui
    from stages.core.comfyui_file import TrainedDeltas, comfyui_state
    from stages.core.kohya import KohyaError, kohya_state, linear_out_dims
    from stages.core.lora import config_dict, lora_config
    from stages.export_lora import scale_folded
    from stages.families import get_family

    fam = get_family(family)
    config = json.loads((folder / fam.lora_prefix / "config.json").read_text())
    model = getattr(diffusers, config["_class_name"]).from_pretrained(str(folder), subfolder=fam.lora_prefix)
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    cfg = lora_config(4, 8.0, 0.0, list(fam.default_lora_targets))
    model.add_adapter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (p for n, p in model.named_parameters() if "lora_B" in n):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    state = {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}
    lora_cfg = config_dict(cfg)
    deltas = TrainedDeltas(state, lora_cfg)
    kmap = comfyui.key_map(fam.comfyui_layout, shapes, config)
    folded, _ = scale_folded(state, lora_cfg)
    files = {"diffusers": {f"{fam.lora_prefix}.{k}": v for k, v in folded.items()},
             "comfyui": comfyui_state(deltas, fam.comfyui_layout, config)}
    try:
        files["kohya"] = kohya_state(state, lora_cfg, fam.kohya_layout, linear_out_dims(model))[0]
    except KohyaError as e:
        files["kohya"] = {"error": str(e)}
    out = {}
    for name, tensors in files.items():
        if "error" in tensors:
            out[name] = tensors
            continue
        report = comfyui.check(name, tensors, kmap, deltas)
        out[name] = {**report.summary(), "problems": report.problems()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from stages.families import FAMILIES, demo_variant
    from stages.tiny.models import build_tiny_pipeline

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            folder = build_tiny_pipeline(demo_variant(family), Path(tmp) / family)
            rows[family] = files_for(family, folder)
    print("| family | diffusers file | ComfyUI file | kohya file |\n|---|---|---|---|")
    for family, files in rows.items():
        cells = []
        for name in ("diffusers", "comfyui", "kohya"):
            r = files[name]
            cells.append("—" if "error" in r else
                         f"{r['keys_loaded']}/{r['keys']} keys, strength {r['strength_min']:.2f}" if r["modules"]
                         else f"{r['keys_loaded']}/{r['keys']} keys")
        print(f"| {family} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
