"""The LoRA files the tools read and write, as one module -> Factors table.

    from stages.tools.lora_files import read_lora, write_lora

Three formats:
- diffusers: this project's `pytorch_lora_weights.safetensors` (peft keys `<prefix>.<module>.lora_A.weight`,
  the LoRA config with alpha in the header's `lora_adapter_metadata`); and diffusers files of other
  trainers (no config: alpha = rank, as diffusers' loader assumes). Modules are the denoiser's paths.
- comfyui: this project's `<run>_comfyui.safetensors` (`<name>.lora_up.weight`, `.lora_down.weight`,
  `.alpha`, names from the family's `ComfyLayout`).
- kohya: sd-scripts-style files (`lora_unet_<name>.lora_up.weight`, `.lora_down.weight`, `.alpha`), this
  project's `--format kohya` file or another trainer's. A missing `.alpha` means alpha = rank.
comfyui and kohya files keep their own module names: merged, resized and written back as they are. A
diffusers table (named by module path) can be written in any of the three, through the export's writers.
The family comes from the header (`lorapipe_family`, which every export file carries) or `--family`.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stages.core.errors import UserError
from stages.tools.lowrank import Factors

FORMATS = ("diffusers", "comfyui", "kohya")
PREFIXES = ("transformer", "unet")  # the denoiser's top-level key in diffusers LoRA files
HASH_KEYS = ("sshs_model_hash", "sshs_legacy_hash")  # sd-scripts' hashes of the tensors: stale once they change


class LoraFileError(UserError, ValueError):
    """A LoRA file the tools cannot read or write; the message names the file, the key and what to do."""


@dataclass
class LoraFile:
    path: Path
    format: str
    modules: dict[str, Factors]
    """diffusers: denoiser module path -> factors; comfyui, kohya: the file's module name -> factors."""
    family: str | None = None
    prefix: str | None = None
    """diffusers: the denoiser's top-level key ("transformer", "unet")."""
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def by_path(self) -> bool:
        """Modules are named by their diffusers module path (so any format can be written)."""
        return self.format == "diffusers"


