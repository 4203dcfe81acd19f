"""`export-lora --verify`: load each exported file the way the family's pipeline does and check every key.

    python pipeline.py export-lora --config configs/flux-dev.toml --verify [--format kohya]

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


def _param_name(key: str, adapter: str) -> str:
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


def load_into(model: torch.nn.Module, pipeline_cls: Any, file: Path, prefix: str, adapter: str) -> dict[str, torch.Tensor]:
    """Load one exported file into the skeleton as `adapter`; VerifyError on any key problem.
    Returns the weights as loaded, in peft keys (the skeleton itself keeps them on the meta device)."""
    try:
        state, alphas, metadata = pipeline_state_dict(pipeline_cls, file)
    except Exception as e:  # noqa: BLE001 - the converters raise ValueError, AssertionError, KeyError
        raise VerifyError(f"{file.name}: {pipeline_cls.__name__}.lora_state_dict cannot read it "
                          f"({_what_failed(e)}). diffusers' kohya converters have known limits (README, "
                          f"'Using your LoRA'); ComfyUI may still read the file: export without --verify to keep "
                          f"it, or drop the layers it names from train.target_modules") from e
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
                   rtol: float = 1e-4) -> None:
    """The other file must hold every module of the reference with the same delta; extra modules
    are allowed only when their delta is zero (untrained members of a fused kohya layer)."""
    dropped = sorted(set(reference) - set(other))
    if dropped:
        raise VerifyError(f"{file.name}: {len(dropped)} trained module(s) are lost when the pipeline loads it: "
                          f"{dropped[:6]} (its converter does not map them; ComfyUI may still read the file)")
    extra = sorted(m for m in set(other) - set(reference) if other[m].abs().max() > 0)
    if extra:
        raise VerifyError(f"{file.name}: nonzero delta on module(s) the adapter never trained: {extra[:6]}")
    for module in reference:
        ref = reference[module]
        err = (other[module] - ref).abs().max().item()
        if err > rtol * max(ref.abs().max().item(), 1e-12):
            raise VerifyError(f"{file.name}: module '{module}' differs from the diffusers file by {err:.3g} "
                              f"(max |delta| {ref.abs().max().item():.3g})")


def verify_export(cfg: Any, manifest: dict[str, Any], file: Path) -> dict[str, Any]:
    """Check the diffusers file, and a kohya copy beside it if one was written. Returns a summary."""
    import diffusers

    from stages.core.kohya import KOHYA_FILE

    pipeline_cls = getattr(diffusers, manifest["pipeline_class"])
    prefix = manifest["lora_prefix"]
    reference = _check_file(cfg, pipeline_cls, prefix, file)
    summary: dict[str, Any] = {file.name: {"modules": len(reference)}}
    kohya = file.parent / KOHYA_FILE
    if kohya.exists():
        compare_deltas(reference, _check_file(cfg, pipeline_cls, prefix, kohya), kohya)
        summary[kohya.name] = {"modules": len(reference)}
    return summary


def _check_file(cfg: Any, pipeline_cls: Any, prefix: str, file: Path) -> Deltas:
    from stages.core.model_source import model_source

    model = denoiser_skeleton(model_source(cfg), prefix)
    weights = load_into(model, pipeline_cls, file, prefix, "verify")
    return delta_weights(model, "verify", weights)
