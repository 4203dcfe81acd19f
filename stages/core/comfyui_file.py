"""Writing `export/<run>_comfyui.safetensors`, and the trained deltas any exported file is checked against.

The file holds one entry per trained module, under the name its family's `ComfyLayout` gives it:
- LoRA: `lora_up.weight` (B), `lora_down.weight` (A) and `alpha` = scale x rank, so ComfyUI's
  alpha / rank is the trained scale (alpha / rank, alpha / sqrt(rank) for rsLoRA; patterns included).
- DoRA: the same, plus `dora_scale` (out, 1) = m * ||W|| / ||W + dW|| per output row (module docstring of
  `stages.core.comfyui`), from the base weights in the model folder.
- LoKr, LoHa: LyCORIS factors (`lokr_w1`, `hada_w1_a`, ...) with peft's scale folded into the first factor
  and `alpha` equal to the factor's rank, so ComfyUI applies the trained delta at strength 1.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from stages.core.caches import COMFYUI_SUFFIX
from stages.core.comfyui import ComfyError, ComfyLayout, Native, swap_halves, write_name
from stages.core.kohya import folded_factors, lycoris_scale, lora_scale, lycoris_delta, split_lycoris


def comfyui_file_name(run: str, checkpoint: int | None = None, tag: str = "") -> str:
    """`<run>_comfyui.safetensors`, or `<run>-<step>_comfyui.safetensors` for a checkpoint's export (a
    name that stays apart from the others once copied into ComfyUI's models/loras); a family's `file_tag`
    goes before the suffix (`<run>_high_noise_comfyui.safetensors`)."""
    return f"{run}{'' if checkpoint is None else f'-{checkpoint}'}{f'_{tag}' if tag else ''}{COMFYUI_SUFFIX}"


def lora_parts(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """peft LoRA/DoRA state dict -> module path -> {"A", "B", and "m" for DoRA's magnitude, one per output}."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = re.fullmatch(r"(.+)\.(lora_A\.weight|lora_B\.weight|lora_magnitude_vector(?:\.weight)?)", key)
        if m is None:
            raise ComfyError(f"adapter key '{key}' is not a LoRA or DoRA weight; the adapter file is damaged")
        part = {"lora_A": "A", "lora_B": "B", "lora_m": "m"}[m.group(2)[:6]]
        modules.setdefault(m.group(1), {})[part] = tensor.float().reshape(-1) if part == "m" else tensor.float()
    return dict(sorted(modules.items()))


def _lora_delta(parts: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """B @ A * scale in the shape of the weight (conv: (out, in, k, k))."""
    a, b = parts["A"], parts["B"]
    return ((b.flatten(1) @ a.flatten(1)) * scale).reshape(b.shape[0], *a.shape[1:])


def _row_norms(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], -1).norm(dim=1)


def dora_weight(parts: dict[str, torch.Tensor], scale: float, weight: torch.Tensor) -> torch.Tensor:
    """peft's DoRA weight: m / ||W + dW|| * (W + dW), norms per output row."""
    calc = weight.float() + _lora_delta(parts, scale)
    return calc * (parts["m"] / _row_norms(calc)).reshape(-1, *[1] * (calc.dim() - 1))


class TrainedDeltas(Mapping[str, torch.Tensor]):
    """module path -> the weight delta the trained adapter applies (what every exported file must
    reproduce), computed when read: a full-size model's deltas at once would be its targeted weights."""

    def __init__(self, state: Mapping[str, torch.Tensor], lora_cfg: dict[str, Any],
                 base: Callable[[str], torch.Tensor] | None = None) -> None:
        from stages.core.lora import adapter_type

        self.kind, self.cfg, self.base = adapter_type(lora_cfg), lora_cfg, base
        self.parts = split_lycoris(dict(state)) if self.kind in ("lokr", "loha") else lora_parts(state)

    def scale(self, module: str) -> float:
        if self.kind in ("lokr", "loha"):
            return lycoris_scale(self.cfg, module)
        return lora_scale(self.cfg, module, self.parts[module]["A"].shape[0])

    def __getitem__(self, module: str) -> torch.Tensor:
        parts = self.parts[module]
        if self.kind in ("lokr", "loha"):
            return lycoris_delta(*folded_factors(parts, self.scale(module)))
        if "m" not in parts:
            return _lora_delta(parts, self.scale(module))
        if self.base is None:
            raise ComfyError(f"'{module}' is a DoRA module, whose delta needs the base weights")
        weight = self.base(module).float()
        return dora_weight(parts, self.scale(module), weight) - weight

    def __iter__(self) -> Iterator[str]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)


