"""Where a model comes from: a local diffusers pipeline folder, a hub id (+ revision), or a
single-file checkpoint of the denoiser.

Each stage loads only its own components (`subfolder=`), through the same `from_pretrained` call a
user's real model takes. `identity()` is cheap (no weights read) and feeds the stage fingerprints.

A single file (`model = "/ckpts/my-flux-finetune.safetensors"`) replaces the denoiser only
(`transformer` or `unet`), loaded with diffusers' `from_single_file`, which reads the original
(BFL, SGM, ...) or diffusers key layout; every other component and all configs come from a base
pipeline: `base` when given, else the repo diffusers infers from the checkpoint's keys (e.g.
black-forest-labs/FLUX.1-dev), which must then be in the local Hugging Face cache when offline.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.errors import ModelError


SINGLE_FILE_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin", ".gguf")
# The components a single-file checkpoint replaces: the denoiser. Text encoders and the VAE come from
# the base pipeline (a full SDXL checkpoint holds them too, but fine-tunes ship changed denoisers).
SINGLE_FILE_COMPONENTS = ("transformer", "unet")


@dataclass(frozen=True)
class ModelSource:
    ref: str
    revision: str = ""
    base: str = ""
    """For a single-file `ref`: the diffusers folder or hub id that supplies everything else."""
    cache_root: str = ""
    """Where a converted fp8_scaled single file is cached (`<artifacts>/.model-cache`; empty: beside the file)."""

    @property
    def is_local(self) -> bool:
        return Path(self.ref).exists() or self.ref.startswith((".", "/", "~"))

    @property
    def is_single_file(self) -> bool:
        return self.ref.lower().endswith(SINGLE_FILE_SUFFIXES)

    def base_source(self) -> "ModelSource":
        """The pipeline that supplies configs and non-denoiser components of a single file."""
        if self.base:
            return ModelSource(self.base, self.revision, cache_root=self.cache_root)
        return ModelSource(_inferred_base(str(self.path)))

    @property
    def path(self) -> Path:
        return Path(self.ref).expanduser()

    def check(self, components: tuple[str, ...], family: Any = None) -> None:
        """Fail early, naming the folder, when a local model lacks a component a stage needs, or (given
        the run's `family`) holds another family's denoiser."""
        if self.is_single_file:
            if not self.path.is_file():
                raise ModelError(f"single-file checkpoint '{self.ref}' does not exist")
            self.base_source().check(tuple(c for c in components if c not in SINGLE_FILE_COMPONENTS))
            return
        if not self.is_local:
            require_hub(self.ref)
            return
        if self.path.is_file():
            raise ModelError(
                f"model '{self.ref}' is a file, neither a diffusers pipeline folder (with model_index.json) nor a "
                f"single-file checkpoint ({', '.join(SINGLE_FILE_SUFFIXES)}): point 'model' at one of those")
        if not self.path.is_dir():
            raise ModelError(
                f"model '{self.ref}' does not exist. Set 'model' to a diffusers pipeline folder "
                f"(with model_index.json) or a hub id such as black-forest-labs/FLUX.1-dev"
            )
        if not (self.path / "model_index.json").is_file():
            raise ModelError(
                f"model folder '{self.ref}' is not a diffusers pipeline (no model_index.json). "
                f"Point 'model' at the folder that holds model_index.json and the component subfolders"
            )
        if family is not None:
            self.check_family(family)
        for comp in components:
            if not (self.path / comp).is_dir():
                raise ModelError(f"model folder '{self.ref}' has no '{comp}' subfolder, which this stage needs")

    def check_family(self, family: Any, fits: list[str] | None = None) -> None:
        """ModelError naming both when the folder's denoiser is not the class `family` trains (a FLUX folder
        with family = "sdxl" would otherwise load T5 as a CLIP encoder and fail deep in transformers).
        Only a local pipeline folder is checked (a hub id or single file is checked where it loads).
        `fits`: the families that do train this folder (stages.families.check_model_family finds them)."""
        if self.is_single_file or not (self.path / "model_index.json").is_file():
            return
        index = json.loads((self.path / "model_index.json").read_text())
        held_classes = {c: index[c][1] if isinstance(index.get(c), list) and len(index[c]) == 2 else None
                        for c in family.denoiser_components}  # every one (Wan 2.2 A14B: both experts)
        held_classes = {c: held for c, held in held_classes.items() if not str(held).endswith("Scheduler")}  # SDXL's
        denoiser, held_class = next(((c, held) for c, held in held_classes.items() if held != family.denoiser_class),
                                    (None, None))
        if denoiser is None:
            return
        pipeline = index.get("_class_name", "an unknown pipeline")
        other = f"point 'model' at a {family.pipeline_class} folder"
        fix = f"set family = '{fits[0]}' (it trains this folder), or {other}" if fits else other
        raise ModelError(f"model folder '{self.ref}' holds a {pipeline} ({denoiser}: {held_class or 'none'}), but "
                         f"family = '{family.name}' trains a {family.pipeline_class} ({denoiser}: "
                         f"{family.denoiser_class}): {fix}")

    def load(self, cls: Any, subfolder: str, **kwargs: Any) -> Any:
        """`cls.from_pretrained(ref, subfolder=...)`; a hub id that is not cached gives a clear error."""
        if self.is_single_file:
            if subfolder in SINGLE_FILE_COMPONENTS:
                return self._load_single_file(cls, subfolder, **kwargs)
            return self.base_source().load(cls, subfolder, **kwargs)
        if self.revision:
            kwargs["revision"] = self.revision
        if not self.is_local:
            require_hub(self.ref)
        try:
            return cls.from_pretrained(str(self.path) if self.is_local else self.ref, subfolder=subfolder, **kwargs)
        except OSError as e:
            where = "from" if self.is_local else "of"
            raise ModelError(f"cannot load '{subfolder}' {where} '{self.ref}': {_offline_hint(self.ref, e)}") from e

    def _load_single_file(self, cls: Any, subfolder: str, **kwargs: Any) -> Any:
        from stages.core import fp8_checkpoint

        if not hasattr(cls, "from_single_file"):
            raise ModelError(f"'{self.ref}' is a single-file checkpoint, but diffusers 0.42 has no from_single_file "
                             f"for {cls.__name__}: convert it to a diffusers folder and point 'model' at that")
        base = self.base_source()
        config = str(base.path) if base.is_local else base.ref
        path = self.path
        if path.suffix.lower() in (".safetensors", ".sft") and fp8_checkpoint.is_fp8_scaled(path):
            # diffusers' from_single_file ignores scale_weight: read the bf16 copy made once from it
            cache = Path(self.cache_root) if self.cache_root else path.parent / ".lorapipe-model-cache"
            path = fp8_checkpoint.dense_checkpoint(path, cache)
        try:
            return cls.from_single_file(str(path), config=config, subfolder=subfolder, **kwargs)
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"cannot load the {subfolder} of single-file checkpoint '{self.ref}' with the configs of "
                             f"'{config}': {_offline_hint(config, e)}") from e

    def load_pipeline(self, cls: Any, **kwargs: Any) -> Any:
        """The whole pipeline (the sample stage): `cls.from_pretrained`, with a single-file denoiser
        loaded first and passed in."""
        if self.is_single_file:
            base = self.base_source()
            index = base.component_config("", "model_index.json")
            for sub in SINGLE_FILE_COMPONENTS:
                if sub in index:
                    import diffusers

                    kwargs[sub] = self._load_single_file(getattr(diffusers, index[sub][1]), sub,
                                                         torch_dtype=kwargs.get("torch_dtype"))
            return base.load_pipeline(cls, **kwargs)
        if self.revision:
            kwargs["revision"] = self.revision
        if not self.is_local:
            require_hub(self.ref)
        try:
            return cls.from_pretrained(str(self.path) if self.is_local else self.ref, **kwargs)
        except OSError as e:
            raise ModelError(f"cannot load the {cls.__name__} of '{self.ref}': {_offline_hint(self.ref, e)}") from e
        except ImportError as e:  # a component's class needs a package the other stages never import
            import torch

            missing = " ".join(str(e).split()).split(". ")[0].rstrip(".") + "."  # its first sentence
            hint = (f"install the torchvision build that matches torch {torch.__version__}"
                    if "torchvision" in str(e).lower() else "install the package it names")
            raise ModelError(f"cannot load the {cls.__name__} of '{self.ref}' (the sample stage builds every component "
                             f"of the pipeline): {missing} encode-captions, cache-latents, train and export-lora do not "
                             f"need it; {hint}, or leave sampling out (sample.after_train = false)") from e

    def component_config(self, subfolder: str, name: str = "config.json") -> dict[str, Any]:
        """A component's JSON config without loading weights (local folders or the hub cache)."""
        if self.is_single_file:
            return self.base_source().component_config(subfolder, name)
        if self.is_local:
            path = self.path / subfolder / name
        else:
            from huggingface_hub import hf_hub_download

            require_hub(self.ref)
            try:
                path = Path(hf_hub_download(self.ref, f"{subfolder}/{name}" if subfolder else name,
                                            revision=self.revision or None))
            except Exception as e:  # noqa: BLE001 - hub errors come in many types
                raise ModelError(f"cannot read {subfolder}/{name} of '{self.ref}': {_offline_hint(self.ref, e)}") from e
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelError(f"model '{self.ref}' has no {subfolder}/{name}") from None

    def weight_files(self, subfolder: str) -> list[Path] | None:
        """A diffusers component's safetensors weights (every shard of an index, or the one file), local or
        in the hub cache; None for a single-file checkpoint or a component saved otherwise (.bin, variants)."""
        if self.is_single_file:
            return None
        name = f"{subfolder}/diffusion_pytorch_model.safetensors" if subfolder else "diffusion_pytorch_model.safetensors"

        def fetch(rel: str) -> Path | None:
            if self.is_local:
                return self.path / rel if (self.path / rel).is_file() else None
            from huggingface_hub import hf_hub_download

            try:
                return Path(hf_hub_download(self.ref, rel, revision=self.revision or None, local_files_only=True))
            except Exception:  # noqa: BLE001 - not in the hub cache: the caller loads the ordinary way (and downloads)
                return None

        index = fetch(f"{name}.index.json")
        if index is None:
            single = fetch(name)
            return [single] if single else None
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [fetch(f"{subfolder}/{shard}" if subfolder else shard) for shard in shards]
        return paths if all(paths) else None

    def identity(self, components: tuple[str, ...]) -> str:
        """Content identity of the named components (configs, weight sizes and edges; not the path)."""
        if self.is_single_file:
            own = [c for c in components if c in SINGLE_FILE_COMPONENTS]
            rest = tuple(c for c in components if c not in SINGLE_FILE_COMPONENTS)
            h = hashlib.sha256(_file_edges(self.path).encode() if own else b"")
            return f"file:{h.hexdigest()[:16]}+{self.base_source().identity(rest) if rest else ''}"
        if not self.is_local:
            return f"hub:{self.ref}@{self.revision or 'main'}"
        h = hashlib.sha256()
        for comp in sorted(components):
            folder = self.path / comp
            if not folder.is_dir():
                h.update(f"{comp}:missing".encode())
                continue
            for f in sorted(folder.iterdir()):
                h.update(f.name.encode())
                if f.is_dir():
                    continue
                h.update(f.read_bytes() if f.suffix == ".json" else _file_edges(f).encode())
        return f"local:{h.hexdigest()[:16]}"


