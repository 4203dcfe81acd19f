"""One walk of a dataset folder: every name under it with its stat.

    tree = FolderTree(root)
    tree.exists("data/cats/01_mask.png")     # a set lookup where the walk saw the folder
    tree.digest() == FolderTree(root).digest()   # nothing added, removed or written since

The scan asks for ~170 names per image that mostly do not exist (its loss masks' and control images'
candidate names, each extension in two cases): from a set that costs microseconds, from the file
system ~15 s for 5,000 images. The stats tell a scan made earlier in the process whether its result
still holds. The walk lists what `Path.rglob("*")` lists: hidden names too, and symlinked folders as
names, not entered (`exists` asks the file system below them).
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path
from typing import Iterable

from stages.core.image_index import RACY_NS

Stat = tuple[int, int, int, int, int]  # (mode, size, mtime_ns, ctime_ns, inode), through symlinks where they resolve


def join(folder: str, name: str) -> str:
    """`str(Path(folder) / name)` without building Paths (the scan joins ~170 names per image)."""
    if folder == ".":
        return name
    return folder + name if folder.endswith("/") else f"{folder}/{name}"


def stat_of(path: str) -> Stat | None:
    try:
        st = os.stat(path)
    except OSError:
        try:
            st = os.lstat(path)  # a broken symlink: its own stat
        except OSError:
            return None
    return st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


class FolderTree:
    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.started = time.time_ns()
        self.stats: dict[str, Stat | None] = {}
        self.folders: set[str] = set()  # walked: real folders, not symlinks to folders
        self.links: set[str] = set()
        self._by_stem: dict[str, set[str]] | None = None  # path less its suffix -> paths, built on first use
        self._digest: bytes | None = None
        self._walk(self.root)

    def _walk(self, folder: str) -> None:
        self.folders.add(folder)
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return  # an unreadable subfolder lists as empty, as rglob does
        for entry in entries:
            path = join(folder, entry.name)
            self.stats[path] = stat_of(path)
            if entry.is_symlink():
                self.links.add(path)
            if entry.is_dir(follow_symlinks=False):
                self._walk(path)

    def exists(self, path: str) -> bool:
        """os.path.lexists(path), from the walk where it saw the folder."""
        return path in self.stats if (os.path.dirname(path) or ".") in self.folders else os.path.lexists(path)

    def stat(self, path: str) -> Stat | None:
        """The walk's stat of `path` (through a symlink that resolves), or None where it has none."""
        return self.stats.get(path)

    def is_dir(self, path: str) -> bool:
        """os.path.isdir(path), from the walk's stat where it saw the folder holding it."""
        if path in self.stats:
            st = self.stats[path]
            return st is not None and stat.S_ISDIR(st[0])
        return os.path.isdir(path)

    def named(self, folder: str, stem: str, suffixes: Iterable[str]) -> list[str]:
        """The paths `folder/stem + suffix` that exist, in the order of `suffixes`."""
        base = join(folder, stem)
        if folder not in self.folders:
            if (os.path.dirname(folder) or ".") in self.folders and folder not in self.stats:
                return []  # the walk saw its parent, and no such folder in it
            return [base + s for s in suffixes if os.path.lexists(base + s)]
        if self._by_stem is None:
            self._by_stem = {}
            for p in self.stats:
                self._by_stem.setdefault(os.path.splitext(p)[0], set()).add(p)
        have = self._by_stem.get(base)
        return [base + s for s in suffixes if base + s in have] if have else []

    def plainly_inside(self, path: Path) -> bool:
        """Whether `path` is inside the root with no symlink on the way (then it resolves inside it)."""
        name = str(path)
        return (os.path.dirname(name) or ".") in self.folders and name not in self.links

    def paths(self) -> list[Path]:
        """Every name below the root, sorted as `sorted(root.rglob("*"))` sorts them."""
        return sorted(Path(p) for p in self.stats)

    def files(self) -> list[Path]:
        """`paths()` less the folders (and symlinks to folders), unsorted."""
        return [Path(p) for p, s in self.stats.items() if s is None or not stat.S_ISDIR(s[0])]

    def settled(self) -> bool:
        """Whether every name was last changed RACY_NS before the walk: a write in the same timestamp
        tick could otherwise leave its stat as it was."""
        return all(s is None or self.started - max(s[2], s[3]) > RACY_NS for s in self.stats.values())

    def digest(self) -> bytes:
        """What a later walk compares against to see that nothing changed (a few bytes, where the
        names and stats of 150,000 files take tens of MB)."""
        if self._digest is None:
            self._digest = hashlib.sha256(repr((self.root, sorted(self.stats.items()))).encode()).digest()
        return self._digest
