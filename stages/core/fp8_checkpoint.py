"""Pre-quantized "fp8_scaled" single-file checkpoints (the layout ComfyUI shares): read, convert once, cache.

Such a file stores each quantized weight as float8_e4m3fn (or e5m2) under `<layer>.weight` with its
fp32 scale under `<layer>.scale_weight` (one per tensor, or one per output row), an optional
`<layer>.scale_input`, and an empty marker tensor `scaled_fp8`. diffusers 0.42's `from_single_file`
does not apply those scales, so `dense_checkpoint(path, cache_root)` writes, once, a plain bf16
safetensors file with the same keys (weight * scale; scale, input-scale and marker keys dropped)
under `<cache_root>/fp8_scaled/<content id>/`, where `from_single_file` reads it as any other
single file (original BFL/SGM or diffusers key layout). With `train.base_precision = "fp8"` the
weights are quantized again at load, per output channel.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from stages.core.artifacts import atomic_dir, atomic_write_json, read_json
from stages.core.errors import ModelError

SCALE_SUFFIX = ".scale_weight"
DROPPED_SUFFIXES = (SCALE_SUFFIX, ".scale_input")
MARKER = "scaled_fp8"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DENSE_NAME = "model.safetensors"


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    if path.suffix.lower() not in (".safetensors", ".sft"):
        raise ModelError(f"'{path}' is not a safetensors file; fp8_scaled checkpoints are read from safetensors only "
                         f"(loading never unpickles)")
    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def is_fp8_scaled(path: Path) -> bool:
    """True for a safetensors file with fp8 scale tensors (reads the header only)."""
    keys = _keys(Path(path))
    return MARKER in keys or any(k.endswith(SCALE_SUFFIX) for k in keys)


def read_fp8_scaled(path: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every weight dense in `dtype` (fp8 ones times their scale); scale and marker keys dropped."""
    from safetensors import safe_open

    path = Path(path)
    keys = set(_keys(path))
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), "pt") as f:
        for key in sorted(keys):
            if key == MARKER or key.endswith(DROPPED_SUFFIXES):
                continue
            t = f.get_tensor(key)
            if t.dtype in FP8_DTYPES:
                scale_key = key.removesuffix(".weight") + SCALE_SUFFIX
                scale = f.get_tensor(scale_key).float() if scale_key in keys else torch.ones(())
                t = t.float() * _broadcast_scale(scale, t, scale_key, path)
            out[key] = t.to(dtype) if t.is_floating_point() else t
    return out


def _broadcast_scale(scale: torch.Tensor, weight: torch.Tensor, key: str, path: Path) -> torch.Tensor:
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.numel() == weight.shape[0]:
        return scale.reshape(-1, *([1] * (weight.dim() - 1)))
    raise ModelError(f"'{path}': {key} has {scale.numel()} values, but its weight has {weight.shape[0]} rows; "
                     f"expected one scale per tensor or per output row")


def content_id(path: Path) -> str:
    """sha256 of the whole file (FLUX.1 fp8: 12 GB, read once per conversion and per load)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()[:24]


def dense_checkpoint(path: Path, cache_root: Path) -> Path:
    """The bf16 safetensors file made from fp8_scaled `path`, converting it on first use only."""
    from safetensors.torch import save_file

    path = Path(path)
    cid = content_id(path)
    folder = Path(cache_root) / "fp8_scaled" / cid
    if (folder / "manifest.json").is_file() and read_json(folder / "manifest.json").get("content_id") == cid:
        return folder / DENSE_NAME
    folder.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(folder) as tmp:
        state = read_fp8_scaled(path)
        save_file(state, str(tmp / DENSE_NAME), metadata={"converted_from": path.name, "content_id": cid})
        atomic_write_json(tmp / "manifest.json", {"content_id": cid, "source": str(path), "tensors": len(state)})
    return folder / DENSE_NAME