def stored_dtypes(files: list[Path] | None) -> dict[str, str]:
    """Each tensor's stored dtype ("BF16", "F32", ...) by key, from the headers of these safetensors files
    (`ModelSource.weight_files`; no data read); {} for no files or an unreadable header. The train planner
    reads them once for both questions it asks of a denoiser's files (`stored_as_bf16`, `fp8.streams`)."""
    from safetensors import safe_open

    dtypes: dict[str, str] = {}
    try:
        for f in files or []:
            with safe_open(str(f), framework="pt") as h:
                dtypes.update((k, h.get_slice(k).get_dtype()) for k in h.keys())
    except Exception:  # noqa: BLE001 - an unreadable header: the callers assume a copy, and no stream
        return {}
    return dtypes


def stored_as_bf16(dtypes: dict[str, str]) -> bool:
    """Whether every floating tensor of these files (`stored_dtypes`) is stored as bf16: then a bf16 load
    reads them as mapped file pages, which the kernel can drop and read again, not as a copy in host
    memory (bench/fp8.md "Loading an fp8 base")."""
    return bool(dtypes) and {d for d in dtypes.values() if d.startswith(("F", "BF"))} == {"BF16"}


def model_source(cfg: Any) -> ModelSource:
    """The run's model: `model` (+ `revision`), with `model_base` for a single file and the artifacts'
    model cache for converted checkpoints."""
    return ModelSource(cfg.model, cfg.revision, cfg.model_base, str(Path(cfg.artifacts) / ".model-cache"))