def read_lora(path: str | Path, family: str | None = None) -> LoraFile:
    """Read one LoRA file; LoraFileError naming the file and key for anything that is not a plain LoRA."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise LoraFileError(f"'{path}' does not exist or is not a file; give the path of a .safetensors LoRA file")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged header
        raise LoraFileError(f"'{path}' is not a readable safetensors file ({type(e).__name__}: {str(e)[:120]})") from e
    if not tensors:
        raise LoraFileError(f"'{path}' holds no tensors; give a LoRA file")
    named = _family(path, metadata.get("lorapipe_family"), family)
    if any(re.search(r"\.lora_[AB]\.weight$", k) for k in tensors):
        prefix, modules = _diffusers_modules(path, tensors, metadata)
        return LoraFile(path, "diffusers", modules, named, prefix, metadata)
    if any(k.endswith((".lora_up.weight", ".lora_down.weight")) for k in tensors):
        fmt = "comfyui" if "lorapipe_adapter" in metadata or path.name.endswith("_comfyui.safetensors") else "kohya"
        return LoraFile(path, fmt, _up_down_modules(path, tensors), named, None, metadata)
    raise LoraFileError(f"'{path}' has no LoRA weights (no lora_A/lora_B or lora_up/lora_down keys; e.g. "
                        f"'{next(iter(tensors))}'); LoKr and LoHa files cannot be merged or resized")


def _family(path: Path, stated: str | None, given: str | None) -> str | None:
    from stages.families import FAMILIES

    for name in (given, stated):
        if name is not None and name not in FAMILIES:
            raise LoraFileError(f"unknown family '{name}' (for '{path}'); known: {', '.join(sorted(FAMILIES))}")
    if given and stated and given != stated:
        raise LoraFileError(f"'{path}' was exported for family '{stated}', not '{given}'; drop --family or give "
                            f"--family {stated}")
    return given or stated


def _diffusers_modules(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, dict[str, Factors]]:
    """(prefix, module path -> factors) of a diffusers file, each module's scale from the header's config."""
    from stages.core.kohya import lora_scale

    tops = sorted({k.split(".", 1)[0] for k in tensors})
    prefix = next((t for t in tops if t in PREFIXES), None)
    other = next((k for k in tensors if not k.startswith(f"{prefix}.")), None)
    if prefix is None or other is not None:
        raise LoraFileError(f"'{path}': key '{other or next(iter(tensors))}' is not a denoiser LoRA weight (the tools "
                            f"take the {' or '.join(PREFIXES)} part only); remove the text-encoder layers first")
    config = _adapter_config(path, metadata, prefix)
    if config.get("use_dora"):
        raise LoraFileError(f"'{path}' is a DoRA adapter, whose delta depends on the base weights; the tools take "
                            f"plain LoRA files")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = re.fullmatch(rf"{prefix}\.(.+)\.lora_([AB])\.weight", key)
        if m is None:
            raise LoraFileError(f"'{path}': key '{key}' is not a lora_A/lora_B weight (DoRA magnitudes and biases "
                                f"cannot be merged); the tools take plain LoRA files")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    modules = {}
    for module, p in sorted(pairs.items()):
        if set(p) != {"A", "B"}:
            raise LoraFileError(f"'{path}': module '{module}' has lora_{next(iter(p))} but not its other half; "
                                f"the file is damaged")
        _check_pair(path, module, p["A"], p["B"])
        modules[module] = Factors(p["A"].float(), p["B"].float(), lora_scale(config, module, p["A"].shape[0]))
    return prefix, modules


def _adapter_config(path: Path, metadata: dict[str, str], prefix: str) -> dict[str, Any]:
    """The LoRA config under the header's `lora_adapter_metadata` (keys `<prefix>.r`, ...); empty when there
    is none (then alpha = rank, as diffusers' loader assumes)."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return {}
    try:
        packed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LoraFileError(f"'{path}': its header's lora_adapter_metadata is not JSON ({e}); the file is damaged") from e
    return {k[len(prefix) + 1:]: v for k, v in packed.items() if k.startswith(f"{prefix}.")}


def _up_down_modules(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Factors]:
    from stages.core.comfyui import group_keys

    groups, odd = group_keys(tensors)
    if odd:
        raise LoraFileError(f"'{path}': key '{odd[0]}' is not a lora_up/lora_down/alpha tensor; the tools take plain "
                            f"LoRA files")
    modules = {}
    for stem, parts in sorted(groups.items()):
        extra = sorted(set(parts) - {"lora_up", "lora_down", "alpha"})
        if extra:
            raise LoraFileError(f"'{path}': key '{parts[extra[0]]}' ({extra[0]}) is not a plain LoRA part (DoRA and "
                                f"LyCORIS modules cannot be merged)")
        if "lora_up" not in parts or "lora_down" not in parts:
            raise LoraFileError(f"'{path}': module '{stem}' lacks its {'lora_up' if 'lora_up' not in parts else 'lora_down'}"
                                f" weight; the file is damaged")
        down, up = tensors[parts["lora_down"]].float(), tensors[parts["lora_up"]].float()
        _check_pair(path, stem, down, up)
        alpha = float(tensors[parts["alpha"]]) if "alpha" in parts else None
        modules[stem] = Factors(down, up, alpha / down.shape[0] if alpha is not None else 1.0)
    return modules


def _check_pair(path: Path, module: str, down: torch.Tensor, up: torch.Tensor) -> None:
    if down.dim() not in (2, 4) or up.dim() != down.dim() or up.shape[1] != down.shape[0]:
        raise LoraFileError(f"'{path}': module '{module}' has down {tuple(down.shape)} and up {tuple(up.shape)}, "
                            f"which are not the two factors of one LoRA layer; the file is damaged")


# ---- writing -----------------------------------------------------------------------------------------------


def peft_adapter(modules: dict[str, Factors]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A table named by module path as a peft LoRA state dict and config (scale folded into lora_B, alpha =
    rank per module; modules of another rank than the most common one get a rank and alpha pattern)."""
    from collections import Counter

    from stages.core.lora import config_dict, lora_config

    ranks = {m: f.rank for m, f in modules.items()}
    rank = Counter(ranks.values()).most_common(1)[0][0]
    # anchored at the path's start: peft matches a pattern against the end of each dotted path, so a bare
    # `proj_out` would also give its rank to `single_transformer_blocks.0.proj_out` (diffusers anchors its own)
    pattern = {f"^{re.escape(m)}": r for m, r in ranks.items() if r != rank}
    state: dict[str, torch.Tensor] = {}
    for m, f in modules.items():
        state[f"{m}.lora_A.weight"] = f.down.contiguous()
        state[f"{m}.lora_B.weight"] = (f.up * f.scale).contiguous()
    config = lora_config(rank, rank, 0.0, sorted(modules), "lora", pattern, {k: float(v) for k, v in pattern.items()})
    return state, config_dict(config)


def file_manifest(family: str) -> dict[str, Any]:
    """The few export-manifest fields the export's writers read, for a family."""
    from stages.families import get_family

    fam = get_family(family)
    return {"family": family, "pipeline_class": fam.pipeline_class, "lora_prefix": fam.lora_prefix}


def write_lora(out: Path, fmt: str, source: LoraFile, den: Any, note: dict[str, str]) -> Path:
    """Write `source`'s modules to `out` in `fmt`, atomically, `note` added to the header. A table named by
    module path goes through the export's writers (diffusers: the pipeline's save_lora_weights; comfyui: the
    family's ComfyLayout, which for SDXL reads the denoiser's config; kohya: its kohya layout, which sizes the
    untrained members of a fused layer from the denoiser's widths); comfyui and kohya tables are written back
    under their own names. `den`: the stages.tools.lora_checks.Denoiser of the family."""
    if not source.by_path:
        if fmt != source.format:
            raise LoraFileError(f"'{source.path}' is a {source.format} file, whose module names are not the denoiser's "
                                f"paths: it can only be written as {source.format} (drop --format {fmt})")
        return _write_up_down(out, source, note)
    if source.family is None:
        raise LoraFileError(f"'{source.path}' names no family (its header has no lorapipe_family), which writing a "
                            f"{fmt} file needs: give --family")
    state, lora_cfg = peft_adapter(source.modules)
    manifest = file_manifest(source.family)
    if fmt == "diffusers":
        from stages.core.caches import write_diffusers

        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
            os.replace(write_diffusers(state, lora_cfg, manifest, Path(tmp), note), out)
        return out
    tensors, metadata = _export_tensors(fmt, state, lora_cfg, manifest, den)
    from stages.core.artifacts import save_safetensors

    save_safetensors(out, tensors, {**metadata, **note})
    return out


def _export_tensors(fmt: str, state: dict[str, torch.Tensor], lora_cfg: dict[str, Any], manifest: dict[str, Any],
                    den: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and header of the export's ComfyUI-ready or kohya file for a peft LoRA."""
    from stages.families import get_family

    family = get_family(manifest["family"])
    if fmt == "comfyui":
        from stages.core.comfyui_file import TrainedDeltas, comfyui_state, metadata

        tensors = comfyui_state(TrainedDeltas(state, lora_cfg), family.comfyui_layout, den.config)
        return tensors, metadata(lora_cfg, manifest, len(state) // 2)
    from stages.core.kohya import kohya_metadata, kohya_state

    widths = {m: shape[0] for m, shape in den.shapes((torch.nn.Linear,)).items()}
    tensors, sources = kohya_state(state, lora_cfg, family.kohya_layout, widths)
    return tensors, kohya_metadata(lora_cfg, manifest, len(sources))


def _write_up_down(out: Path, source: LoraFile, note: dict[str, str]) -> Path:
    """A comfyui or kohya table under its own names: lora_up with the scale folded in, alpha = rank, and the
    source header with its rank and alpha updated and sd-scripts' tensor hashes dropped."""
    from stages.core.artifacts import save_safetensors

    tensors: dict[str, torch.Tensor] = {}
    for name, f in source.modules.items():
        tensors[f"{name}.lora_down.weight"] = f.down.contiguous()
        tensors[f"{name}.lora_up.weight"] = (f.up * f.scale).contiguous()
        tensors[f"{name}.alpha"] = torch.tensor(float(f.rank))
    ranks = sorted({f.rank for f in source.modules.values()})
    metadata = {k: v for k, v in source.metadata.items() if k not in HASH_KEYS}
    if "ss_network_dim" in metadata or source.format == "kohya":
        metadata.update(ss_network_dim=str(ranks[-1]), ss_network_alpha=str(ranks[-1]))
    metadata.pop("lorapipe_trained_alpha", None)
    save_safetensors(out, tensors, {**metadata, **note})
    return out
