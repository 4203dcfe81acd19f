"""Artifact IO in one place: atomic files, manifests, fingerprints, locks and folders (the zarr row
stores are in stages/core/rowstore.py, the manifest schema in stages/core/schema.py).

Layout of a run folder (artifacts/<run>/):
    captions.zarr/            one RowStore; rows keyed by caption id      + manifest.json
    latents.zarr/<WxH>/       one RowStore per bucket; rows keyed by image id + manifest.json
    lora/checkpoint-<N>/, lora/final/                                       each with manifest.json
    export/                                                                  + manifest.json
    events.jsonl

A two-expert family (Wan 2.2 A14B: train.expert "high", "low" or "both") keeps each expert's adapter and
export in a folder of its own, lora/<expert>/ (checkpoint-<N>/, final/) and export/<expert>/, beside the
shared caches; `stages.core.caches.lora_dir` and `export_dir` are the one place that says where they are.

A manifest is always written last and atomically, so a folder without one (or with one whose
fingerprint differs, or one that does not parse) is never mistaken for a finished artifact.
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

from stages.core.errors import ArtifactError, StageLocked, UserError

SCHEMA_VERSION = 4  # a manifest of another version is treated as missing: its stage rebuilds the artifact
CODE_VERSION = "0.1.0"

# zarr warns about our manifest.json inside a store folder when it lists members; it is ours.
warnings.filterwarnings("ignore", message="Object at manifest.json is not recognized")


class DiskFull(UserError, OSError):
    """The disk (or quota) filled up while writing; the message names the file and the free space."""

    def __str__(self) -> str:  # the message alone, not RuntimeError's (errno, message) tuple
        return str(self.args[1]) if len(self.args) == 2 else super().__str__()


def disk_full(error: BaseException, path: Path, detail: str = "", rerun: str = "") -> DiskFull | None:
    """A DiskFull naming `path` when `error` is ENOSPC/EDQUOT, else None; one already made gets
    `rerun` (the command that continues the stage) when it names none."""
    if isinstance(error, DiskFull):
        return DiskFull(error.errno, str(error).replace("rerun the same command", f"rerun `{rerun}`")) if rerun else None
    if not (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)):
        return None
    again = f"`{rerun}`" if rerun else "the same command"
    return DiskFull(error.errno, f"disk full while writing '{path}'{detail} ({_free_space(path)} free): free some "
                                 f"space and rerun {again}; everything written before is intact and is kept")


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


def save_safetensors(path: Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, atomically and with the modes of the user's umask (save_file makes 0600
    files, which teammates on a shared machine cannot read)."""
    from safetensors.torch import save

    atomic_write_bytes(path, save(tensors, metadata=metadata))


