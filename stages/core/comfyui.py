"""The ComfyUI-ready LoRA file, and a check of any LoRA file in the terms of ComfyUI's loader.

    lorapipe export-lora my-lora            # also writes export/my-lora_comfyui.safetensors
    lorapipe export-lora my-lora --verify   # and checks it key by key, as ComfyUI would load it

ComfyUI applies a LoRA through a key map (`comfy/lora.py` `model_lora_keys_unet`): every name it
accepts for a module of the model it loaded, mapped to one weight of its own checkpoint layout, or
to a row slice of a fused weight (FLUX's q, k and v are one `qkv` linear there). A name that is not
in the map is skipped with "lora key not loaded". The names come from two rules: its own weight
names, as `lora_unet_<name with _>` and `diffusion_model.<name>`, and per model class a table of
diffusers module paths (`transformer.<path>`, `lycoris_<path with _>`, ...). A family states its
part of both as a `ComfyLayout`; this module builds the map from it, writes each trained module
under a name the map has, and checks a file against it.

Strength: ComfyUI scales `up @ down` by `alpha / rank` where a module has an `.alpha` tensor and by 1
where it has none (it ignores header metadata), so every module carries its alpha. DoRA: ComfyUI
rescales W + dW by `dora_scale / ||W||` per output row, where peft uses `m / ||W + dW||`; the file's
`dora_scale` is `m * ||W|| / ||W + dW||`, computed from the base weights, so the result is peft's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from stages.core.errors import UserError
from stages.core.lazy import lazy_module

torch = lazy_module("torch")  # imported at first use: `status` and a no-op `run` need no torch


class ComfyError(UserError, ValueError):
    """A LoRA file does not load in ComfyUI as trained; the message names the modules and the fix."""


@dataclass(frozen=True)
class Native:
    """Where a diffusers module lands in ComfyUI's checkpoint layout."""

    name: str
    """ComfyUI's module path, under `diffusion_model.` (its weight is `<name>.weight`)."""
    index: int = 0
    count: int = 1
    """member `index` of `count` modules whose weights ComfyUI holds as one, rows stacked in order."""
    swap: bool = False
    """ComfyUI swaps the two row halves of this module's delta (FLUX's final adaLN: shift, scale)."""
    mapped: bool = True
    """the model class's table of diffusers paths lists this module, so its diffusers names are accepted;
    False: only ComfyUI's own name reaches it (then it can't be a member of a fused weight)."""


@dataclass(frozen=True)
class Rule:
    pattern: str
    native: str
    index: int = 0
    count: int = 1
    swap: bool = False
    mapped: bool = True

    def match(self, module: str) -> Native | None:
        m = re.fullmatch(self.pattern, module)
        return m and Native(m.expand(self.native), self.index, self.count, self.swap, self.mapped)


# The names each ComfyUI model class accepts for a module its diffusers table lists ({d}: the diffusers
# path, {u}: the same with "_" for "."); the first is the one written. Per `model_lora_keys_unet`.
ALIASES: dict[str, tuple[str, ...]] = {
    "flux": ("transformer.{d}", "lycoris_{u}", "lora_transformer_{u}", "{d}"),
    "qwen_image": ("transformer.{d}", "{d}", "lycoris_{u}"),
    "krea2": ("transformer.{d}", "diffusion_model.{d}", "lycoris_{u}", "{d}"),
    "lumina2": ("transformer.{d}", "diffusion_model.{d}", "lycoris_{u}", "{d}"),
    "sdxl": ("lora_unet_{u}", "lycoris_{u}", "{p}", "unet.{p}"),
    "ernie_image": ("transformer.{d}",),
    "hidream": ("transformer.{d}", "lycoris_{u}"),
    "wan": (),  # WAN21 / WAN22 have no diffusers table: only ComfyUI's own names (NATIVE_ALIASES) reach them
    "ltxav": (),  # LTXV / LTXAV: no diffusers table either, their own names only
}
NATIVE_ALIASES = ("diffusion_model.{n}", "lora_unet_{v}")
"""The names of ComfyUI's own weights, for every model ({n}: its module path, {v}: with "_")."""


@dataclass(frozen=True)
class ComfyLayout:
    """A family's denoiser as ComfyUI loads it: its model class and where each diffusers module lands."""

    model: str
    """ComfyUI's model class, which decides the names it accepts (a key of ALIASES)."""
    rules: tuple[Rule, ...] = ()
    """diffusers module path -> ComfyUI's module; the first matching rule wins."""
    same_names: bool = False
    """modules no rule matches keep their diffusers path in ComfyUI (Qwen-Image); else they have no name there."""
    native: Callable[[str, dict[str, Any]], Native | None] | None = None
    """instead of rules: a function of the path and the denoiser's config.json (SDXL's UNet numbering)."""

    def locate(self, module: str, config: dict[str, Any]) -> Native | None:
        if self.native is not None:
            return self.native(module, config)
        for rule in self.rules:
            found = rule.match(module)
            if found is not None:
                return found
        return Native(module) if self.same_names else None


