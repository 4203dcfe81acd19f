"""Content ids of a dataset's images, kept between commands as git's index keeps file hashes.

    index = ImageIndex.for_folder(root, artifacts / INDEX_DIR)
    ids = index.ids([(image, mask_or_None), ...])   # {(image, mask): (image_id, pixel_id)}
    index.save()

An entry maps a file's stat (size, mtime_ns, ctime_ns, inode) to the content id its bytes hashed
to. A scan reads only the files whose stat differs from their entry's; every other id comes from
the index, so a no-op `status`, `run` or `train` on 150 GB of photos reads no image (sha256 runs at
~1.2 GB/s: reading them all costs minutes). ctime is in the key because writing a file, or resetting
its mtime afterwards, always moves it. `--rehash` (`request_rehash`) reads every file once more in
this process, for file systems whose stat cannot be trusted.

One index per dataset folder, shared by every run under the same artifacts folder:
`<artifacts>/.index/<folder name>-<hash of its real path>.json`. Runs that train on one folder with
other settings then hash it once, not once per run. The file is JSON (loading runs no code), written
atomically; two processes saving at once lose nothing but entries the next scan hashes again. A
damaged file is rebuilt, with a DamagedIndex warning naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

INDEX_DIR = ".index"
VERSION = 1
# An entry is kept only once its file's mtime and ctime are this much older than the read that hashed it:
# a write in the same timestamp tick as the one recorded (FAT: 2 s ticks) could otherwise leave the stat
# unchanged while the bytes differ (git's "racy" entries). Younger files are hashed again next time.
RACY_NS = 2_000_000_000
UNREADABLE_ID_PREFIX = "unreadable-"

Request = tuple[Path, "Path | None"]  # (image, its loss mask or None)
Stat = tuple[int, int, int, int, int]  # (mode, size, mtime_ns, ctime_ns, inode): stages.core.folder_tree.Stat
Ids = tuple[str, str]  # (the item's content id, its pixels' id)

_rehash = False
_generation = 0
_open: dict[tuple[str, str], "ImageIndex"] = {}  # (folder, index file) -> the index this process loaded


class DamagedIndex(UserWarning):
    """An index file that does not parse or does not match its schema: rebuilt by hashing again."""


def request_rehash(on: bool = True) -> None:
    """Read and hash every image again once in this command (what `--rehash` asks), whatever the index says;
    off when the command ends (a test runs many commands in one process)."""
    global _rehash, _generation
    _rehash = on
    if on:
        _generation += 1  # ids any scan of this process took from an index before are not to be reused
        for index in _open.values():
            index.checked.clear()


def generation() -> int:
    """Changes whenever `request_rehash` asks to read everything again."""
    return _generation


def rehash_requested() -> bool:
    return _rehash


def content_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


def hash_workers() -> int:
    """Threads that hash: one per core the process may use, plus a few to overlap reads on slow disks
    (hashlib releases the GIL while it hashes)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(32, cores + 4)


def _signature(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _file_id(path: Path) -> str:
    if path.is_dir():  # a clip as a folder of frames: its frames' names and bytes, in frame order
        from stages.core.video import frame_files

        digest = hashlib.sha256()
        for frame in frame_files(path):
            with open(frame, "rb") as f:
                digest.update(frame.name.encode() + b"\0" + hashlib.file_digest(f, "sha256").digest())
        return digest.hexdigest()[:24]
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:24]


def _members(path: Path | None) -> list[Path]:
    """The files whose stats vouch for a path's id: itself, and a clip folder's frames too."""
    if path is None:
        return []
    if path.is_dir():
        from stages.core.video import frame_files

        return [path, *frame_files(path)]
    return [path]


def read_ids(path: Path, mask: Path | None) -> Ids:
    """(the item's content id, its pixels' id), reading the image once: with a loss mask the first
    covers both files' bytes, so an edited mask re-encodes exactly its item, and the second is the
    image bytes' alone (what seeds its crops); without one both are the image's. A file that cannot
    be read gets an `unreadable-` id, so that cache-latents meets the read error again and applies
    data.on_bad_image to it like any other broken image."""
    unreadable = UNREADABLE_ID_PREFIX + content_id(str(path).encode())[:13]
    try:
        if mask is None:
            pixels = _file_id(path)
            return pixels, pixels
        data = path.read_bytes()
    except OSError:
        return unreadable, unreadable
    pixels = content_id(data)
    try:
        return content_id(b"%d:" % len(data) + data + mask.read_bytes()), pixels
    except OSError:
        return unreadable, pixels


