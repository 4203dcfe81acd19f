"""Checkpoints of the `train` stage: lora/checkpoint-<step>/ save, load, retention, fresh starts.

A checkpoint folder holds the adapter (`adapter_model.safetensors`, `adapter_config.json`), the
training state and its manifest (written last, inside `atomic_dir`: a kill leaves no half folder).
The training state loads without running code: its tensors (optimizer moments, RNG states as uint8
tensors) are `training_state.safetensors`, everything else (step, scheduler, sampler position, the
batch-size histogram) is `training_state.json`, whose tags say where each tensor, tuple or int-keyed
dict goes. An older version's `training_state.pt` (a pickle) is never opened.

Every checkpoint carries its lineage (one per fresh start, inherited by resumes) and its save index,
so retention keeps the newest *written* ones of this lineage: a stop's checkpoint-3 is never pruned
because an abandoned run once reached checkpoint-16. A fresh start sets every older checkpoint and
lora/final aside into lora/.restarted-<time>/ (nothing is deleted).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from stages.core import faults
from stages.core.artifacts import atomic_dir, read_manifest, remove_dir, write_manifest
from stages.core.caches import complete_checkpoints, step_of  # noqa: F401 - step_of: still importable from here
from stages.core.errors import ArtifactError

STATE_TENSORS, STATE_JSON, OLD_PICKLE = "training_state.safetensors", "training_state.json", "training_state.pt"
_TENSOR, _TUPLE, _INT_KEYS = "__tensor__", "__tuple__", "__int_keys__"
_TAGS = {_TENSOR, _TUPLE, _INT_KEYS}


# ---- training state: tensors in safetensors, the rest in tagged JSON ----------------------------


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().to("cpu").contiguous()
        return {_TENSOR: path}
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict) and all(isinstance(k, str) and k not in _TAGS for k in obj):
        return {k: _encode(v, f"{path}.{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, dict) and all(isinstance(k, int) for k in obj):  # optimizer state: param index -> state
        return {_INT_KEYS: [[k, _encode(v, f"{path}.{k}", tensors)] for k, v in obj.items()]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"training state at '{path}': cannot store a {type(obj).__name__}")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _TENSOR in obj:
        return tensors[obj[_TENSOR]]
    if _TUPLE in obj:
        return tuple(_decode(v, tensors) for v in obj[_TUPLE])
    if _INT_KEYS in obj:
        return {int(k): _decode(v, tensors) for k, v in obj[_INT_KEYS]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def write_training_state(folder: Path, state: dict[str, Any]) -> None:
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, "state", tensors)
    (folder / STATE_TENSORS).write_bytes(save(tensors))  # Python's float repr round-trips every float exactly
    (folder / STATE_JSON).write_text(json.dumps(tree, indent=1))


def read_training_state(folder: Path) -> dict[str, Any]:
    """The state `write_training_state` wrote; runs no code (no unpickling). ArtifactError names
    an older version's pickle or a damaged folder."""
    from safetensors.torch import load_file

    if not (folder / STATE_JSON).is_file() and (folder / OLD_PICKLE).is_file():
        raise ArtifactError(f"'{folder}' was written by an older lorapipe version ({OLD_PICKLE}, a pickle, which "
                            f"is never loaded because unpickling can run code)")
    try:
        tree = json.loads((folder / STATE_JSON).read_text())
        return _decode(tree, load_file(str(folder / STATE_TENSORS)))
    except Exception as e:  # noqa: BLE001 - any damage (truncated, missing, edited) reads as damaged
        raise ArtifactError(f"'{folder}' has a damaged training state ({type(e).__name__}: {str(e)[:200]})") from e


# ---- the checkpoints of one run -----------------------------------------------------------------