@dataclass(frozen=True)
class Target:
    """One entry of ComfyUI's key map: a weight, or the rows of one member of a fused weight."""

    weight: str
    """ComfyUI's module path of the weight."""
    shape: tuple[int, ...]
    """the rows' shape: the delta a file gives for them must have exactly this shape."""
    modules: tuple[str, ...]
    """the diffusers modules whose rows these are, in order (one, or a fused weight's members)."""
    rows: tuple[int, ...]
    """each module's rows."""
    swapped: bool = False
    """ComfyUI's weight holds the module's two row halves swapped (FLUX's final adaLN: shift, scale)."""
    swaps_delta: bool = False
    """ComfyUI swaps the halves of this name's delta before adding it (its diffusers names of such a module)."""


def key_map(layout: ComfyLayout, shapes: Mapping[str, tuple[int, ...]], config: dict[str, Any]) -> dict[str, Target]:
    """Every LoRA name ComfyUI accepts for the denoiser's linear and conv layers (`shapes`: diffusers
    module path -> weight shape, e.g. from a meta-device model) -> what it patches."""
    located = {m: layout.locate(m, config) for m in shapes}
    members: dict[str, dict[int, str]] = {}
    for module, native in located.items():
        if native is not None:
            members.setdefault(native.name, {})[native.index] = module
    whole: dict[str, Target] = {}
    for name, parts in members.items():
        order = tuple(parts[i] for i in sorted(parts))
        rows = tuple(shapes[m][0] for m in order)
        whole[name] = Target(name, (sum(rows), *shapes[order[0]][1:]), order, rows, located[order[0]].swap)
    out: dict[str, Target] = {}
    for name, target in whole.items():
        for alias in NATIVE_ALIASES:
            out[alias.format(n=name, v=name.replace(".", "_"))] = target
    for module, native in located.items():
        if native is None or not native.mapped:
            continue
        shape = tuple(shapes[module])
        target = Target(native.name, shape, (module,), (shape[0],), native.swap, native.swap)
        for alias in ALIASES[layout.model]:
            out[alias.format(d=module, u=module.replace(".", "_"), p=_processor_name(module))] = target
    return out


def _processor_name(module: str) -> str:
    """The attention-processor spelling of a UNet path that ComfyUI also accepts for SDXL."""
    name = module.replace(".to_", ".processor.to_")
    return name[:-2] if name.endswith(".to_out.0") else name


def write_name(layout: ComfyLayout, module: str, config: dict[str, Any]) -> str | None:
    """The name the ComfyUI file gives a trained module: the model class's first alias, or ComfyUI's own
    name where only that reaches it (a fused weight's members share it: `comfyui_file` writes them as one
    entry); None where ComfyUI has no name for it."""
    native = layout.locate(module, config)
    if native is None:
        return None
    if native.mapped:
        return ALIASES[layout.model][0].format(d=module, u=module.replace(".", "_"), p=_processor_name(module))
    return NATIVE_ALIASES[0].format(n=native.name)


# ---- the adapters as ComfyUI computes them (comfy/weight_adapter lora.py, lokr.py, loha.py, base.py) ------

LORA_SUFFIXES = {"up": (".lora_up.weight", ".lora_B.weight"), "down": (".lora_down.weight", ".lora_A.weight")}
LOKR_PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
LOHA_PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
OTHER_PARTS = ("alpha", "dora_scale", "diff")
SUFFIX = re.compile(r"\.(lora_up\.weight|lora_down\.weight|lora_B\.weight|lora_A\.weight|"
                    + "|".join(LOKR_PARTS + LOHA_PARTS + OTHER_PARTS) + r")$")