class ImageIndex:
    """The ids of one dataset folder's images, by stat; `file` None keeps them in this process only."""

    def __init__(self, root: Path, file: Path | None) -> None:
        self.root, self.file = os.path.abspath(root), file  # entries are keyed by paths relative to root
        self.entries: dict[str, list] = {}  # key -> [signature of each file read, ..., [image_id, pixel_id]]
        self.checked: set[str] = set()  # keys hashed by this process (--rehash reads each once)
        self.changed = False
        if file is not None and file.is_file():
            self._load(file)

    @classmethod
    def for_folder(cls, root: Path, index_dir: Path | None) -> "ImageIndex":
        """The process's index of the folder `root` (loaded once), kept in `index_dir` (None: in memory only)."""
        real = os.path.realpath(root)
        file = None if index_dir is None else Path(index_dir) / (
            f"{Path(real).name or 'root'}-{content_id(real.encode())[:12]}.json")
        key = (os.path.abspath(root), str(file))
        if key not in _open:
            _open[key] = cls(Path(root), file)
        return _open[key]

    def _load(self, file: Path) -> None:
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
            if not (isinstance(data, dict) and data.get("version") == VERSION and isinstance(data.get("entries"), dict)):
                raise ValueError(f"not a version {VERSION} index")
            entries = data["entries"]
            bad = next((k for k, v in entries.items() if not _well_formed(v)), None)
            if bad is not None:
                raise ValueError(f"the entry of {bad!r} is not [stat, ..., [id, id]]")
        except (OSError, UnicodeDecodeError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            warnings.warn(f"image index '{file}' is damaged ({e}); rebuilding it, which reads every image of "
                          f"'{self.root}' once", DamagedIndex, stacklevel=4)
            self.changed = True
            return
        self.entries = entries

    def _key(self, request: Request) -> str:
        image, mask = request
        name = self._relative(image)
        return name if mask is None else f"{name}\n{self._relative(mask)}"

    def _relative(self, path: Path) -> str:
        """os.path.relpath(path, root), cutting the root's text off where it starts the path (100k items: a second)."""
        name, prefix = str(path), self.root.rstrip("/") + "/"
        if name.startswith(prefix) and "/." not in name:
            return name[len(prefix):]
        return os.path.relpath(path, self.root)

    def ids(self, requests: Iterable[Request], known: Callable[[str], Stat | None] | None = None) -> dict[Request, Ids]:
        """The ids of each (image, mask): from the index where every file's stat matches its entry
        (under --rehash, only once this process has read it), else read and hashed in parallel
        threads, and the entry renewed. `known`: the stats a walk of the folder just took (FolderTree.stat),
        so that a file it saw is not stat'ed again."""
        out: dict[Request, Ids] = {}
        todo: list[tuple[Request, str]] = []
        for request in dict.fromkeys(requests):
            key = self._key(request)
            entry = self.entries.get(key)
            if entry is not None and entry[:-1] == _stats(request, known) and (not _rehash or key in self.checked):
                out[request] = tuple(entry[-1])
            else:
                todo.append((request, key))
        if len(todo) > 1:
            with ThreadPoolExecutor(hash_workers()) as pool:
                hashed = list(pool.map(lambda t: _hash(t[0]), todo))
        else:
            hashed = [_hash(t[0]) for t in todo]
        for (request, key), (ids, settled) in zip(todo, hashed):
            out[request] = ids
            self.checked.add(key)
            self._renew(key, ids, settled)
        return out

    def _renew(self, key: str, ids: Ids, settled: list[list[int]] | None) -> None:
        """Keep the entry of files that were settled when read (`_hash`); drop it otherwise."""
        entry = [*settled, list(ids)] if settled and not ids[0].startswith(UNREADABLE_ID_PREFIX) else None
        if self.entries.get(key) != entry:
            self.changed = True
            if entry is None:
                self.entries.pop(key, None)
            else:
                self.entries[key] = entry

    def save(self) -> None:
        """Write the index atomically when it changed. Where the artifacts folder cannot be written (a
        read-only `status`), the ids stay in this process: the next command hashes them again."""
        from stages.core.artifacts import atomic_write_bytes

        if self.file is None or not self.changed:
            return
        for key in [k for k in self.entries if not all(os.path.lexists(os.path.join(self.root, p)) for p in k.split("\n"))]:
            del self.entries[key]  # removed or renamed files
        data = {"version": VERSION, "folder": str(self.root), "entries": self.entries}
        try:
            atomic_write_bytes(self.file, json.dumps(data, separators=(",", ":")).encode())
        except OSError:
            return
        self.changed = False


def _well_formed(entry: object) -> bool:
    if type(entry) is not list or len(entry) < 2:
        return False
    ids = entry[-1]
    return (type(ids) is list and len(ids) == 2 and type(ids[0]) is str and type(ids[1]) is str
            and all(type(s) is list and len(s) == 4 and {type(x) for x in s} == {int} for s in entry[:-1]))


def _stats(request: Request, known: Callable[[str], Stat | None] | None = None) -> list[list[int]] | None:
    """The signatures of the request's files (a clip folder's frames too); a regular file's from `known`
    where it has one."""
    out = []
    for path in request:
        st = known(str(path)) if known is not None and path is not None else None
        if st is not None and stat.S_ISREG(st[0]):
            out.append([st[1], st[2], st[3], st[4]])
            continue
        try:
            out += [_signature(os.stat(q)) for q in _members(path)]
        except OSError:
            return None
    return out


def _hash(request: Request) -> tuple[Ids, list[list[int]] | None]:
    """(ids, the files' stats when they can vouch for the ids next time, else None): the same before
    and after the read, and last changed more than RACY_NS before it began."""
    start, before = time.time_ns(), _stats(request)
    ids = read_ids(*request)
    settled = before is not None and before == _stats(request) and all(start - max(s[1], s[2]) > RACY_NS for s in before)
    return ids, before if settled else None
