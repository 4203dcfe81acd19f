"""Load an exported LoRA into the family's real diffusers pipeline, as a user would (bench.py runs it).

    python bench/verify_export.py --out verify.json --config configs/flux-dev.toml --model M --run R [--set ...]
    python bench/verify_export.py --out bench/results/export-meta-flux.json --meta flux   # CPU, no weights

`<Pipeline>.from_pretrained(model)` with the real denoiser weights, read first by the denoiser
class's own `from_pretrained` (straight to the GPU there) and passed in; the other components are
skipped (they play no part in loading a denoiser LoRA; a staged folder's stand-ins are never read).
Then `pipe.load_lora_weights(<run>/export)`. Records every warning diffusers and peft log while
loading, and compares the adapter inside the denoiser with the file: the key sets (missing /
unexpected) and the values.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:400])


def verify(model: str, export: Path) -> dict[str, Any]:
    import diffusers
    import torch
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    manifest = json.loads((export / "manifest.json").read_text())
    from stages.families import get_family, pipeline_class

    family = get_family(manifest["family"])
    pipeline_cls, prefix = pipeline_class(family), family.lora_prefix
    index = json.loads((Path(model) / "model_index.json").read_text())
    components = {k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and isinstance(v[-1], str)}
    # weightless parts stay (QwenImage21Pipeline's __init__ tokenizes its system prompt with the processor);
    # not Krea2Pipeline's text_encoder_select_layers list
    skip = {k: None for k in components - {prefix, "scheduler"} if not k.startswith(("tokenizer", "processor"))}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t = time.time()
    # the denoiser read straight to the GPU, shard by shard: a CPU copy first would hold FLUX.2 dev's 64.4 GB
    # in host memory beside its files in /dev/shm (bench/staged.py), more than the 1-GPU host's 125 GB
    denoiser_cls = getattr(diffusers, index[prefix][1])
    placement = {"device_map": device} if device == "cuda" else {}
    denoiser = denoiser_cls.from_pretrained(model, subfolder=prefix, torch_dtype=dtype, **placement)
    pipe = pipeline_cls.from_pretrained(model, torch_dtype=dtype, **skip, **{prefix: denoiser})
    getattr(pipe, prefix).to(device)
    load_s = time.time() - t
    handler = _Collect()
    for name in ("diffusers", "peft"):
        logging.getLogger(name).addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.load_lora_weights(str(export), weight_name="pytorch_lora_weights.safetensors")
    denoiser = getattr(pipe, prefix)
    adapter = next(iter(denoiser.peft_config))
    loaded = get_peft_model_state_dict(denoiser, adapter_name=adapter)
    file = {k.removeprefix(f"{prefix}."): v for k, v in load_file(str(export / "pytorch_lora_weights.safetensors")).items()}
    missing, unexpected = sorted(set(loaded) - set(file)), sorted(set(file) - set(loaded))
    diff = max((float((loaded[k].float().cpu() - file[k].to(loaded[k].dtype).float()).abs().max())
                for k in set(file) & set(loaded)), default=float("nan"))
    messages = handler.messages + [str(w.message)[:400] for w in caught]
    # "No LoRA keys associated to NoneType ... prefix='text_encoder'": that component was skipped above and
    # the file has no keys for it (every key is checked against the denoiser below), so it is not a problem
    skipped = [m for m in messages if m.startswith("No LoRA keys associated to NoneType")]
    bad = [m for m in messages if m not in skipped and ("unexpected" in m.lower() or "missing" in m.lower())]
    return {"pipeline_class": pipeline_cls.__name__, "denoiser": type(denoiser).__name__, "adapter": adapter,
            "tensors_in_file": len(file), "lora_tensors_loaded": len(loaded), "missing": missing[:10],
            "unexpected": unexpected[:10], "max_abs_diff_vs_file": diff, "load_warnings": [m for m in messages if m not in skipped][:10],
            "ignored_skipped_component_warnings": len(skipped),
            "key_warnings": bad[:10], "pipeline_load_s": round(load_s, 1), "device": device,
            "lora_config": {k: manifest.get("lora_config", {}).get(k) for k in ("r", "lora_alpha", "target_modules")},
            "ok": not missing and not unexpected and not bad and diff == 0.0}


def meta_check(family: str, folder: Path) -> dict[str, Any]:
    """Without a GPU: the product's export of a LoRA on the full-size denoiser (built on the meta
    device, the family's default targets, r16) loads through the pipeline's loader with no missing or
    unexpected key (stages.core.verify, which is what `export-lora --verify` runs). The LoRA values
    are random: what is checked is the key layout, which nf4 does not change (peft wraps a
    bitsandbytes Linear4bit under the same names as a Linear)."""
    import torch
    from peft.utils import get_peft_model_state_dict

    from bench.full_configs import build_module, denoiser_name
    from stages.core import lora, verify
    from stages.export_lora import write_diffusers
    from stages.families import get_family

    fam = get_family(family)
    model = build_module(family, denoiser_name(family), "meta")
    config = lora.lora_config(16, 16.0, 0.0, list(fam.default_lora_targets))
    model.add_adapter(config)
    state = {k: torch.randn(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    manifest = {"pipeline_class": fam.pipeline_class, "lora_prefix": fam.lora_prefix}
    folder.mkdir(parents=True, exist_ok=True)
    file = write_diffusers(state, lora.config_dict(config), manifest, folder)
    import diffusers

    skeleton = build_module(family, denoiser_name(family), "meta")
    weights = verify.load_into(skeleton, getattr(diffusers, fam.pipeline_class), file, fam.lora_prefix, "diffusers")
    deltas = verify.delta_weights(skeleton, "diffusers", weights)  # what export --verify builds; computed when read
    delta_gb = deltas.fp32_bytes() / 1e9
    loaded = [n for n, _ in skeleton.named_parameters() if ".diffusers." in n and ".lora_" in n]
    comfy = comfyui_names(fam, build_module(family, denoiser_name(family), "meta"), state, lora.config_dict(config))
    return {"family": family, "pipeline_class": fam.pipeline_class, "denoiser_params_b": round(
        sum(p.numel() for p in model.parameters() if not p.requires_grad) / 1e9, 3), "tensors_in_file": len(state),
            "deltas_fp32_gb_if_held": round(delta_gb, 1),
            "lora_tensors_loaded": len(loaded), "targets": list(fam.default_lora_targets),
            "comfyui": comfy, "ok": len(loaded) == len(state) and comfy["ok"],
            "checked_with": "stages.core.verify.load_into (missing/unexpected/shape) on a meta-device skeleton; the "
                            "ComfyUI file by stages.core.comfyui.check_names against ComfyUI's key map"}


def comfyui_names(fam: Any, skeleton: Any, state: dict[str, Any], lora_cfg: dict[str, Any]) -> dict[str, Any]:
    """The ComfyUI file of the same LoRA, keys and shapes against ComfyUI's key map of the full-size model."""
    import torch

    from stages.core import comfyui
    from stages.core.comfyui_file import TrainedDeltas, comfyui_state

    config = dict(skeleton.config)
    shapes = {n: tuple(m.weight.shape) for n, m in skeleton.named_modules()
              if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    deltas = TrainedDeltas(state, lora_cfg)
    tensors = comfyui_state(deltas, fam.comfyui_layout, config)
    report = comfyui.check_names("comfyui", tensors, comfyui.key_map(fam.comfyui_layout, shapes, config), list(deltas))
    return {"keys": report.keys, "keys_loaded": report.keys - len(report.not_loaded), "modules": len(deltas),
            "missing": report.missing[:5], "shape_errors": report.shape_errors[:5], "ok": not report.problems()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--meta", default="", help="family: check the export key layout at full size on CPU instead")
    ap.add_argument("--config")
    ap.add_argument("--model")
    ap.add_argument("--run")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    if args.meta:
        import tempfile

        result = meta_check(args.meta, Path(tempfile.mkdtemp()))
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        return
    from stages.core.config import load_config, parse_override

    cfg = load_config(args.config, {**dict(parse_override(s) for s in args.sets), "run": args.run, "model": args.model})
    result = verify(args.model, cfg.run_dir / "export")
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    if not result["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