def comfyui_state(deltas: TrainedDeltas, layout: ComfyLayout, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The ComfyUI file's tensors for a trained adapter; ComfyError naming every module ComfyUI has no
    name for."""
    names = {m: write_name(layout, m, config) for m in deltas}
    nameless = [m for m, n in names.items() if n is None]
    if nameless:
        raise ComfyError(f"ComfyUI has no name for {len(nameless)} trained module(s) of this family: "
                         f"{nameless[:4]}; drop them from train.target_modules, or export with "
                         f"--set export.comfyui=false to skip the ComfyUI file")
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, str]] = {}
    for module, name in names.items():
        native = layout.locate(module, config)
        if not native.mapped and native.count > 1:  # a member of a weight only ComfyUI's own name reaches
            fused.setdefault(name, {})[native.index] = module
            continue
        tensors = _module_tensors(deltas, module, native)
        out.update({f"{name}.{k}": v.contiguous() for k, v in tensors.items()})
    for name, members in fused.items():
        native = layout.locate(members[min(members)], config)
        count = native.count
        if len(members) != count:
            raise ComfyError(f"ComfyUI holds {sorted(members.values())} with other modules as one weight '{native.name}', "
                             f"whose file entry needs all {count} of them trained: add the others to "
                             f"train.target_modules, or export with --set export.comfyui=false")
        tensors = _fused_tensors(deltas, [members[i] for i in sorted(members)])
        out.update({f"{name}.{k}": v.contiguous() for k, v in tensors.items()})
    return out


def _fused_tensors(deltas: TrainedDeltas, modules: list[str]) -> dict[str, torch.Tensor]:
    """One entry for the members of a fused weight, rows in member order, that gives each member its trained
    delta: LoRA/DoRA as one LoRA of the summed rank (the downs stacked, the ups scaled and block-diagonal,
    alpha = rank; DoRA's scales stacked), LoKr/LoHa as the full delta (`diff`), which no factor form fuses."""
    if deltas.kind in ("lokr", "loha"):
        return {"diff": torch.cat([deltas[m].float() for m in modules])}
    parts = [_module_tensors(deltas, m, Native(m)) for m in modules]
    ups = [p["lora_up.weight"].flatten(1) * (float(p["alpha"]) / p["lora_down.weight"].shape[0]) for p in parts]
    down = torch.cat([p["lora_down.weight"] for p in parts])
    out = {"lora_up.weight": torch.block_diag(*ups), "lora_down.weight": down, "alpha": torch.tensor(float(down.shape[0]))}
    if all("dora_scale" in p for p in parts):
        out["dora_scale"] = torch.cat([p["dora_scale"] for p in parts])
    return out


def _module_tensors(deltas: TrainedDeltas, module: str, native: Native) -> dict[str, torch.Tensor]:
    """One module's entry. Where ComfyUI's weight holds the module's row halves swapped, its diffusers
    names get the delta swapped by ComfyUI, and its own name (`own_order`) takes the rows as they are."""
    own_order = native.swap and not native.mapped
    parts = deltas.parts[module]
    scale = deltas.scale(module)
    if deltas.kind in ("lokr", "loha"):
        folded, alpha = folded_factors(parts, scale)
        out = dict(folded)
        if alpha is not None:
            out["alpha"] = torch.tensor(alpha)
        if own_order:
            raise ComfyError(f"'{module}': a LyCORIS factor cannot be written in swapped row order; "
                             f"drop it from train.target_modules")
        return out
    rank = parts["A"].shape[0]
    up = swap_halves(parts["B"]) if own_order else parts["B"]
    out = {"lora_up.weight": up, "lora_down.weight": parts["A"], "alpha": torch.tensor(float(scale * rank))}
    if "m" in parts:
        if deltas.base is None:
            raise ComfyError(f"'{module}' is a DoRA module: its ComfyUI form needs the base weights")
        weight = deltas.base(module).float()
        calc = weight + _lora_delta(parts, scale)
        dora_scale = (parts["m"] * _row_norms(weight) / _row_norms(calc)).reshape(-1, *[1] * (weight.dim() - 1))
        out["dora_scale"] = swap_halves(dora_scale) if native.swap else dora_scale
    return out


def base_reader(files: list[Path] | None) -> Callable[[str], torch.Tensor] | None:
    """module path -> its base weight (`<module>.weight`), read from the denoiser's safetensors files
    one tensor at a time; None when there are no such files (a single-file checkpoint)."""
    if not files:
        return None
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            where.update({k: f for k in handle.keys()})

    def read(module: str) -> torch.Tensor:
        key = f"{module}.weight"
        if key not in where:
            raise ComfyError(f"the base model's weights have no '{key}'")
        with safe_open(str(where[key]), framework="pt") as handle:
            return handle.get_tensor(key)

    return read


def metadata(lora_cfg: dict[str, Any], manifest: dict[str, Any], modules: int) -> dict[str, str]:
    """Header fields ComfyUI and LoRA browsers show; the tensors alone say how to apply the file."""
    from stages.core.lora import adapter_type

    kind = adapter_type(lora_cfg)
    return {"ss_network_module": "networks.lora" if kind in ("lora", "dora") else "lycoris.kohya",
            "ss_network_dim": str(lora_cfg.get("r")),
            "ss_network_alpha": str(lora_cfg.get("lora_alpha", lora_cfg.get("alpha"))),
            "lorapipe_adapter": kind, "lorapipe_family": str(manifest.get("family")),
            "lorapipe_modules": str(modules), "lorapipe_strength": "1.0"}


def write_comfyui(state: Mapping[str, torch.Tensor], lora_cfg: dict[str, Any], manifest: dict[str, Any], path: Path,
                  layout: ComfyLayout, src: Any) -> Path:
    """Write the ComfyUI-ready file at `path`; `src` (the base model's ModelSource) gives the denoiser's
    config.json and, for DoRA, its weights."""
    from safetensors.torch import save_file

    from stages.core.lora import adapter_type

    prefix = manifest["lora_prefix"]
    base = None
    if adapter_type(lora_cfg) == "dora":  # the trained component's weights (Wan 2.2 A14B's low expert: transformer_2)
        base = base_reader(src.weight_files(manifest.get("component", prefix)))
        if base is None:
            raise ComfyError(f"a DoRA adapter's ComfyUI file needs the base weights as diffusers safetensors files, "
                             f"and '{src.ref}' has none for its {prefix}; give --model a diffusers folder, or export "
                             f"with --set export.comfyui=false")
    deltas = TrainedDeltas(state, lora_cfg, base)
    tensors = comfyui_state(deltas, layout, src.component_config(prefix))
    save_file(tensors, str(path), metadata=metadata(lora_cfg, manifest, len(deltas)))
    return path
