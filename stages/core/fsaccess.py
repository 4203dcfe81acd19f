"""Folders that cannot be written and names too long for the file system, as messages.

A writing command checks its run folder before it loads anything (`ensure_writable`); read-only
commands (`status`, `inspect`, `report`) never need to write. An OSError that still reaches the CLI
is turned into one line naming the path (`os_error_message`). Imports no torch.
"""

from __future__ import annotations

import errno
import hashlib
import tempfile
from pathlib import Path

from stages.core.errors import ResourceError

NAME_MAX = 255  # bytes per file name on ext4, xfs, btrfs and tmpfs

HINTS = {
    errno.EACCES: "make it writable, or pass --artifacts <a writable folder>",
    errno.EPERM: "make it writable, or pass --artifacts <a writable folder>",
    errno.EROFS: "it is on a read-only file system: pass --artifacts <a writable folder>",
    errno.ENOSPC: "the disk is full: free space, or pass --artifacts <a folder on another disk>",
    errno.ENAMETOOLONG: f"a file name may have at most {NAME_MAX} bytes: use a shorter run or item name, or --out",
}


def os_error_message(e: OSError) -> str:
    """'cannot write '<path>': Permission denied; make it writable, ...' in one line."""
    where = f" '{e.filename}'" if e.filename else ""
    return f"{e.strerror or type(e).__name__}:{where}" + (f"; {HINTS[e.errno]}" if e.errno in HINTS else "")


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def ensure_writable(folder: Path) -> None:
    """ResourceError when `folder` (or, before it exists, the nearest folder above it) cannot take a
    new file. It tries to create one: os.access answers 'yes' to root on a read-only mount."""
    probe_in = _existing_parent(folder)
    try:
        with tempfile.TemporaryFile(dir=probe_in, prefix=".lorapipe-write-check-"):
            pass
    except OSError as e:
        raise ResourceError(f"the artifacts folder '{probe_in}' is not writable ({e.strerror}); "
                            f"make it writable or pass --artifacts <a writable folder>. Read-only commands "
                            f"(status, inspect, report) still work on it") from None


def writable_or_temp(folder: Path, name: str) -> Path:
    """`folder/name`, or the same name under the temp folder when `folder` cannot be written."""
    try:
        ensure_writable(folder)
        return folder / name
    except ResourceError:
        return Path(tempfile.gettempdir()) / f"lorapipe-{folder.name[:100]}-{name}"


def short_name(stem: str, suffix: str) -> str:
    """`stem + suffix`, with a long stem cut and a hash of it kept, so the name fits NAME_MAX."""
    if len((stem + suffix).encode()) <= NAME_MAX:
        return stem + suffix
    digest = hashlib.sha1(stem.encode()).hexdigest()[:10]
    return f"{stem.encode()[:100].decode(errors='ignore')}-{digest}{suffix}"
