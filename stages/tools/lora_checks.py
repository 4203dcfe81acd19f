"""The checks a file written by `lorapipe lora` passes before it replaces anything: those of
`export-lora --verify` (stages.core.verify), against the factors the tool meant to write.

    from stages.tools.lora_checks import check_output, denoiser

- Every file: read back by the tools' own reader, every module with the intended delta (1e-4 relative).
- diffusers: loaded through the family pipeline's `lora_state_dict` and the denoiser's `load_lora_adapter`
  (on the meta device) with no missing or unexpected key, and the loaded deltas equal the intended ones.
- comfyui: every key through ComfyUI's key map for the family: it loads and fits its layer; with the base
  model's config (--model) every module also gets its intended delta within 1 %. A failure fails the tool.
- kohya: the same key check, reported as a note (kohya files are not all meant for ComfyUI, as in export).
The denoiser's layers come from the base model's config.json (--model), else from the family's released
config (stages/families/<family>/full.py), built on the meta device: no weights are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from stages.core.verify import VerifyError
from stages.tools.lora_files import LoraFile, read_lora
from stages.tools.lowrank import Factors


@dataclass
class Denoiser:
    """The denoiser's layers as the checks need them, from its config.json alone (no weights)."""

    family: str
    source: str | None
    """where the config came from (the base model, or a denoiser file's folder); None: the family's released config."""
    config: dict[str, Any]

    def skeleton(self) -> torch.nn.Module:
        """A fresh meta-device denoiser (each loaded adapter stays in it)."""
        import diffusers

        with torch.device("meta"):
            return getattr(diffusers, self.config["_class_name"]).from_config(self.config)

    def shapes(self, kinds: tuple[type, ...] = (torch.nn.Linear, torch.nn.Conv2d)) -> dict[str, tuple[int, ...]]:
        """module path -> weight shape, of every layer of `kinds`."""
        return {n: tuple(m.weight.shape) for n, m in self.skeleton().named_modules() if isinstance(m, kinds)}

    def where(self) -> str:
        return f"'{self.source}'" if self.source else f"{self.family}'s released denoiser config (no --model given)"


def denoiser(family: str, model: str | None, config: dict[str, Any] | None = None) -> Denoiser:
    """The family's denoiser from `config` (read by the caller from `model`), from `model`'s config.json (a
    pipeline folder, hub id or single file), or from the family's released config when neither is given."""
    from stages.families import family_part, get_family

    prefix = get_family(family).lora_prefix
    if config is None and model is not None:
        from stages.core.model_source import ModelSource

        config = ModelSource(model).component_config(prefix)
    if config is None:
        with torch.device("meta"):
            released = family_part(family, "full").COMPONENTS[prefix](None)
        config = {**released.config, "_class_name": type(released).__name__}
    return Denoiser(family, model, dict(config))


class FactorDeltas(Mapping[str, torch.Tensor]):
    """name -> delta of a factor table, computed when read."""

    def __init__(self, modules: Mapping[str, Factors]) -> None:
        self.modules = modules

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.modules[name].delta()

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)


def check_output(path: Path, fmt: str, intended: LoraFile, den: Denoiser | None) -> dict[str, Any]:
    """VerifyError naming the file when it does not hold `intended`'s deltas in its readers; else a summary
    with a one-line `note`. Against the released config (no --model), a LoRA whose layers have other shapes
    (another size of the model) is checked by its names only where it can be, and otherwise not, said in the note."""
    _check_read_back(path, intended)
    if den is None:
        return {"note": "ComfyUI key check skipped: no family known (give --family)"}
    other_size = _other_size(intended, den)
    if other_size:
        return {"note": f"layer checks skipped: '{other_size}' does not have the shape it has in {den.where()}; give "
                        f"--model with the LoRA's base model to check against its layers"}
    if fmt == "diffusers":
        return _check_diffusers(path, intended, den)
    report = _comfyui_report(path, intended, den)
    summary = {"keys": report.keys, "keys_loaded": report.keys - len(report.not_loaded)}
    if den.source is None and report.shape_errors and not report.not_loaded:
        return {**summary, "note": f"ComfyUI's key map has every name; shapes not checked: they differ from "
                                   f"{den.where()} ({report.shape_errors[0]}); give --model to check them"}
    problems = report.problems()
    if problems and fmt == "comfyui":
        raise VerifyError(f"{path.name}: in ComfyUI {'; '.join(problems)} (checked against {den.where()}). "
                          f"Nothing was written")
    if problems:
        summary["note"] = f"{path.name} is not ComfyUI-ready ({problems[0]}); ComfyUI loads the comfyui format"
    else:
        summary["note"] = f"ComfyUI loads {summary['keys_loaded']}/{report.keys} keys ({den.where()})"
    return summary


