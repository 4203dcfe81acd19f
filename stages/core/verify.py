"""`export-lora --verify`: load each exported file the way the family's pipeline does and check every key.

    lorapipe export-lora --config configs/flux-dev.toml --verify [--format kohya]

The file goes through the pipeline class's own `lora_state_dict` (which converts kohya keys) and the
denoiser's `load_lora_adapter`, the two calls `<Pipeline>.load_lora_weights()` makes for the
denoiser. The denoiser is built from its config.json on the meta device, so no base weights are read
and a 12B FLUX checks in seconds. Fails on:
- a key the denoiser has no place for (unexpected), or a LoRA weight the loader expected but the file
  lacks (missing), or a shape that does not fit;
- a module of the diffusers file that the kohya file does not carry after conversion, or carries
  with a different delta weight B @ A * scale (the kohya copy must be the same adapter).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from stages.core.errors import UserError

class VerifyError(UserError):
    """The exported file does not load cleanly; the message names the file and the keys."""


def denoiser_skeleton(src: Any, subfolder: str) -> torch.nn.Module:
    """The denoiser class from its config.json (`src`: a ModelSource), with parameters on the meta
    device (no memory)."""
    import diffusers

    config = src.component_config(subfolder)
    cls = getattr(diffusers, config["_class_name"])
    with torch.device("meta"):
        return cls.from_config(config)


def pipeline_state_dict(pipeline_cls: Any, file: Path) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """(state dict in diffusers keys, network alphas or None, adapter metadata or None), as the
    pipeline's loader reads the file (the return shape of `lora_state_dict` differs per pipeline)."""
    out = pipeline_cls.lora_state_dict(str(file.parent), weight_name=file.name, return_lora_metadata=True)
    if not isinstance(out, tuple):
        return out, None, None
    if len(out) == 3:
        return out[0], out[1], out[2]
    return out[0], None, out[1]