class Checkpoints:
    """lora/checkpoint-* of one run, as seen by a train made with fingerprint `fp`."""

    def __init__(self, lora_dir: Path, fp: str, keep: int, log: Any):
        self.dir, self.fingerprint, self.keep, self.log = lora_dir, fp, keep, log
        self.lineage = uuid.uuid4().hex[:12]  # a fresh start's; `load_newest` adopts the resumed one's
        self.next_index = 0

    def matching(self) -> list[Path]:
        """Complete checkpoints made with this config, newest step first."""
        return [p for p in reversed(complete_checkpoints(self.dir)) if read_manifest(p).get("fingerprint") == self.fingerprint]

    def unfinished(self) -> Path | None:
        """The newest checkpoint of this config when lora/final is not its complete result."""
        found = self.matching()
        final = read_manifest(self.dir / "final") or {}
        finished = final.get("complete") and final.get("fingerprint") == self.fingerprint
        return found[0] if found and not (finished and final.get("step", 0) >= step_of(found[0])) else None

    def load_newest(self, check: Callable[[Path, dict[str, Any]], None],
                    load_adapter: Callable[[Path], None]) -> tuple[Path, dict[str, Any]] | None:
        """Load the newest loadable checkpoint of this config (`check` may refuse it); None if none
        matches. Matching ones that cannot be loaded are skipped with a warning; if none loads,
        ArtifactError says why."""
        found, failures = self.matching(), []
        for path in found:
            manifest = read_manifest(path)
            check(path, manifest)
            try:
                state = read_training_state(path)
                load_adapter(path)
            except Exception as e:  # noqa: BLE001 - damaged on disk after it was written: try an older one
                self.log.emit("warning", message=f"cannot resume from {path.name} ({e}); trying an older checkpoint")
                failures.append(str(e))
                continue
            self.lineage = manifest.get("lineage", self.lineage)
            self.next_index = 1 + max((self._index(p) for p in self._of_lineage()), default=-1)
            return path, state
        if failures:
            raise ArtifactError(f"cannot resume: {'; '.join(failures)}. Start over with --restart, which sets these "
                                f"checkpoints aside in {self.dir}/.restarted-<time>/ (nothing is deleted)")
        if self.dir.is_dir() and complete_checkpoints(self.dir):
            self.log.emit("warning", message="no checkpoint matches this config (settings changed): starting at step 0")
        return None

    def set_aside(self) -> Path | None:
        """Before a fresh start: move every checkpoint and lora/final into lora/.restarted-<time>/."""
        old = [p for p in self.dir.glob("checkpoint-*")] + [p for p in [self.dir / "final"] if p.exists()]
        if not old:
            return None
        aside = self.dir / f".restarted-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        aside.mkdir()
        for p in old:
            os.replace(p, aside / p.name)
        self.log.emit("warning", message=f"starting at step 0: the earlier checkpoints and adapter were moved to "
                                         f"'{aside}' (delete it when you no longer need them)")
        return aside

    def save(self, step: int, state: dict[str, Any], write_adapter: Callable[[Path], None],
             info: dict[str, Any]) -> Path:
        """Write lora/checkpoint-<step> (adapter, training state, manifest last), then prune."""
        final = self.dir / f"checkpoint-{step}"
        with atomic_dir(final) as tmp:
            write_adapter(tmp)
            write_training_state(tmp, state)
            faults.hit("mid-save")
            write_manifest(tmp, "train", kind="checkpoint", step=step, fingerprint=self.fingerprint,
                           lineage=self.lineage, save_index=self.next_index, **info)
        self.next_index += 1
        self.log.emit("checkpoint", step=step, path=str(final))
        self.prune()
        return final

    def prune(self) -> None:
        """Keep the `keep` newest by write order of this lineage (0: keep all); others are not ours."""
        if self.keep <= 0:
            return
        for old in sorted(self._of_lineage(), key=self._index)[:-self.keep]:
            remove_dir(old)  # renamed away first: a kill mid-delete never leaves a manifest over missing files

    def _of_lineage(self) -> list[Path]:
        return [p for p in complete_checkpoints(self.dir) if read_manifest(p).get("lineage") == self.lineage]

    @staticmethod
    def _index(path: Path) -> int:
        return int(read_manifest(path).get("save_index", -1))