def _other_size(intended: LoraFile, den: Denoiser) -> str | None:
    """Against the released config: the first module of a table by path whose shape differs there (None
    with the base model's config, or when all fit; comfyui and kohya names are checked by ComfyUI's map)."""
    if den.source is not None or not intended.by_path:
        return None
    shapes = den.shapes()
    return next((m for m, f in intended.modules.items() if m in shapes and shapes[m] != f.shape), None)


def _check_read_back(path: Path, intended: LoraFile) -> None:
    back = read_lora(path, intended.family)
    if back.by_path != intended.by_path or set(back.modules) != set(intended.modules):
        if back.by_path == intended.by_path:
            lost = sorted(set(intended.modules) ^ set(back.modules))
            raise VerifyError(f"{path.name}: read back, its modules differ from those written: {lost[:5]}")
        return  # another naming (a table by path written as comfyui or kohya): the key checks below compare it
    _compare(path, FactorDeltas(intended.modules), FactorDeltas(back.modules))


def _compare(path: Path, want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], rtol: float = 1e-4,
             reader: str = "the tools' own reader") -> None:
    """VerifyError when `got` (the file as `reader` reads it) is not the deltas the tool computed: the file
    is then not moved into place, which the message says, with the ways around it."""
    from stages.core.verify import compare_deltas

    try:
        compare_deltas(want, got, path, rtol, against="the delta the tool computed for it")
    except VerifyError as e:
        raise VerifyError(f"{e} as {reader} reads the file; nothing was written to '{path.name}'. Give every module "
                          f"one rank (--rank R), or write another format (--format comfyui)") from None


def _check_diffusers(path: Path, intended: LoraFile, den: Denoiser) -> dict[str, Any]:
    import diffusers

    from stages.core.verify import delta_weights, load_into
    from stages.families import get_family

    family = get_family(den.family)
    model = den.skeleton()
    weights = load_into(model, getattr(diffusers, family.pipeline_class), path, family.lora_prefix, "check")
    _compare(path, FactorDeltas(intended.modules), delta_weights(model, "check", weights),
             reader=f"{family.pipeline_class}'s LoRA loader")
    return {"modules": len(intended.modules),
            "note": f"{family.pipeline_class} loads all {len(intended.modules)} modules ({den.where()})"}


def _comfyui_report(path: Path, intended: LoraFile, den: Denoiser) -> Any:
    """ComfyUI's view of the file (stages.core.comfyui): the full check, deltas included, with the base
    model's config; the names and shapes only with the released config."""
    from safetensors.torch import load_file

    from stages.core.comfyui import check, check_names, key_map
    from stages.families import get_family

    kmap = key_map(get_family(den.family).comfyui_layout, den.shapes(), den.config)
    trained = intended_by_module(intended, kmap)
    tensors = load_file(str(path))
    if den.source is None:
        return check_names(path.name, tensors, kmap, list(trained))
    return check(path.name, tensors, kmap, trained)


def intended_by_module(intended: LoraFile, kmap: Mapping[str, Any]) -> Mapping[str, torch.Tensor]:
    """The intended deltas by diffusers module path: a table by path as it is; a comfyui or kohya table
    through ComfyUI's key map (a fused layer's delta split into its members' rows)."""
    from stages.core.comfyui import swap_halves

    if intended.by_path:
        return FactorDeltas(intended.modules)
    out: dict[str, torch.Tensor] = {}
    for name, factors in intended.modules.items():
        target = kmap.get(name)
        if target is None:
            continue  # the check reports its keys as not loaded
        delta = factors.delta()
        if delta.shape[0] != sum(target.rows):
            continue  # the check reports the shape
        if target.swaps_delta != target.swapped:  # as ComfyUI turns a name's delta into diffusers' row order
            delta = swap_halves(delta)
        out.update(zip(target.modules, delta.split(list(target.rows))))
    return out