def peft_form(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The denoiser's part of a loader state dict in peft keys (`<module>.lora_A.weight`), as
    `load_lora_adapter` turns it before loading."""
    from diffusers.utils import convert_unet_state_dict_to_peft

    own = {k.removeprefix(f"{prefix}."): v for k, v in state.items() if k.startswith(f"{prefix}.")}
    if own and "lora_A" not in next(iter(own)):
        own = convert_unet_state_dict_to_peft(own)
    return own


def unreadable_layers(pipeline_cls: Any, file: Path) -> tuple[list[str], int, bool]:
    """The file's modules that the pipeline's converter fails on, how many modules the file holds (0 when the
    file itself cannot be read), and whether they were found alone. Each module is tried alone first. Where every
    one fails alone (a converter that reads whole blocks, as Wan's), each kind of module (its name with the block
    numbers left out) is left out of the file in turn: the kinds without which the rest reads are the ones named."""
    import re

    from safetensors.torch import load_file

    from stages.core.comfyui import group_keys

    try:
        tensors = load_file(str(file))
    except (OSError, ValueError):
        return [], 0, True
    groups, _ = group_keys(tensors)

    def reads(stems: list[str]) -> bool:
        try:
            pipeline_cls.lora_state_dict({k: tensors[k] for stem in stems for k in groups[stem].values()})
        except Exception:  # noqa: BLE001 - the converters raise ValueError, AssertionError, KeyError
            return False
        return True

    stems = sorted(groups)
    bad = [stem for stem in stems if not reads([stem])]
    if len(bad) < len(stems) or len(stems) < 2:
        return bad, len(stems), True
    kinds: dict[str, list[str]] = {}
    for stem in stems:
        kinds.setdefault(re.sub(r"_\d+(?=_|$)", "_N", stem), []).append(stem)
    culprits = [stem for kind in kinds.values() if len(kind) < len(stems)
                and reads([x for x in stems if x not in kind]) for stem in kind]
    return (culprits, len(stems), False) if culprits else (bad, len(stems), True)


def _first(names: list[str], n: int = 3) -> str:
    """The first `n` names, and how many more (a message names a few of a model's hundreds of layers)."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _param_name(key: str, adapter: str) -> str:
    """The parameter a file key becomes once loaded as `adapter` (DoRA's magnitude included)."""
    if key.endswith(".lora_magnitude_vector"):
        return f"{key}.{adapter}.weight"
    return key.replace(".lora_A.", f".lora_A.{adapter}.").replace(".lora_B.", f".lora_B.{adapter}.")


def _what_failed(e: BaseException) -> str:
    """The error's text; for a bare `assert` in diffusers' converters, which has none, the check
    that failed: its function, file and line."""
    if str(e):
        return f"{type(e).__name__}: {str(e)[:300]}"
    import traceback

    frame = traceback.extract_tb(e.__traceback__)[-1]
    check = f": {frame.line.strip()[:200]}" if frame.line else ""
    return f"{type(e).__name__} in {frame.name} ({Path(frame.filename).name}:{frame.lineno}{check})"


def load_into(model: torch.nn.Module, pipeline_cls: Any, file: Path, prefix: str, adapter: str,
              origin: Mapping[str, list[str]] | None = None) -> dict[str, torch.Tensor]:
    """Load one exported file into the skeleton as `adapter`; VerifyError on any key problem.
    Returns the weights as loaded, in peft keys (the skeleton itself keeps them on the meta device).
    `origin`: a file module's name -> the trained modules it holds, to name them when one can't be read."""
    try:
        state, alphas, metadata = pipeline_state_dict(pipeline_cls, file)
    except Exception as e:  # noqa: BLE001 - the converters raise ValueError, AssertionError, KeyError
        bad, total, alone = unreadable_layers(pipeline_cls, file)
        trained = list(dict.fromkeys(m for layer in bad for m in (origin or {}).get(layer, [])))  # in `bad`'s order
        found = (f"{len(bad)} of its {total} layers fail when read alone" if alone else
                 f"it reads without {len(bad)} of its {total} layers")
        named = (f"{found}: {_first(bad)}"
                 + (f" (trained as {_first(trained)})" if trained else "")) if bad else _what_failed(e)
        raise VerifyError(f"{file.name}: {pipeline_cls.__name__}.lora_state_dict cannot read it; {named}. Drop "
                          f"those layers from train.target_modules for a kohya file diffusers reads, or use the "
                          f"*_comfyui.safetensors file in ComfyUI (README, 'Using your LoRA')") from e
    others = sorted({k.split(".", 1)[0] for k in state if not k.startswith(f"{prefix}.")})
    if others:
        raise VerifyError(f"{file.name}: keys outside '{prefix}' after {pipeline_cls.__name__}'s conversion "
                          f"({', '.join(others)}), e.g. {next(k for k in state if not k.startswith(prefix + '.'))}; "
                          f"the pipeline would not load them into the {prefix}")
    weights = peft_form(state, prefix)
    expected = {_param_name(k, adapter) for k in weights}
    try:
        model.load_lora_adapter(state, prefix=prefix, network_alphas=alphas, metadata=metadata, adapter_name=adapter,
                                low_cpu_mem_usage=True)
    except Exception as e:  # noqa: BLE001 - peft raises ValueError/RuntimeError for shape or target problems
        raise VerifyError(f"{file.name}: does not load into {type(model).__name__}: {str(e)[:400]}") from e
    loaded = {n for n, _ in model.named_parameters() if f".{adapter}." in n and ".lora_" in n}
    unexpected, missing = sorted(expected - loaded), sorted(loaded - expected)
    if unexpected or missing:
        raise VerifyError(f"{file.name}: {len(unexpected)} unexpected key(s) {unexpected[:5]} and {len(missing)} "
                          f"missing key(s) {missing[:5]} when loaded into {type(model).__name__}")
    return weights


class Deltas(Mapping[str, torch.Tensor]):
    """module path -> B @ A * scale of one loaded adapter (what it adds to the base weight), computed
    when read and not kept: all of a full-size model's deltas at once are its targeted weights in fp32
    (FLUX.2 dev's default targets: 70.1 GB, which its benchmark's host, 125 GB with 61 GB of model files
    in /dev/shm, could not hold; `bench/verify_export.py --meta flux2`)."""

    def __init__(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        self._factors = factors

    def __getitem__(self, name: str) -> torch.Tensor:
        a, b, scale = self._factors[name]
        return _delta(a.float(), b.float()) * scale

    def __iter__(self) -> Iterator[str]:
        return iter(self._factors)

    def __len__(self) -> int:
        return len(self._factors)

    def fp32_bytes(self) -> int:
        """What all the deltas would take held at once."""
        return sum(a.shape[1:].numel() * b.shape[0] * 4 for a, b, _ in self._factors.values())


def delta_weights(model: torch.nn.Module, adapter: str, weights: dict[str, torch.Tensor]) -> Deltas:
    """The deltas of one loaded adapter, with the scale peft derived for each layer from the file
    (metadata alpha, kohya alphas or none)."""
    from peft.tuners.lora import LoraLayer

    return Deltas({name: (weights[f"{name}.lora_A.weight"], weights[f"{name}.lora_B.weight"], module.scaling[adapter])
                   for name, module in model.named_modules() if isinstance(module, LoraLayer) and adapter in module.lora_A})


def _delta(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """B @ A; for a conv LoRA (A (r, in, k, k), B (out, r, 1, 1)) the (out, in, k, k) kernel it adds."""
    return (b.flatten(1) @ a.flatten(1)).reshape(b.shape[0], *a.shape[1:])


def compare_deltas(reference: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor], file: Path,
                   rtol: float = 1e-4, against: str = "the trained adapter") -> None:
    """The file must hold every module of `reference` (`against` names it) with the same delta; extra
    modules are allowed only when their delta is zero (untrained members of a fused kohya layer)."""
    dropped = sorted(set(reference) - set(other))
    if dropped:
        raise VerifyError(f"{file.name}: {len(dropped)} trained module(s) are lost when the pipeline loads it: "
                          f"{dropped[:6]} (its converter does not map them; the ComfyUI file still holds them)")
    extra = sorted(m for m in set(other) - set(reference) if other[m].abs().max() > 0)
    if extra:
        raise VerifyError(f"{file.name}: nonzero delta on module(s) the adapter never trained: {extra[:6]}")
    for module in reference:
        ref = reference[module]
        err = (other[module] - ref).abs().max().item()
        if err > rtol * max(ref.abs().max().item(), 1e-12):
            raise VerifyError(f"{file.name}: module '{module}' differs from {against} by {err:.3g} "
                              f"(max |delta| {ref.abs().max().item():.3g})")


def verify_export(cfg: Any, manifest: dict[str, Any], files: list[Path], state: dict[str, torch.Tensor],
                  lora_cfg: dict[str, Any]) -> dict[str, Any]:
    """Check every exported file against the trained adapter (`state`, `lora_cfg`): the diffusers and kohya
    files through the pipeline's own loader, the ComfyUI file (and the kohya file, for the summary) through
    ComfyUI's key map. VerifyError on any file that would not apply the trained delta in its reader;
    returns a summary per file, with a one-line note where one is due."""
    from stages.core.comfyui_file import COMFYUI_SUFFIX, TrainedDeltas, base_reader
    from stages.core.kohya import is_kohya_file
    from stages.core.lora import adapter_type
    from stages.core.model_source import model_source

    src, prefix = model_source(cfg), manifest["lora_prefix"]
    component = manifest.get("component", prefix)  # the trained denoiser's weights (a Wan 2.2 A14B expert's own)
    base = base_reader(src.weight_files(component)) if adapter_type(lora_cfg) == "dora" else None
    trained = TrainedDeltas(state, lora_cfg, base)
    lora_part = TrainedDeltas({k: v for k, v in state.items() if "magnitude" not in k}, lora_cfg)
    comfy = _ComfyCheck(cfg, manifest, trained)
    summary: dict[str, Any] = {}
    for file in files:
        if file.name.endswith(COMFYUI_SUFFIX):
            summary[file.name] = comfy.require(file)
            continue
        if file.name.endswith(".safetensors") and (is_kohya_file(file.name) or trained.kind in ("lokr", "loha")):
            summary[file.name] = comfy.describe(file)
        if trained.kind in ("lokr", "loha"):
            continue
        compare_deltas(lora_part, _check_file(cfg, manifest, file, list(lora_part)), file)
        summary.setdefault(file.name, {})["modules"] = len(lora_part)
    return summary


def comfyui_key_map(cfg: Any, manifest: dict[str, Any]) -> dict[str, Any]:
    """ComfyUI's key map for the run's denoiser, sized from its config on the meta device."""
    from stages.core.comfyui import key_map
    from stages.core.model_source import model_source
    from stages.families import get_family

    src, prefix = model_source(cfg), manifest["lora_prefix"]
    skeleton = denoiser_skeleton(src, prefix)
    shapes = {n: tuple(m.weight.shape) for n, m in skeleton.named_modules()
              if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    return key_map(get_family(manifest["family"]).comfyui_layout, shapes, src.component_config(prefix))


def comfyui_readiness(cfg: Any, manifest: dict[str, Any], file: Path, modules: list[str]) -> dict[str, Any]:
    """Whether a file's keys all load in ComfyUI and reach every trained module (names and shapes only)."""
    from safetensors.torch import load_file

    from stages.core.comfyui import check_names

    report = check_names(file.name, load_file(str(file)), comfyui_key_map(cfg, manifest), modules)
    return _with_readiness({"keys": report.keys, "keys_loaded": report.keys - len(report.not_loaded)}, report)


def _with_readiness(out: dict[str, Any], report: Any) -> dict[str, Any]:
    """`out` with a note where the file's report (stages.core.comfyui.Report) says ComfyUI would not load it as trained."""
    if report.problems():
        out["note"] = (f"{report.file} is not ComfyUI-ready ({report.problems()[0]}); in ComfyUI load the "
                       f"*_comfyui.safetensors file")
    return out


class _ComfyCheck:
    """ComfyUI's key map of the run's denoiser (built once, on the meta device) and the trained deltas."""

    def __init__(self, cfg: Any, manifest: dict[str, Any], trained: Any) -> None:
        """`trained`: the run's TrainedDeltas (with the base weights' reader for DoRA)."""
        self.kmap = comfyui_key_map(cfg, manifest)
        self.trained = trained

    def report(self, file: Path) -> Any:
        from safetensors.torch import load_file

        from stages.core.comfyui import check

        return check(file.name, load_file(str(file)), self.kmap, self.trained, self.trained.base)

    def require(self, file: Path) -> dict[str, Any]:
        report = self.report(file)
        if report.problems():
            raise VerifyError(f"{file.name}: in ComfyUI {'; '.join(report.problems())}. Nothing was replaced; "
                              f"export with --set export.comfyui=false to skip this file")
        out = report.summary()
        out["note"] = (f"{file.name}: ComfyUI loads {out['keys_loaded']}/{out['keys']} keys, {out['modules']} modules "
                       f"at strength {out['strength_min']:.3f}-{out['strength_max']:.3f}")
        return out

    def describe(self, file: Path) -> dict[str, Any]:
        report = self.report(file)
        return _with_readiness(report.summary(), report)


def _check_file(cfg: Any, manifest: dict[str, Any], file: Path, modules: list[str]) -> Deltas:
    import diffusers

    from stages.core.kohya import PREFIX, KohyaError
    from stages.core.model_source import model_source
    from stages.families import get_family

    layout = get_family(manifest["family"]).kohya_layout
    origin: dict[str, list[str]] = {}
    for module in modules:
        try:
            origin.setdefault(PREFIX + layout.name(module)[0], []).append(module)
        except KohyaError:
            continue
    prefix = manifest["lora_prefix"]
    pipeline_cls = getattr(diffusers, manifest["pipeline_class"])
    model = denoiser_skeleton(model_source(cfg), prefix)
    weights = load_into(model, pipeline_cls, file, prefix, "verify", origin)
    return delta_weights(model, "verify", weights)
