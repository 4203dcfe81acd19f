"""A pipeline folder built one component at a time, for a family whose whole pipeline the host cannot hold.

    python bench/bench.py build --family flux2 --folder /dev/shm/lorapipe-bench/flux2 --counts c.json \\
        --components text_encoder              # the module encode-captions loads, nothing else

FLUX.2 dev's bf16 pipeline is 112.6 GB (64.4 GB transformer, 48.0 GB Mistral); the 1-GPU host has
a 64 GB disk and a 128 GB /dev/shm that is its 125 GB of RAM. Each stage reads only its own
components (`src.load(cls, subfolder)`), so the bench builds those just before the stage runs:

- `model_index.json` is written whole from the first build on (the tiny pipeline of the same classes
  gives it), with the weightless parts (tokenizer/processor, scheduler) and every module not built yet
  as its config.json alone (a stage may read another component's config: SDXL's cache-latents reads
  the UNet's), so `ModelSource.check` and the memory planner's `meta_component` see a whole pipeline;
- each module is built on the GPU from a fixed seed (the same weights on a rebuild) and saved
  straight from there as sharded safetensors (`SHARD_SIZE`: a save holds one shard in host memory);
- a component the next stage does not read is replaced by a **stand-in** (`stand_in`): its JSON files
  stay, and each weight file becomes a sparse file of the same size holding only its first and last
  MiB, which is all `ModelSource.identity` reads of it. train checks that the captions and latents it
  reads are up to date (`train.check_upstream`), which recomputes encode-captions' and cache-latents'
  identities of the text encoder and the VAE: a deleted component would change them and train would
  refuse the caches. A stand-in occupies a few MiB on disk. No stage loads one: the bench rebuilds a
  component (same seed) before a stage that reads it. `bench-staged.json` at the folder root says
  which modules are built, stand-ins or configs only (model_source reads only the component folders).
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch

SHARD_SIZE = "5GB"  # one shard in host memory while saving (diffusers' default is 10GB, transformers' 50GB)
EDGE = 1 << 20  # model_source._file_edges reads the first and last MiB of a weight file
STATE_FILE = "bench-staged.json"


def stage_components(family: str, kind: str) -> tuple[str, ...]:
    """The modules one bench item's stage loads (the weightless parts are always in the folder):
    encode -> the text encoders, latents -> the VAE, train/export/profile/verify -> the denoiser."""
    from stages.families import get_family

    fam = get_family(family)
    parts = {"encode": fam.text_components, "latents": fam.vae_components}.get(kind, ())
    if kind in ("train", "export", "verify", "profile"):
        parts = fam.denoiser_components
    return tuple(c for c in parts if c in module_components(family))


def module_components(family: str) -> tuple[str, ...]:
    """The components with weights (built at full size by the family's full.py)."""
    from bench.full_configs import FULL

    return tuple(FULL[family])


def read_state(folder: Path, family: str) -> dict[str, str]:
    """module -> "built" | "stand-in" | "config" (its config.json only) for the family's modules in `folder`."""
    state = _read(folder)
    return {n: state[n] for n in module_components(family) if n in state and (folder / n).is_dir()}


def _read(folder: Path) -> dict[str, str]:
    f = folder / STATE_FILE
    return json.loads(f.read_text()) if f.exists() else {}


def _mark(folder: Path, name: str, how: str) -> None:
    state = {**_read(folder), name: how}
    tmp = folder / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    tmp.replace(folder / STATE_FILE)


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())  # one fixed seed per component: a rebuild makes the same weights


def build_components(family: str, folder: Path, names: list[str], tiny: bool, device: str = "cuda",
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Write `folder`'s model_index.json and weightless parts (once), then build and save each module in
    `names` (full size on `device` in `dtype`, or the tiny model); returns parameters (B) per module.
    Each component is saved under a temporary name and renamed, so a killed build leaves none half-made."""
    import diffusers

    from bench.full_configs import FULL, pipeline_extra
    from stages.families import demo_variant, family_part

    tiny_module = family_part(family, "tiny")
    parts = tiny_module.build_components(demo_variant(family), 0)
    unknown = sorted(set(names) - set(FULL[family]))
    if unknown:
        raise ValueError(f"{family} has no module component {unknown}; its modules: {', '.join(FULL[family])}")
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "model_index.json").exists():
        for name, part in parts.items():  # tokenizers, processors, schedulers: small, every stage may read them
            if not isinstance(part, torch.nn.Module):
                _save(part, folder, name)
        for name in set(FULL[family]) - set(names):  # a stage may read another module's config (SDXL's
            module = parts[name] if tiny else _build(family, name, parts, "meta", dtype)  # latents: the UNet's)
            _save(module, folder, name, config_only=True)
            _mark(folder, name, "config")
        extra = tiny_module.PIPELINE_EXTRA if tiny else pipeline_extra(family)
        pipe = getattr(diffusers, tiny_module.PIPELINE_CLASS)(**parts, **extra)
        pipe.save_config(str(folder))  # the same model_index.json as save_pretrained: the classes are the full ones'
    counts = {}
    for name in names:
        # tiny: built under the tiny builder's own seed; full size: under the component's. A rebuild is the same.
        module = parts[name] if tiny else _build(family, name, parts, device, dtype)
        counts[name] = sum(p.numel() for p in module.parameters()) / 1e9
        _save(module, folder, name)
        del module
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _mark(folder, name, "built")
    return counts


def _build(family: str, name: str, parts: dict[str, Any], device: str, dtype: torch.dtype) -> torch.nn.Module:
    from bench.full_configs import FULL, default_dtype

    torch.manual_seed(_seed(name))
    with torch.device(device), default_dtype(dtype):
        return FULL[family][name](parts).eval()


def _save(part: Any, folder: Path, name: str, config_only: bool = False) -> None:
    """`part.save_pretrained` (sharded where the class can), or only its config, into folder/name via a
    temporary folder."""
    tmp, final = folder / f".{name}.partial", folder / name
    shutil.rmtree(tmp, ignore_errors=True)
    if config_only:  # diffusers' ConfigMixin, or a transformers model's PretrainedConfig
        part.save_config(str(tmp)) if hasattr(part, "save_config") else part.config.save_pretrained(str(tmp))
    else:
        accepted = inspect.signature(part.save_pretrained).parameters
        kwargs = {k: v for k, v in (("safe_serialization", True), ("max_shard_size", SHARD_SIZE)) if k in accepted}
        part.save_pretrained(str(tmp), **kwargs)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def stand_in(folder: Path, name: str) -> int:
    """Replace component `name`'s weight files by sparse files of the same size with the same first and
    last MiB (its identity unchanged, its weights gone); returns the bytes freed."""
    freed = 0
    for f in sorted((folder / name).iterdir()):
        if f.is_dir() or f.suffix == ".json":
            continue  # configs and the shard index: read whole by identity and by the planner
        size, before = f.stat().st_size, f.stat().st_blocks * 512
        with f.open("rb") as fh:
            head = fh.read(EDGE)
            fh.seek(max(0, size - EDGE))
            tail = fh.read(EDGE)
        tmp = f.with_name(f".{f.name}.stand-in")
        with tmp.open("wb") as fh:
            fh.write(head)
            fh.truncate(size)  # a hole: no blocks between the edges
            fh.seek(max(0, size - EDGE))
            fh.write(tail)
        os.replace(tmp, f)
        freed += before - f.stat().st_blocks * 512
    _mark(folder, name, "stand-in")
    return freed