def _file_edges(path: Path) -> str:
    """Size plus the first and last MiB: tells two checkpoints apart without reading 20 GB."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as fh:
        h.update(fh.read(1 << 20))
        fh.seek(max(0, size - (1 << 20)))
        h.update(fh.read(1 << 20))
    return h.hexdigest()


# Without a network, huggingface_hub retries each file 5 times with backoff (~30-50 s per stage);
# one HEAD request with this timeout tells first. Seconds; LORAPIPE_HUB_TIMEOUT overrides it.
HUB_PROBE_TIMEOUT_S = 5.0
_hub_problem: dict[str, str] = {}  # endpoint -> why it is unreachable ("" when reachable): one probe a process


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (1/ON/YES/TRUE)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def require_hub(ref: str) -> None:
    """Fail at once, naming the way offline, when hub id `ref` would be fetched from an unreachable hub
    (nothing to do when HF_HUB_OFFLINE is set: then the library reads only its cache)."""
    if hub_offline():
        return
    from huggingface_hub import constants, get_session, try_to_load_from_cache

    endpoint = constants.ENDPOINT
    if endpoint not in _hub_problem:
        timeout = float(os.environ.get("LORAPIPE_HUB_TIMEOUT", HUB_PROBE_TIMEOUT_S))
        try:
            get_session().head(endpoint, timeout=timeout)
            _hub_problem[endpoint] = ""
        except Exception as e:  # noqa: BLE001 - connect errors and timeouts come in many types
            _hub_problem[endpoint] = f"{type(e).__name__}: {e}"
    if not _hub_problem[endpoint]:
        return
    cached = isinstance(try_to_load_from_cache(ref, "model_index.json"), str)
    fix = (f"'{ref}' is in the local Hugging Face cache: set HF_HUB_OFFLINE=1 to use it"
           if cached else f"download it on a machine with network (`hf download {ref}`), copy "
           f"~/.cache/huggingface here and set HF_HUB_OFFLINE=1")
    raise ModelError(f"model '{ref}' is a hub id, but {endpoint} cannot be reached ({_hub_problem[endpoint]}): {fix}; "
                     f"or point 'model' at a local diffusers folder")


def _offline_hint(ref: str, error: BaseException) -> str:
    if Path(ref).exists() or ref.startswith((".", "/", "~")):
        return str(error)
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return (f"HF_HUB_OFFLINE=1 is set and '{ref}' is not in the Hugging Face cache: run "
                f"`hf download {ref}` on a machine with network (then copy ~/.cache/huggingface), "
                f"or point 'model' at a local diffusers folder. ({error})")
    return (f"check the id and `hf auth login` (gated models need access); with no network, download it "
            f"elsewhere (`hf download {ref}`), copy ~/.cache/huggingface here and set HF_HUB_OFFLINE=1, "
            f"or point 'model' at a local diffusers folder. ({error})")


class _LazyCheckpoint(dict):
    """Keys of a .safetensors file; a tensor is read only when asked for (diffusers' model-type
    inference reads a handful of shapes, not 20 GB)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self._file = safe_open(path, "pt")
        super().__init__({k: None for k in self._file.keys()})

    def __getitem__(self, key: str) -> Any:
        if super().__getitem__(key) is None:
            super().__setitem__(key, self._file.get_tensor(key))
        return super().__getitem__(key)


def _inferred_base(path: str) -> str:
    """The hub repo diffusers' from_single_file would take configs from for this checkpoint."""
    from diffusers.loaders.single_file_utils import fetch_diffusers_config

    if not path.endswith((".safetensors", ".sft")):
        raise ModelError(f"cannot tell which model '{path}' is without loading it: use a .safetensors file, or "
                         f"give the base pipeline explicitly (ModelSource(..., base=<folder or hub id>))")
    try:
        return fetch_diffusers_config(_LazyCheckpoint(path))["pretrained_model_name_or_path"]
    except Exception as e:  # noqa: BLE001 - inference fails with KeyError/IndexError on unknown layouts
        raise ModelError(f"diffusers does not recognise the architecture of '{path}' ({type(e).__name__}: {e}); "
                         f"convert it to a diffusers folder and point 'model' at that") from e
