"""Artifact IO in one place: atomic files, manifests, fingerprints, zarr row stores and locks.

Layout of a run folder (artifacts/<run>/):
    captions.zarr/            one RowStore; rows keyed by caption id      + manifest.json
    latents.zarr/<WxH>/       one RowStore per bucket; rows keyed by image id + manifest.json
    lora/checkpoint-<N>/, lora/final/                                       each with manifest.json
    export/                                                                  + manifest.json
    events.jsonl

A manifest is always written last and atomically, so a folder without one (or with one whose
fingerprint differs) is never mistaken for a finished artifact.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from stages.core.errors import ArtifactError, StageLocked, UserError

SCHEMA_VERSION = 1
CODE_VERSION = "0.1.0"

# zarr warns about our manifest.json inside a store folder when it lists members; it is ours.
warnings.filterwarnings("ignore", message="Object at manifest.json is not recognized")


class DiskFull(UserError, OSError):
    """The disk (or quota) filled up while writing; the message names the file and the free space."""


def disk_full(error: BaseException, path: Path, detail: str = "") -> DiskFull | None:
    """A DiskFull naming `path` when `error` is ENOSPC/EDQUOT (and not one already), else None."""
    if isinstance(error, DiskFull) or not (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)):
        return None
    return DiskFull(error.errno, f"disk full while writing '{path}'{detail} ({_free_space(path)} free): free some "
                                 f"space and rerun the same command; everything written before is intact and is kept")


@contextlib.contextmanager
def naming_full_disk(path: Path, detail: str = "") -> Iterator[None]:
    """Turn a bare "No space left on device" inside the block into a DiskFull that names `path`."""
    try:
        yield
    except OSError as e:
        full = disk_full(e, path, detail)
        if full is None:
            raise
        raise full from e


def _free_space(path: Path) -> str:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.0f} MiB"
    except OSError:
        return "unknown"


# ---- atomic files ----------------------------------------------------------------------------


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with naming_full_disk(path), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def fingerprint(obj: Any) -> str:
    """Stable hash of a JSON-able object (dict keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---- manifests -------------------------------------------------------------------------------


def manifest_path(artifact_dir: Path) -> Path:
    return artifact_dir / "manifest.json"


def write_manifest(artifact_dir: Path, stage: str, **fields: Any) -> dict[str, Any]:
    manifest = {"schema_version": SCHEMA_VERSION, "code_version": CODE_VERSION, "stage": stage,
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **fields}
    atomic_write_json(manifest_path(artifact_dir), manifest)
    return manifest


def read_manifest(artifact_dir: Path) -> dict[str, Any] | None:
    path = manifest_path(artifact_dir)
    if not path.is_file():
        return None
    try:
        m = read_json(path)
    except json.JSONDecodeError:
        return None
    return m if m.get("schema_version") == SCHEMA_VERSION else None


def invalidate_manifest(artifact_dir: Path) -> None:
    """Remove a manifest before its artifact is rebuilt in place, so a kill midway never leaves an
    old manifest vouching for new, half-written contents."""
    manifest_path(artifact_dir).unlink(missing_ok=True)


def require_manifest(artifact_dir: Path, command: str) -> dict[str, Any]:
    m = read_manifest(artifact_dir)
    if m is None:
        raise ArtifactError(f"'{artifact_dir}' is missing or incomplete: run `python pipeline.py {command}` first")
    return m


# ---- zarr row stores -------------------------------------------------------------------------

_LOGICAL = {"float16": np.float16, "float32": np.float32, "int64": np.int64, "int32": np.int32,
            "uint8": np.uint8, "bool": np.bool_}


class RowStore:
    """A zarr group of arrays shaped (rows, *item_shape), one chunk per row, plus an `ids` list and a
    `written` flag per row that is set only after all of the row's arrays are on disk.

    bfloat16 has no zarr dtype: it is stored as its raw uint16 bits with `logical_dtype` set.
    Rows are written by row index from a plan; concurrent writers of different rows never share a
    chunk (no sharding), so they cannot lose each other's data.
    """

    def __init__(self, group: Any):
        self.group = group

    @classmethod
    def create(cls, path: Path, ids: list[str], fields: dict[str, tuple[tuple[int, ...], str]]) -> "RowStore":
        import zarr

        remove_dir(path)  # atomically gone (manifest too), never half-deleted under a valid manifest
        group = zarr.open_group(str(path), mode="w")
        n = len(ids)
        for name, (shape, dtype) in fields.items():
            store_dtype = "uint16" if dtype == "bfloat16" else dtype
            arr = group.create_array(name, shape=(n, *shape), chunks=(1, *shape), dtype=store_dtype,
                                     fill_value=0, compressors=None)
            arr.attrs["logical_dtype"] = dtype
        group.create_array("written", shape=(n,), chunks=(1,), dtype="uint8", fill_value=0, compressors=None)
        group.attrs["ids"] = list(ids)
        return cls(group)

    @classmethod
    def open(cls, path: Path, mode: str = "r") -> "RowStore":
        import zarr

        return cls(zarr.open_group(str(path), mode=mode))

    @property
    def ids(self) -> list[str]:
        return list(self.group.attrs["ids"])

    @property
    def fields(self) -> list[str]:
        return sorted(k for k in self.group.array_keys() if k != "written")

    def append_rows(self, new_ids: list[str]) -> None:
        """Grow every array by len(new_ids) rows (new rows unwritten)."""
        ids = self.ids + list(new_ids)
        for name in list(self.group.array_keys()):
            arr = self.group[name]
            arr.resize((len(ids), *arr.shape[1:]))
        self.group.attrs["ids"] = ids

    def written_mask(self) -> np.ndarray:
        return np.asarray(self.group["written"][:], dtype=bool)

    def write_row(self, row: int, values: dict[str, Any]) -> None:
        """Write every array of a row, then its `written` flag. Each zarr chunk is replaced
        atomically (temp file + rename), and one chunk holds one row, so a kill at any moment
        leaves the row either flagged and complete or unflagged (and redone by the next run)."""
        from stages.core import faults

        with naming_full_disk(Path(str(self.group.store.root)), f", row {row}"):
            for name, value in values.items():
                arr = self.group[name]
                if arr.attrs.get("logical_dtype") == "bfloat16":
                    value = _bf16_bits(value)
                else:
                    value = _to_numpy(value).astype(arr.dtype, copy=False)
                arr[row] = value
            faults.hit("mid-row")
            self.group["written"][row] = 1

    def read_rows(self, rows: list[int], names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Arrays for the given rows, in order (bfloat16 rows come back as float32)."""
        return {name: np.stack([self.read(name, r) for r in rows]) for name in names or self.fields}

    def read(self, name: str, index: Any) -> np.ndarray:
        """One zarr selection (e.g. ``(row, variant)``) of a field, bfloat16 returned as float32."""
        arr = self.group[name]
        data = np.asarray(arr[index])
        if arr.attrs.get("logical_dtype") == "bfloat16":
            data = (data.astype(np.uint32) << 16).view(np.float32)
        return data

    def nbytes_stored(self) -> int:
        return sum(int(self.group[n].nbytes) for n in self.group.array_keys())


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _bf16_bits(value: Any) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits, as torch does."""
    if hasattr(value, "detach") and str(value.dtype) == "torch.bfloat16":
        import torch

        return value.detach().cpu().view(torch.int16).numpy().view(np.uint16)
    f = np.ascontiguousarray(_to_numpy(value), dtype=np.float32).view(np.uint32)
    rounded = f + 0x7FFF + ((f >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


# ---- locks and folders -----------------------------------------------------------------------


@contextlib.contextmanager
def stage_lock(run_dir: Path, stage: str) -> Iterator[None]:
    """Exclusive per-(run, stage) lock; a second process refuses at once, naming the holder."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f".{stage}.lock"
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise StageLocked(
            f"stage '{stage}' of run '{run_dir.name}' is already running ({holder}); wait for it, "
            f"or stop it with `lorapipe stop {run_dir.name} --artifacts {run_dir.parent}`"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()}")
    fh.flush()
    try:
        yield
    finally:
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


def lock_holder_pid(run_dir: Path, stage: str) -> int | None:
    """pid of the process holding the stage lock, or None when nobody holds it."""
    path = run_dir / f".{stage}.lock"
    if not path.exists():
        return None
    with open(path) as fh:  # read-only: `status` works on a read-only artifacts folder; flock needs no write access
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            text = fh.read().strip()
            return int(text.split()[-1]) if text.startswith("pid ") else None
        fcntl.flock(fh, fcntl.LOCK_UN)
    return None


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Fill a hidden temporary folder beside `final` (yielded), then rename it to `final` in one step.

    A kill, a second signal or a full disk midway leaves the previous `final` (or none), never a
    half-written one; the temporary folder is deleted on failure, and a killed writer's is swept by
    `sweep_leftovers`. Write the folder's manifest last inside the block."""
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with naming_full_disk(final):
            yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, final)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a fully written folder into place; an older folder of that name is removed first."""
    if final.exists():
        old = final.with_name(f".{final.name}.old.{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def remove_dir(path: Path) -> None:
    """Delete a folder so that it disappears at once: rename it to a hidden name, then delete that.
    (rmtree alone, killed midway, can leave a manifest beside half its files.)"""
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.trash.{os.getpid()}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def sweep_leftovers(folder: Path) -> int:
    """Delete what killed writers leave behind: zarr's `*.partial` chunk files and our hidden
    `.<name>.tmp` / `.trash.` / `.old.` files and folders. None of them is ever read as valid;
    this only frees their space. Returns how many were removed."""
    if not folder.is_dir():
        return 0
    found = [p for p in folder.rglob("*") if p.name.endswith(".partial")
             or (p.name.startswith(".") and any(t in p.name for t in (".tmp", ".trash.", ".old.")))]
    for p in found:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return len(found)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0
