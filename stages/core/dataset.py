"""Dataset scan, content ids, caption texts and edit controls. No torch needed (aspect buckets and the seeded
crop/flip plan: stages/core/aspect_buckets.py; reading images and masks: stages/core/image_io.py).

An item is one (image, caption) pair. Its ids are content hashes: `image_id` of the image bytes,
`caption_id` of the caption text. Caches are keyed by these ids, never by position, so a shuffled
loader can never pair a latent with the wrong caption, and an edited caption or added image touches
only its own rows.

Reads stay inside the dataset folder: every image and caption path must resolve inside it (a
metadata.jsonl `file_name` must be relative and may not climb out with `..`); a symlink to a file
elsewhere is refused unless `data.follow_symlinks_outside = true`. Files the scan leaves out or
merges (an unread format, a FIFO, a broken symlink, two images sharing one caption) are reported
through `warn`, one warning per kind that names the files.

Image ids come from the folder's index of file stats (stages/core/image_index.py): a scan reads only
the images that changed, and a process lists a folder once (a later scan walks it again and reuses
the listing while no file changed).

`scan_run(cfg)` scans every dataset of a run ([[datasets]] tables, or data.path alone) and gives
each item all its caption texts: numbered caption files, lines (data.caption_lines) and seeded tag
shuffles (data.shuffle_tags). Each text is its own caption id, so each is its own cached row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import stat
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from stages.core import image_index
from stages.core.errors import DatasetError, listing
from stages.core.folder_tree import FolderTree, stat_of
from stages.core.image_io import BAD_IMAGE_HINT, BadImage
from stages.core.image_index import INDEX_DIR, UNREADABLE_ID_PREFIX, ImageIndex, content_id  # noqa: F401 - UNREADABLE_ID_PREFIX: read here
from stages.core.video import VIDEO_EXTS

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
# Image formats that are not read (GIF is mostly animation; HEIC, AVIF and JPEG XL need PIL plugins;
# the rest are raw, vector or layered): such a file with a caption beside it is left out with a warning.
UNREAD_IMAGE_EXTS = (".gif", ".heic", ".heif", ".avif", ".jxl", ".svg", ".ico", ".psd", ".tga", ".jp2",
                     ".exr", ".hdr", ".dng", ".cr2", ".nef", ".arw")
OUTSIDE_HINT = "move the file into the dataset folder, or set data.follow_symlinks_outside = true to read it there"

VARIANT_SEP = "\x1e"  # joins the captions of a metadata.jsonl `text` list until scan() splits them
Warn = Callable[[str, "str | None"], None]  # (message, item key or None when it names several files)


MOST_REPORTED = 20  # bad inputs named in one error; the rest are counted


def collected(errors: list[DatasetError], what: str) -> DatasetError | None:
    """One error naming all `errors` (the first MOST_REPORTED, and how many more), so a user fixes a
    dataset in one round; its class is theirs when they share one. None when there are none."""
    if len(errors) <= 1:
        return errors[0] if errors else None
    kind = type(errors[0]) if all(type(e) is type(errors[0]) for e in errors) else DatasetError
    more = f"\n  ... and {len(errors) - MOST_REPORTED} more" if len(errors) > MOST_REPORTED else ""
    error = kind(f"{len(errors)} {what} need fixing (everything already written is kept; fix them and rerun):\n  "
                 + "\n  ".join(str(e) for e in errors[:MOST_REPORTED]) + more)
    error.item = errors[0].item
    return error


@dataclass(frozen=True)
class Item:
    key: str  # path relative to the dataset root, e.g. "cats/01.png" ("<name>/cats/01.png" under [[datasets]])
    image_path: Path
    caption: str  # the first of `captions`
    image_id: str  # of the image bytes, and of its loss mask's bytes when it has one
    caption_id: str
    captions: tuple[str, ...] = ()  # every caption text the item trains with, one drawn per step; () = (caption,)
    dataset: int = 0  # index of its [[datasets]] table
    latent_id: str = ""  # latents.zarr row key: "" is the image id; suffixed when its dataset's LATENT_KEYS differ
    mask_path: Path | None = None  # `name_mask.png` beside the image, or `masks/<name>.png` (masked loss)
    controls: tuple[Path, ...] = ()  # control (reference) images of an edit pair, in order
    control_ids: tuple[str, ...] = ()  # their content ids
    caption_salt: str = ""  # set by for_family when the family's text encoder sees the controls
    pixel_id: str = ""  # with a loss mask: the image bytes' own id (`pixels_id`); "" otherwise
    clip: bool | None = None  # a clip, as the scan's walk saw it; None: not known (is_clip stats the path)

    @property
    def texts(self) -> tuple[str, ...]:
        return self.captions or (self.caption,)

    @property
    def caption_ids(self) -> tuple[str, ...]:
        """captions.zarr row keys: each text's id, or, for a family whose text encoder sees the
        controls, the id of (text, controls)."""
        return tuple(_salted(caption_id(t), self.caption_salt) for t in self.texts)

    @property
    def empty_caption_id(self) -> str:
        """captions.zarr row key of the empty caption that caption dropout trains it on: keyed like its
        captions, so one row shared by every item, or, when the text encoder sees the controls, one
        row per distinct control set."""
        return _salted(caption_id(""), self.caption_salt)

    @property
    def latent_key(self) -> str:
        return self.latent_id or self.image_id

    @property
    def is_clip(self) -> bool:
        """A video file or a folder of frames (trained as `data.frames` frames), not a still image."""
        return is_clip_path(self.image_path) if self.clip is None else self.clip


def _salted(content: str, salt: str) -> str:
    return content_id(f"{content}+{salt}".encode()) if salt else content


def caption_id(text: str) -> str:
    return content_id(text.encode("utf-8"))


# ---- loss masks: white trained, black ignored, grey weighted ---------------------------------


def is_clip_path(path: Path) -> bool:
    """A video file or a folder of frames (stages.core.video), not a still image."""
    return path.suffix.lower() in VIDEO_EXTS or path.is_dir()


def pixels_id(item: Item) -> str:
    """The id of the image bytes alone: what seeds its crop/flip plan, so adding or editing a mask
    re-encodes the item with the same crops (an all-white mask then trains exactly as no mask)."""
    return item.pixel_id or item.image_id


MASK_SUFFIX, MASKS_FOLDER = "_mask", "masks"


def find_mask(root: Path, image: Path, follow_outside: bool, tree: FolderTree) -> Path | None:
    """An image's loss mask: `<stem>_mask.<ext>` beside it, or `masks/<stem>.<ext>` under the
    dataset root (same relative folders); None when it has none."""
    under = (root / MASKS_FOLDER / image.relative_to(root)).parent
    found = [Path(p) for p in tree.named(str(image.parent), image.stem + MASK_SUFFIX, IMAGE_EXTS)
             + tree.named(str(under), image.stem, IMAGE_EXTS)]
    if len(found) > 1:
        raise DatasetError(f"image '{image}' has {len(found)} loss masks ({', '.join(str(p) for p in found)}): "
                           f"keep one")
    if not found:
        return None
    problem = _file_problem(found[0])
    if problem:
        raise BadImage(f"loss mask '{found[0]}' {problem}: {BAD_IMAGE_HINT}")
    _check_inside(root, found[0], follow_outside, tree)
    return found[0]


def _may_have_masks(root: Path, tree: FolderTree) -> bool:
    """Whether any image can have a loss mask: the walk saw a `masks/` folder, a `*_mask.*` name or a
    symlink (a folder it did not enter); else no item needs the per-image search (100k images: seconds)."""
    return bool(tree.links) or tree.exists(str(root / MASKS_FOLDER)) or any(
        os.path.splitext(p)[0].endswith(MASK_SUFFIX) for p in tree.stats)


def _is_mask_file(root: Path, path: Path, tree: FolderTree) -> bool:
    """A file under `masks/`, or `<stem>_mask.<ext>` beside an image `<stem>.<ext>`: a mask, not an item."""
    rel = path.relative_to(root)
    if rel.parts[0] == MASKS_FOLDER and len(rel.parts) > 1:
        return True
    if not path.stem.endswith(MASK_SUFFIX):
        return False
    return bool(tree.named(str(path.parent), path.stem[:-len(MASK_SUFFIX)], IMAGE_EXTS))


def _file_problem(path: Path, tree: FolderTree | None = None) -> str | None:
    """Why `path` is not a readable regular file ("does not exist", "is a FIFO", ...), or None.
    Only stats the path (or reads the stat `tree`'s walk took): opening a FIFO would block the scan."""
    known = tree.stat(str(path)) if tree is not None else None
    if known is not None and str(path) not in tree.links:  # a plain name the walk saw: no system call
        mode = known[0]
        return None if stat.S_ISREG(mode) else "is a folder" if stat.S_ISDIR(mode) else \
            "is not a regular file (a FIFO, socket or device)"
    if tree is not None and known is None and tree.exists(str(path)) is False:
        return "does not exist"
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return "does not exist"
    if stat.S_ISLNK(mode):
        if not path.exists():
            return f"is a broken symlink (to '{os.readlink(path)}')"
        mode = path.stat().st_mode
    if stat.S_ISDIR(mode):
        return "is a folder"
    return None if stat.S_ISREG(mode) else "is not a regular file (a FIFO, socket or device)"


def _check_inside(root: Path, path: Path, follow_outside: bool, tree: FolderTree | None = None) -> None:
    if follow_outside or tree is not None and tree.plainly_inside(path):
        return
    real = path.resolve()
    if not follow_outside and not real.is_relative_to(root.resolve()):
        raise DatasetError(f"'{path}' resolves to '{real}', outside the dataset folder '{root}': {OUTSIDE_HINT}")


def _decode(data: bytes, what: str) -> str:
    """UTF-8 text with a leading BOM stripped; NUL bytes (a binary file, or UTF-16) refused."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start}); re-save it as UTF-8") from None
    if "\x00" in text:
        raise DatasetError(f"{what} contains NUL bytes at offset {text.index(chr(0))} (binary, or UTF-16 text); "
                           f"re-save it as UTF-8 text")
    return text.removeprefix("\ufeff")


def _read_text(path: Path, what: str) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"{what} cannot be read ({e.strerror or e}): fix its permissions or remove it") from None
    return _decode(data, what)


def _read_caption(path: Path) -> str:
    text = _read_text(path, f"caption '{path}'").strip()
    if not text:
        raise DatasetError(f"caption '{path}' is empty; write a caption or remove the image")
    return text


class _Dropped:
    """Files the scan leaves out or merges, by kind: one warning per kind, naming the files."""

    MESSAGES = {
        "format": "images in a format that is not read ({exts}) have captions and are left out: {files}; "
                  "convert them to PNG, JPEG or WebP",
        "special": "image names that are not readable files are left out: {files}",
        "shared": "images share one caption file and both train with it: {files}; give each image its own caption",
        "orphan": "caption files with no image beside them are not used: {files}; add their images or remove them",
    }

    def __init__(self) -> None:
        self.files: dict[str, list[tuple[str, str]]] = defaultdict(list)  # kind -> [(item key, how it is named)]

    def add(self, kind: str, key: str, named: str | None = None) -> None:
        self.files[kind].append((key, named or f"'{key}'"))

    def report(self, warn: Warn | None) -> None:
        exts = ", ".join(sorted({Path(key).suffix.lower() for key, _ in self.files["format"]}))
        for kind, files in self.files.items():
            if warn is not None and files:
                message = self.MESSAGES[kind].format(exts=exts, files=listing([named for _, named in files]))
                warn(message, files[0][0] if len(files) == 1 else None)


def _metadata_path(root: Path, name: Any, where: str) -> Path:
    """root / file_name, refusing a name that is not a relative path inside the root."""
    if not isinstance(name, str) or not name.strip():
        raise DatasetError(f"{where}: 'file_name' must be a non-empty string (a path relative to '{root}')")
    rel = os.path.normpath(name)
    if os.path.isabs(name) or rel == ".." or rel.startswith(".." + os.sep):
        raise DatasetError(f"{where}: file_name '{name}' is not inside the dataset folder '{root}': write it relative "
                           f"to that folder; for a file elsewhere, symlink it into the folder and set "
                           f"data.follow_symlinks_outside = true")
    return root / rel


def _from_metadata(root: Path, meta: Path, follow_outside: bool,
                   tree: FolderTree) -> tuple[list[tuple[Path, str]], dict[Path, list[Path]]]:
    """(image, caption) pairs and each image's `control_image` paths (a string or a list of strings),
    from one read of metadata.jsonl (the files checked against `tree`, the folder's walk)."""
    _check_inside(root, meta, follow_outside)
    pairs, controls = [], {}
    for n, line in enumerate(_read_text(meta, f"metadata file '{meta}'").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{meta}:{n}"
        try:
            row = json.loads(line)
            name, text = row["file_name"], row["text"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DatasetError(f"{where}: each line must be a JSON object with 'file_name' and 'text' ({e})") from None
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            text = VARIANT_SEP.join(t for t in text if t.strip())  # a list of captions: the item's variants
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(f"{where}: empty caption for '{name}'")
        path = _metadata_path(root, name, where)
        problem = _file_problem(path, tree)
        if problem == "is a folder" and is_clip_path(path):
            problem = None
        if problem:
            raise DatasetError(f"{where}: image '{path}' {problem}")
        _check_inside(root, path, follow_outside, tree)
        pairs.append((path, _decode(text.encode("utf-8"), f"{where}: the caption of '{name}'").strip()))
        controls[path] = _row_controls(root, row, where, follow_outside)
    return pairs, controls


def _listed_images(root: Path, caption_ext: str, dropped: _Dropped, tree: FolderTree) -> list[Path]:
    """Regular files with an image extension under root; the left-out ones go to `dropped`."""
    images = []
    clip_folders = {str(p) for p in tree.paths() if _is_clip_folder(p, caption_ext, tree)}
    for path in tree.paths():
        suffix = path.suffix.lower()
        key = path.relative_to(root).as_posix()
        if str(path.parent) in clip_folders:  # a frame of a clip folder, not an item
            continue
        if str(path) in clip_folders:
            images.append(path)
            continue
        if suffix in IMAGE_EXTS and _is_mask_file(root, path, tree):
            continue
        if suffix in IMAGE_EXTS or suffix in VIDEO_EXTS:
            problem = _file_problem(path, tree)
            if problem is None:
                images.append(path)
            elif problem != "is a folder":
                dropped.add("special", key, f"'{key}' ({problem.removeprefix('is ')})")
        elif suffix in UNREAD_IMAGE_EXTS and tree.exists(str(path.with_suffix(caption_ext))):
            dropped.add("format", key)
    by_caption = defaultdict(list)
    for path in images:
        by_caption[path.with_suffix(caption_ext)].append(path.relative_to(root).as_posix())
    for cap, keys in by_caption.items():
        if len(keys) > 1 and tree.exists(str(cap)):
            dropped.add("shared", keys[0], " and ".join(f"'{k}'" for k in keys) + f" ('{cap.name}')")
    return images


def _is_clip_folder(path: Path, caption_ext: str, tree: FolderTree) -> bool:
    """A folder of frames with a caption file of its name beside it (`walk/` + `walk.txt`): one clip."""
    return tree.is_dir(str(path)) and tree.exists(str(path.parent / (path.name + caption_ext)))


def _from_folder(root: Path, caption_ext: str, follow_outside: bool, dropped: _Dropped,
                 tree: FolderTree) -> list[tuple[Path, str]]:
    """(image, caption) pairs; every unusable caption is named in one error (`collected`)."""
    pairs, problems = [], []
    for path in _listed_images(root, caption_ext, dropped, tree):
        if _is_control(root, path, caption_ext, tree):
            continue
        try:
            pairs.append((path, _caption_of(root, path, caption_ext, follow_outside, tree)))
        except DatasetError as e:
            e.item = path.relative_to(root).as_posix()
            problems.append(e)
    if problems:
        raise collected(problems, "images or captions")
    _orphan_captions(root, caption_ext, dropped, tree)
    return pairs


def _caption_of(root: Path, path: Path, caption_ext: str, follow_outside: bool, tree: FolderTree) -> str:
    _check_inside(root, path, follow_outside, tree)
    cap = path.parent / (path.name + caption_ext) if tree.is_dir(str(path)) else path.with_suffix(caption_ext)
    problem = _file_problem(cap, tree)
    if problem == "does not exist":
        raise DatasetError(f"image '{path}' has no caption file '{cap.name}'; add one or move the image out")
    if problem:
        raise DatasetError(f"caption '{cap}' {problem}; make it a text file or move the image out")
    _check_inside(root, cap, follow_outside, tree)
    return _read_caption(cap)


def _orphan_captions(root: Path, caption_ext: str, dropped: _Dropped, tree: FolderTree) -> None:
    """Caption files beside no file of their stem (nor a numbered variant `<stem>.<n><ext>` of one)."""
    files = tree.files()
    stems = {p.with_suffix("") for p in files if p.suffix != caption_ext} | {
        p for p in tree.paths() if _is_clip_folder(p, caption_ext, tree)}
    for cap in sorted(p for p in files if p.suffix == caption_ext):
        stem = cap.with_suffix("")
        if stem not in stems and not (stem.suffix[1:].isdigit() and stem.with_suffix("") in stems):
            dropped.add("orphan", cap.relative_to(root).as_posix())


def scan(root: str | Path, caption_ext: str = ".txt", *, follow_symlinks_outside: bool = False,
         warn: Warn | None = None, caption_lines: str = "whole", path_key: str = "data.path", ids: bool = True,
         index_dir: Path | None = None) -> list[Item]:
    """All items under root, sorted by key: metadata.jsonl if present, else image + same-stem caption.
    An item's captions: its caption, then `<stem>.1<ext>`, `<stem>.2<ext>`, ... (a metadata `text`
    list); with caption_lines = "variants" each line of each is its own caption.
    `warn(message, item)` hears of files left out or merged, once per kind.

    Image ids come from the folder's ImageIndex (kept in `index_dir`, `<artifacts>/.index`; None: in
    this process only), which reads only the files whose stat changed. With `ids` False no image is
    read and image_id, pixel_id and control_ids are empty (what encode-captions asks when its rows
    depend on the captions alone). A process lists a folder once per settings: a later call walks it
    again and, when no file changed, gives the same items (and the same warnings) without reading."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"dataset folder '{root}' does not exist (set {path_key})")
    key = (os.path.abspath(root), caption_ext, follow_symlinks_outside, caption_lines)
    tree = _walk(root)
    listed = _LISTED.get(key)
    if listed is None or not listed.holds(tree):
        heard: list[tuple[str, str | None]] = []
        listed = _Listed(tree, _items(root, caption_ext, follow_symlinks_outside,
                                      lambda message, item: heard.append((message, item)), caption_lines, tree), heard)
        if tree.settled():  # a file changed in this timestamp tick may change again unseen: list it again next time
            _LISTED[key] = listed
    for message, item in listed.warnings:
        if warn is not None:
            warn(message, item)
    return listed.with_ids(ImageIndex.for_folder(root, index_dir), tree) if ids else listed.items


def _items(root: Path, caption_ext: str, follow_outside: bool, warn: Warn | None, caption_lines: str,
           tree: FolderTree) -> list[Item]:
    """`scan`'s items without their image ids (image_id, pixel_id and control_ids empty)."""
    meta = (root / "metadata.jsonl").is_file()
    pairs, controls = _listing(root, caption_ext, follow_outside, warn, "data.path", tree)
    stems = set() if meta else {path.with_suffix("") for path, _ in pairs}  # numbered captions: folder mode only
    masks = _may_have_masks(root, tree)
    key_of = _keys_under(root)
    items = []
    for path, text in pairs:
        clip = path.suffix.lower() in VIDEO_EXTS or tree.is_dir(str(path))  # from the walk: no stat per item
        mask = None if clip or not masks else find_mask(root, path, follow_outside, tree)
        texts = [t.strip() for t in text.split(VARIANT_SEP)] + (
            [] if meta else _numbered_captions(root, path, caption_ext, stems, follow_outside))
        if caption_lines == "variants":
            texts = [line.strip() for t in texts for line in t.splitlines() if line.strip()]
        texts = list(dict.fromkeys(texts))
        items.append(Item(key_of(path), path, texts[0], "", caption_id(texts[0]),
                          tuple(texts) if len(texts) > 1 else (), mask_path=mask, controls=tuple(controls.get(path, ())),
                          clip=clip))
    return sorted(items, key=lambda it: it.key)


def _keys_under(root: Path) -> Callable[[Path], str]:
    """path -> `path.relative_to(root).as_posix()`, by cutting the root's text off (100k items: a second less)."""
    prefix = str(root).rstrip("/") + "/"
    return lambda path: (str(path)[len(prefix):] if str(path).startswith(prefix) and os.sep == "/"
                         else path.relative_to(root).as_posix())


class _Listed:
    """One folder's items as a scan listed them, the warnings it gave, and the walk they came from."""

    def __init__(self, tree: FolderTree, items: list[Item], warnings: list[tuple[str, str | None]]) -> None:
        self.digest, self.items, self.warnings = tree.digest(), items, warnings
        self.identified: list[Item] | None = None
        self.generation = 0  # image_index.generation() when the ids were taken
        # files read outside the walk (below a symlinked folder): their stats are checked too
        self.outside = {str(p): stat_of(str(p)) for it in items for p in (it.image_path, it.mask_path, *it.controls)
                        if p is not None and (os.path.dirname(str(p)) or ".") not in tree.folders}

    def holds(self, tree: FolderTree) -> bool:
        """Whether nothing the listing read has changed since (`tree` is a new walk of the folder)."""
        return tree.digest() == self.digest and all(stat_of(p) == s for p, s in self.outside.items())

    def with_ids(self, index: ImageIndex, tree: FolderTree | None = None) -> list[Item]:
        """The items with their image, pixel and control ids: from the index where the files' stats
        (those `tree`, the walk just made, holds) match it, else read (in parallel) and the index saved."""
        if self.identified is None or self.generation != image_index.generation():
            self.generation = image_index.generation()
            requests = [(it.image_path, it.mask_path) for it in self.items] + [
                (c, None) for it in self.items for c in it.controls]
            found = index.ids(requests, None if tree is None else tree.stat)
            index.save()
            self.identified = [dataclasses.replace(
                it, image_id=found[it.image_path, it.mask_path][0],
                pixel_id=found[it.image_path, it.mask_path][1] if it.mask_path else "",
                control_ids=tuple(found[c, None][0] for c in it.controls)) for it in self.items]
        return self.identified


_LISTED: dict[tuple[str, str, bool, str], _Listed] = {}  # (folder, caption_ext, follow, caption_lines) -> listing
_WALKS: dict[str, FolderTree] | None = None  # inside `one_walk`: each folder's walk


@contextlib.contextmanager
def one_walk() -> Iterator[dict[str, FolderTree]]:
    """Scans inside the block walk each folder once (a later scan reuses the walk instead of checking
    that nothing changed): `status` and `run`'s checks read one snapshot of the dataset, where each
    stage's check scans it (100k images: ~0.6 s a walk). Clear the dict it yields to walk again."""
    global _WALKS
    outer = _WALKS
    _WALKS = {} if outer is None else outer
    try:
        yield _WALKS
    finally:
        _WALKS = outer


def _walk(root: Path) -> FolderTree:
    if _WALKS is None:
        return FolderTree(root)
    key = os.path.abspath(root)
    if key not in _WALKS:
        _WALKS[key] = FolderTree(root)
    return _WALKS[key]


def _listing(root: Path, caption_ext: str, follow_outside: bool, warn: Warn | None,
             path_key: str, tree: FolderTree | None = None) -> tuple[list[tuple[Path, str]], dict[Path, list[Path]]]:
    """(image, caption) pairs and each image's control paths, from the file names (and caption
    files) alone: no image is opened or hashed."""
    if not root.is_dir():
        raise DatasetError(f"dataset folder '{root}' does not exist (set {path_key})")
    tree = tree or _walk(root)
    meta = root / "metadata.jsonl"
    dropped = _Dropped()
    if meta.is_file():
        pairs, controls = _from_metadata(root, meta, follow_outside, tree)
    else:
        pairs = _from_folder(root, caption_ext, follow_outside, dropped, tree)
        controls = {path: _folder_controls(root, path, follow_outside, tree) for path, _ in pairs}
    dropped.report(warn)
    if not pairs:
        raise DatasetError(f"dataset folder '{root}' has no images ({', '.join(IMAGE_EXTS)}) or clips "
                           f"({', '.join(VIDEO_EXTS)}, or folders of frames) with captions")
    return pairs, controls


def most_controls(cfg: Any) -> int:
    """The most control images an item of the run's datasets has, from file names alone (what the
    memory planner needs before any model loads; `scan_run` would read and hash every image)."""
    most = 0
    for i, data in enumerate(cfg.dataset_configs()):
        _, controls = _listing(Path(data.path), data.caption_ext, data.follow_symlinks_outside, None,
                               f"datasets[{i}].path" if cfg.datasets else "data.path")
        most = max([most, *(len(c) for c in controls.values())])
    return most


def _numbered_captions(root: Path, image: Path, caption_ext: str, stems: set[Path], follow_outside: bool) -> list[str]:
    """Texts of `<stem>.1<ext>`, `<stem>.2<ext>`, ... beside an image, up to the first missing number.
    A name that is another image's own caption (`<stem>.1.png` exists) is that image's, not a variant."""
    texts = []
    n = 1
    while True:
        stem = image.with_suffix("").with_name(f"{image.stem}.{n}")
        cap = stem.with_name(stem.name + caption_ext)
        if stem in stems or _file_problem(cap) is not None:
            return texts
        _check_inside(root, cap, follow_outside)
        texts.append(_read_caption(cap))
        n += 1


def scan_data(data: Any, log: Any = None, ids: bool = True, index_dir: Path | None = None) -> list[Item]:
    """scan() with a run's DataConfig; warnings go to the stage's event log when one is given."""
    warn = None if log is None else (lambda message, item: log.emit("warning", message=message, item=item))
    return scan(data.path, data.caption_ext, follow_symlinks_outside=data.follow_symlinks_outside, warn=warn,
                caption_lines=data.caption_lines, ids=ids or data.shuffle_tags, index_dir=index_dir)


def index_dir(cfg: Any) -> Path:
    """Where the run's image indexes live: `<artifacts>/.index`, shared by the runs of that folder."""
    return Path(cfg.artifacts) / INDEX_DIR


# Settings of a dataset that change its cached latents. The first dataset's are the run's reference
# (latent_reference): an image whose dataset differs from them in any key gets its own latent row (the
# image id with a suffix); the same settings share one row. Not [data]'s own values: with [[datasets]]
# tables they may be overridden everywhere, and a key no dataset uses must not rename any row.
LATENT_KEYS = ("resolution", "cache_variants", "random_flip", "crop", "crop_zoom")
# The clip keys, counted only away from their defaults: an image run's rows keep the names they had.
CLIP_KEYS = {"frames": 33, "fps": 0.0}


def latent_settings(data: Any) -> dict[str, Any]:
    """A dataset's settings that change its cached latents: LATENT_KEYS, and CLIP_KEYS not at their defaults."""
    return {**{k: getattr(data, k) for k in LATENT_KEYS},
            **{k: getattr(data, k) for k, default in CLIP_KEYS.items() if getattr(data, k) != default}}


def latent_reference(cfg: Any) -> dict[str, Any]:
    """The first dataset's effective latent settings (a plain data.path run: [data]'s): the settings whose
    rows are keyed by the bare image id, as validation.path's items are, which are cached with them."""
    return latent_settings(cfg.dataset_configs()[0])


def scan_run(cfg: Any, log: Any = None, ids: bool = True) -> list[Item]:
    """Every item of a run: its one data.path, or each [[datasets]] table's folder with item keys
    prefixed '<name>/'. Captions get their tag shuffles; items keep their dataset's index. With `ids`
    False, images are read only for a dataset whose tag shuffles are seeded by them (data.shuffle_tags).
    A later call whose folders' scans gave the very same lists (nothing changed) with the same settings
    returns the items made before (`status` asks once per stage: 100k items cost a second each time)."""
    warn = None if log is None else (lambda message, item: log.emit("warning", message=message, item=item))
    reference = latent_reference(cfg)
    datasets = list(zip(cfg.dataset_configs(), cfg.dataset_names()))
    scanned = [scan(data.path, data.caption_ext, follow_symlinks_outside=data.follow_symlinks_outside, warn=warn,
                    caption_lines=data.caption_lines, path_key=f"datasets[{i}].path" if cfg.datasets else "data.path",
                    ids=ids or data.shuffle_tags, index_dir=index_dir(cfg)) for i, (data, _) in enumerate(datasets)]
    key = repr((datasets, cfg.seed, reference, ids))
    made = _RUN_ITEMS.get(key)
    if made is not None and len(made[0]) == len(scanned) and all(a is b for a, b in zip(made[0], scanned)):
        return list(made[1])
    out = []
    for i, ((data, name), items) in enumerate(zip(datasets, scanned)):
        settings = latent_settings(data)
        suffix = "" if settings == reference else \
            "-" + content_id(json.dumps(settings, sort_keys=True).encode())[:8]
        if not (i or name or suffix or data.shuffle_tags):  # the first dataset as scanned: its items as they are
            out += items
            continue
        for it in items:
            texts = tuple(dict.fromkeys(t for text in it.texts for t in caption_shuffles(
                text, data, cfg.seed, it.image_id)))
            out.append(dataclasses.replace(it, key=f"{name}/{it.key}" if name else it.key, caption=texts[0],
                                           caption_id=caption_id(texts[0]), captions=texts if len(texts) > 1 else (),
                                           dataset=i, latent_id=it.image_id + suffix if suffix and it.image_id else ""))
    out.sort(key=lambda it: it.key)
    while len(_RUN_ITEMS) >= 2:  # with and without image ids (encode-captions asks without)
        _RUN_ITEMS.pop(next(iter(_RUN_ITEMS)))
    _RUN_ITEMS[key] = (scanned, out)
    return list(out)


_RUN_ITEMS: dict[str, tuple[list[list[Item]], list[Item]]] = {}  # scan_run's last result, with the scans it came from


def caption_shuffles(text: str, data: Any, seed: int, image_id: str) -> list[str]:
    """The cached orders of a caption's comma-separated tags (data.shuffle_tags): data.caption_variants
    seeded shuffles, the first data.keep_tokens tags kept in place; [text] when shuffling is off.
    Seeded by (seed, image id, caption): the same item gets the same shuffles in every run and process."""
    if not data.shuffle_tags:
        return [text]
    tags = [t.strip() for t in text.split(",") if t.strip()]
    fixed, rest = tags[:data.keep_tokens], tags[data.keep_tokens:]
    out = []
    for k in range(data.caption_variants):
        order = list(rest)
        random.Random(f"{seed}:{image_id}:{caption_id(text)}:{k}").shuffle(order)
        out.append(", ".join(fixed + order))
    return list(dict.fromkeys(out))


# ---- controls (edit pairs) -------------------------------------------------------------------
#
# An edit item is a target image, its caption (the instruction) and one or more control images:
# `name_control.png` (or `name_control_1.png`, `_2`, ...) beside `name.png`, or `control/name.png`
# in a top-level `control/` folder mirroring the targets' paths; or metadata.jsonl's `control_image`
# (a path or a list of paths). A control file has no caption of its own, so it is never a target.

CONTROL_SUFFIX = "_control"
CONTROL_DIR = "control"
MAX_CONTROLS = 9  # name_control_1 .. name_control_9


def _image_named(folder: Path, stem: str, tree: FolderTree) -> Path | None:
    """folder/stem with the first image extension that exists (lower or upper case), else None."""
    found = tree.named(str(folder), stem, _EXTS_BOTH_CASES)
    return Path(found[0]) if found else None


_EXTS_BOTH_CASES = tuple(e for ext in IMAGE_EXTS for e in (ext, ext.upper()))


def _is_control(root: Path, path: Path, caption_ext: str, tree: FolderTree) -> bool:
    """A captionless image named as the control of an existing target image."""
    if tree.exists(str(path.with_suffix(caption_ext))):
        return False
    rel = path.relative_to(root)
    if rel.parts[0] == CONTROL_DIR and len(rel.parts) > 1:
        target = root.joinpath(*rel.parts[1:])
        if _image_named(target.parent, target.stem, tree) is not None:
            return True
    stem = path.stem
    for n in ["", *(f"_{k}" for k in range(1, MAX_CONTROLS + 1))]:
        if stem.endswith(CONTROL_SUFFIX + n) and len(stem) > len(CONTROL_SUFFIX + n):
            return _image_named(path.parent, stem[: -len(CONTROL_SUFFIX + n)], tree) is not None
    return False


def _checked_control(root: Path, control: Path, target: str, follow_outside: bool, where: str = "",
                     tree: FolderTree | None = None) -> Path:
    problem = _file_problem(control)
    if problem:
        raise DatasetError(f"{where}control image '{control}' of '{target}' {problem}; fix it, or remove it and the "
                           f"item's other controls")
    _check_inside(root, control, follow_outside, tree)
    return control


def _folder_controls(root: Path, path: Path, follow_outside: bool, tree: FolderTree) -> list[Path]:
    """`name_control.*`, then `name_control_1.*`, `_2`, ... beside the target, then `control/<rel>`."""
    rel, folder = path.relative_to(root), str(path.parent)
    found = [tree.named(folder, f"{path.stem}{CONTROL_SUFFIX}{n}", _EXTS_BOTH_CASES) for n in _CONTROL_NUMBERS]
    found.append(tree.named(str((root / CONTROL_DIR / rel).parent), rel.stem, _EXTS_BOTH_CASES))
    return [_checked_control(root, Path(c[0]), rel.as_posix(), follow_outside, tree=tree) for c in found if c]


_CONTROL_NUMBERS = ("", *(f"_{k}" for k in range(1, MAX_CONTROLS + 1)))


def _row_controls(root: Path, row: dict[str, Any], where: str, follow_outside: bool) -> list[Path]:
    """A metadata.jsonl row's `control_image` paths (a string or a list of strings), checked."""
    names = row.get("control_image", [])
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
        raise DatasetError(f"{where}: 'control_image' must be a path or a list of paths relative to '{root}'")
    return [_checked_control(root, _metadata_path(root, x, where), row["file_name"], follow_outside, where + ": ")
            for x in names]


def for_family(items: list[Item], family: Any, warn: Warn | None = None) -> list[Item]:
    """The items as a family trains them. A family that reads controls (`control_range` (min, max)
    > (0, 0)) gets ids that cover the controls: the latent row's id hashes the target and its
    controls, and, when its text encoder sees the controls too (`text_sees_controls`), so does the
    caption row's. Items must have between min and max controls, all the same count. A text-to-image
    family ignores controls (its ids stay those of the target and caption) with one warning."""
    low, high = family.control_range
    with_controls = [it for it in items if it.controls]
    if high == 0:
        if with_controls and warn is not None:
            warn(f"{family.name} is a text-to-image family: the control images of {len(with_controls)} items are "
                 f"ignored ({listing([repr(it.key) for it in with_controls])}); train an edit family "
                 f"(flux-kontext, qwen-image-edit, qwen-image-edit-2511) or one with references (flux2-klein, flux2) to use them", None)
        return items
    bad = [it for it in items if not low <= len(it.controls) <= high]
    if bad:
        raise DatasetError(f"{family.name} trains on edit pairs with {low}..{high} control images per item; "
                           f"{len(bad)} items have another number: "
                           f"{listing([f'{it.key!r} ({len(it.controls)})' for it in bad])}. Add "
                           f"'name{CONTROL_SUFFIX}.png' beside 'name.png', a '{CONTROL_DIR}/' folder with the same "
                           f"names, or 'control_image' in metadata.jsonl")
    counts = Counter(len(it.controls) for it in items)
    if len(counts) > 1:
        raise DatasetError(f"every item needs the same number of control images (a batch stacks them); found "
                           f"{dict(sorted(counts.items()))} items by count: give every item the same number")
    sees = family.text_sees_controls

    def rekey(it: Item) -> Item:
        joined = "+".join(it.control_ids)
        image_id = _salted(it.image_id, joined)
        salt = joined if sees else ""
        return dataclasses.replace(
            it, image_id=image_id, latent_id=image_id + it.latent_id[len(it.image_id):] if it.latent_id else "",
            caption_id=_salted(it.caption_id, salt), caption_salt=salt)
    return [rekey(it) for it in items]