def group_keys(keys: Iterable[str]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """file keys -> ({module name: {part: key}}, keys of no known part)."""
    groups: dict[str, dict[str, str]] = {}
    odd: list[str] = []
    for key in keys:
        m = SUFFIX.search(key)
        if m is None:
            odd.append(key)
            continue
        part = m.group(1).replace(".weight", "").replace("lora_B", "lora_up").replace("lora_A", "lora_down")
        groups.setdefault(key[:m.start()], {})[part] = key
    return groups, odd


def applied_delta(parts: dict[str, torch.Tensor], target: Target, base: torch.Tensor | None) -> torch.Tensor:
    """What ComfyUI adds at strength 1 under `target` from one module's tensors, in diffusers' row order.
    `base`: the target's base weight in diffusers' row order, which DoRA needs. ComfyError when the
    shapes disagree."""
    delta = _factor_delta(parts)
    if not fits(tuple(delta.shape), target.shape):
        raise ComfyError(f"its delta has shape {tuple(delta.shape)} for a weight of shape {target.shape}")
    delta = delta.reshape(target.shape)
    if target.swaps_delta:
        delta = swap_halves(delta)
    if "dora_scale" in parts:
        if base is None:
            raise ComfyError("it is a DoRA module, whose delta depends on the base weights, which were not given")
        delta = _dora(parts["dora_scale"].double(), swap_halves(base) if target.swapped else base, delta)
    return swap_halves(delta) if target.swapped else delta


def fits(shape: tuple[int, ...], weight: tuple[int, ...]) -> bool:
    """Whether ComfyUI applies a delta of `shape` to a weight of shape `weight`: it reshapes the delta to the
    weight, so the element counts must agree, and a linear delta must match row for row."""
    return math.prod(shape) == math.prod(weight) and not (len(shape) == 2 == len(weight) and shape != weight)


def _factor_delta(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """up @ down * alpha / rank (LoRA), the LoHa and LoKr products, or a full difference."""
    alpha = parts["alpha"].item() if "alpha" in parts else None
    if "lora_up" in parts and "lora_down" in parts:
        down = parts["lora_down"].double()
        return (parts["lora_up"].double().flatten(1) @ down.flatten(1)) * (alpha / down.shape[0] if alpha is not None else 1.0)
    if all(p in parts for p in LOHA_PARTS):
        rank = parts["hada_w1_b"].shape[0]
        product = (parts["hada_w1_a"].double() @ parts["hada_w1_b"].double()) * (parts["hada_w2_a"].double()
                                                                                 @ parts["hada_w2_b"].double())
        return product * (alpha / rank if alpha is not None else 1.0)
    if any(p in parts for p in LOKR_PARTS):
        return _lokr(parts, alpha)
    if "diff" in parts:
        return parts["diff"].double()
    raise ComfyError(f"no adapter tensors among {sorted(parts)}")


def _lokr(parts: dict[str, torch.Tensor], alpha: float | None) -> torch.Tensor:
    dim = None
    factors = []
    for w in ("lokr_w1", "lokr_w2"):
        if w in parts:
            factors.append(parts[w].double())
        else:
            factors.append(parts[f"{w}_a"].double() @ parts[f"{w}_b"].double())
            dim = parts[f"{w}_b"].shape[0]
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    return torch.kron(factors[0], factors[1]) * scale


def _dora(dora_scale: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """ComfyUI's weight decomposition at strength 1, minus the weight: with a scale per output row it
    divides W + dW by the norm of W's rows; with one per input column, by the norm of W + dW's columns."""
    w = weight.double()
    calc = w + delta
    if dora_scale.shape[0] == calc.shape[0]:
        norm = w.reshape(w.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (w.dim() - 1))
    else:
        norm = calc.transpose(0, 1).reshape(calc.shape[1], -1).norm(dim=1).reshape(1, -1, *[1] * (w.dim() - 2))
    scaled = calc * (dora_scale / (norm + torch.finfo(weight.dtype).eps))  # broadcast as ComfyUI does, in place
    if scaled.shape != calc.shape:
        raise ComfyError(f"its dora_scale {tuple(dora_scale.shape)} does not broadcast over the weight {tuple(calc.shape)}")
    return scaled - w


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    return torch.cat(t.chunk(2, dim=0)[::-1], dim=0)


# ---- the check ---------------------------------------------------------------------------------------------

@dataclass
class Report:
    """What ComfyUI would do with one file: which keys load, which trained modules they reach, and the
    strength of each module as applied relative to the trained delta."""

    file: str
    keys: int = 0
    not_loaded: list[str] = field(default_factory=list)
    shape_errors: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    strength: dict[str, tuple[float, float]] = field(default_factory=dict)
    """diffusers module -> (strength ratio <applied, trained> / <trained, trained>, relative error)."""

    TOLERANCE = 0.01

    def off(self) -> dict[str, tuple[float, float]]:
        return {m: v for m, v in self.strength.items() if abs(v[0] - 1) > self.TOLERANCE or v[1] > self.TOLERANCE}

    def problems(self) -> list[str]:
        out = []
        if self.not_loaded:
            out.append(f"{len(self.not_loaded)} of {self.keys} keys would not load (e.g. {self.not_loaded[:3]})")
        if self.shape_errors:
            out.append(f"{len(self.shape_errors)} shape mismatch(es): {self.shape_errors[:2]}")
        if self.missing:
            out.append(f"{len(self.missing)} trained module(s) get no delta: {self.missing[:4]}")
        off = self.off()
        if off:
            worst = max(off, key=lambda m: off[m][1])
            out.append(f"{len(off)} module(s) off their trained strength, worst '{worst}' at "
                       f"{off[worst][0]:.3f}x (error {off[worst][1]:.1%})")
        return out

    def summary(self) -> dict[str, Any]:
        ratios = [v[0] for v in self.strength.values()]
        return {"keys": self.keys, "keys_loaded": self.keys - len(self.not_loaded), "modules": len(self.strength),
                "missing": len(self.missing), "shape_errors": len(self.shape_errors),
                "strength_min": round(min(ratios), 5) if ratios else None,
                "strength_max": round(max(ratios), 5) if ratios else None,
                "max_error": round(max((v[1] for v in self.strength.values()), default=0.0), 6)}


def check(file: str, tensors: Mapping[str, torch.Tensor], kmap: Mapping[str, Target],
          trained: Mapping[str, torch.Tensor], base: Callable[[str], torch.Tensor] | None = None) -> Report:
    """Load `tensors` as ComfyUI's loader would through `kmap`, and compare what each module gets with
    `trained` (diffusers module -> the delta training learned, computed when read). `base(module)` gives
    a module's base weight, which DoRA's delta needs."""
    report = Report(file, keys=len(tensors))
    groups, report.not_loaded = group_keys(tensors)
    applied: dict[str, torch.Tensor] = {}
    for stem, keys in groups.items():
        target = kmap.get(stem)
        if target is None:
            report.not_loaded += sorted(keys.values())
            continue
        parts = {p: tensors[k] for p, k in keys.items()}
        try:
            weight = torch.cat([base(m) for m in target.modules]) if base and "dora_scale" in parts else None
            delta = applied_delta(parts, target, weight)
        except ComfyError as e:
            report.shape_errors.append(f"{stem}: {e}")
            continue
        for module, rows in zip(target.modules, delta.split(list(target.rows))):
            if module in trained:
                applied[module] = rows
            elif rows.abs().max() > 0:
                report.shape_errors.append(f"{stem}: nonzero delta on '{module}', which was not trained")
    for module in trained:
        if module not in applied:
            report.missing.append(module)
            continue
        ref, got = trained[module].double(), applied[module]
        if got.shape != ref.shape:
            report.shape_errors.append(f"{module}: {tuple(got.shape)} applied for {tuple(ref.shape)} trained")
            continue
        denom = float((ref * ref).sum())
        if denom == 0.0:  # an untrained (zero) module: any delta is all error
            report.strength[module] = (1.0, float(got.abs().max()))
            continue
        report.strength[module] = (float((got * ref).sum()) / denom, math.sqrt(float(((got - ref) ** 2).sum()) / denom))
    return report


def check_names(file: str, tensors: Mapping[str, torch.Tensor], kmap: Mapping[str, Target],
                modules: Iterable[str]) -> Report:
    """The key and shape half of `check`, from the factors' shapes alone (no delta is computed): which keys
    load, which of `modules` get no entry, and which entries do not fit their layer. For full-size models."""
    report = Report(file, keys=len(tensors))
    groups, report.not_loaded = group_keys(tensors)
    reached: set[str] = set()
    for stem, keys in groups.items():
        target = kmap.get(stem)
        if target is None:
            report.not_loaded += sorted(keys.values())
            continue
        shape = _factor_shape({p: tensors[k] for p, k in keys.items()})
        if not fits(shape, target.shape):
            report.shape_errors.append(f"{stem}: its delta has shape {shape} for a weight of shape {target.shape}")
            continue
        reached.update(target.modules)
    report.missing = sorted(set(modules) - reached)
    return report


def _factor_shape(parts: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """The shape of the delta a module's factors make, without making it."""
    if "lora_up" in parts:
        return (parts["lora_up"].shape[0], *parts["lora_down"].shape[1:])
    if "hada_w1_a" in parts:
        return (parts["hada_w1_a"].shape[0], parts["hada_w1_b"].shape[1])
    if "diff" in parts:
        return tuple(parts["diff"].shape)
    sides = [tuple(parts[w].shape) if w in parts else (parts[f"{w}_a"].shape[0], parts[f"{w}_b"].shape[1])
             for w in ("lokr_w1", "lokr_w2")]
    return (sides[0][0] * sides[1][0], sides[0][1] * sides[1][1])