def user_umask() -> int:
    """The process's umask, read without changing it (os.umask would, for a moment, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def user_modes(folder: Path) -> None:
    """Give `folder` and everything in it the modes a new file or folder gets under the user's umask,
    whatever the library that wrote them chose."""
    mask = user_umask()
    for p in [folder, *folder.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


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


class DamagedManifest(UserWarning):
    """A manifest.json that does not parse or does not match the schema: read as missing."""


def write_manifest(artifact_dir: Path, stage: str, **fields: Any) -> dict[str, Any]:
    """Write an artifact's manifest, last and atomically, after checking it against MANIFEST_SCHEMA
    (a violation is a bug in the stage that writes it: ValueError, nothing written)."""
    from stages.core.schema import manifest_kind, validate_manifest

    manifest = {"schema_version": SCHEMA_VERSION, "code_version": CODE_VERSION, "stage": stage,
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **fields}
    problems = validate_manifest(manifest_kind(stage, fields), json.loads(json.dumps(manifest, default=str)))
    if problems:
        raise ValueError(f"manifest of '{artifact_dir}' breaks the schema: {'; '.join(problems)}")
    atomic_write_json(manifest_path(artifact_dir), manifest)
    return manifest


def read_manifest(artifact_dir: Path) -> dict[str, Any] | None:
    """The artifact's manifest, or None when there is none. One that does not parse, was written by
    another schema version or breaks the schema is also None (the artifact counts as unfinished and
    its stage rebuilds it), with a DamagedManifest warning naming the file and what rewrites it: never
    a crash."""
    m, why = _checked_manifest(manifest_path(artifact_dir))
    if why is not None:
        warnings.warn(f"'{manifest_path(artifact_dir)}' is treated as missing: {why}; {repair_advice(artifact_dir)}",
                      DamagedManifest, stacklevel=2)
    return m


def manifest_damage(artifact_dir: Path) -> str | None:
    """Why the artifact's manifest.json cannot be used (it does not parse, another version wrote it, it
    breaks the schema), without a warning; None when it is fine or there is none."""
    return _checked_manifest(manifest_path(artifact_dir))[1]


def _checked_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    from stages.core.schema import manifest_kind, validate_manifest

    if not path.is_file():
        return None, None
    try:
        m = read_json(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"it does not parse ({e})"
    if not isinstance(m, dict) or m.get("schema_version") != SCHEMA_VERSION:
        version = m.get("schema_version") if isinstance(m, dict) else None
        return None, f"another lorapipe version wrote it (schema {version!r}, this one reads {SCHEMA_VERSION})"
    problems = validate_manifest(manifest_kind(str(m.get("stage")), m), m)
    return (None, "; ".join(problems[:3])) if problems else (m, None)


def repair_advice(artifact_dir: Path) -> str:
    """What rewrites the manifest of an artifact of a run folder, by the kind of artifact: a cache keeps
    its rows, an adapter is written again from the newest complete checkpoint, an export or the samples
    are made again. Names the command where the folder lies in a run's folder as lorapipe lays it out."""
    from stages.core.caches import CAPTIONS, EXPORT, LATENTS, LORA, SAMPLES
    from stages.core.runspec import command_for

    folder, kind = artifact_dir, artifact_dir.name
    top = next((p for p in (folder, *folder.parents) if p.name in (CAPTIONS, LATENTS, LORA, EXPORT, SAMPLES)), None)
    if top is None:
        return "rerunning its stage rewrites it"
    run_dir = top.parent
    if top.name in (CAPTIONS, LATENTS):
        stage = "encode-captions" if top.name == CAPTIONS else "cache-latents"
        return f"`{command_for(run_dir, stage)}` rewrites it and keeps the cached rows (only missing ones are encoded)"
    if top.name == LORA and kind.startswith("checkpoint-"):
        return "the checkpoint counts as incomplete: --resume continues from the newest complete one"
    if top.name == LORA:
        return (f"`{command_for(run_dir, 'train', '--resume')}` writes the adapter again from the newest complete "
                f"checkpoint (`{command_for(run_dir, 'train', '--restart')}` trains it again where there is none)")
    stage = "export-lora" if top.name == EXPORT else "sample"
    return f"`{command_for(run_dir, stage)}` makes {'the export' if stage == 'export-lora' else 'the samples'} again"


def invalidate_manifest(artifact_dir: Path) -> None:
    """Remove a manifest before its artifact is rebuilt in place, so a kill midway never leaves an
    old manifest vouching for new, half-written contents."""
    manifest_path(artifact_dir).unlink(missing_ok=True)


def require_manifest(artifact_dir: Path, command: str) -> dict[str, Any]:
    """The artifact's manifest; ArtifactError naming `command` (a whole command line) that makes it."""
    m = read_manifest(artifact_dir)
    if m is None:
        raise ArtifactError(f"'{artifact_dir}' is missing or incomplete: run `{command}` first")
    return m


# ---- zarr row stores -------------------------------------------------------------------------


def __getattr__(name: str) -> Any:
    """`RowStore` lives in stages.core.rowstore; older imports from here keep working."""
    if name == "RowStore":
        from stages.core.rowstore import RowStore

        return RowStore
    raise AttributeError(name)


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
    `sweep_leftovers`. Write the folder's manifest last inside the block. Its files get the modes of
    the user's umask (`user_modes`)."""
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with naming_full_disk(final):
            yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    user_modes(tmp)
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
