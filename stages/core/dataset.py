"""Dataset scan, content ids, aspect buckets and the seeded crop/flip plan. No torch needed.

An item is one (image, caption) pair. Its ids are content hashes: `image_id` of the image bytes,
`caption_id` of the caption text. Caches are keyed by these ids, never by position, so a shuffled
loader can never pair a latent with the wrong caption, and an edited caption or added image touches
only its own rows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from stages.core.errors import DatasetError

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")


class BadImage(DatasetError):
    pass


@dataclass(frozen=True)
class Item:
    key: str  # path relative to the dataset root, e.g. "cats/01.png"
    image_path: Path
    caption: str
    image_id: str
    caption_id: str


def content_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


def caption_id(text: str) -> str:
    return content_id(text.encode("utf-8"))


def _read_caption(path: Path) -> str:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"caption '{path}' is not UTF-8 text ({e.reason} at byte {e.start}); re-save it as UTF-8") from None
    text = text.strip()
    if not text:
        raise DatasetError(f"caption '{path}' is empty; write a caption or remove the image")
    return text


def _from_metadata(root: Path, meta: Path) -> list[tuple[Path, str]]:
    pairs = []
    for n, line in enumerate(meta.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            name, text = row["file_name"], row["text"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DatasetError(f"{meta}:{n}: each line must be a JSON object with 'file_name' and 'text' ({e})") from None
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(f"{meta}:{n}: empty caption for '{name}'")
        path = root / name
        if not path.is_file():
            raise DatasetError(f"{meta}:{n}: image '{path}' does not exist")
        pairs.append((path, text.strip()))
    return pairs


def _from_folder(root: Path, caption_ext: str) -> list[tuple[Path, str]]:
    pairs = []
    for path in sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTS and p.is_file()):
        cap = path.with_suffix(caption_ext)
        if not cap.is_file():
            raise DatasetError(f"image '{path}' has no caption file '{cap.name}'; add one or move the image out")
        pairs.append((path, _read_caption(cap)))
    return pairs


def scan(root: str | Path, caption_ext: str = ".txt") -> list[Item]:
    """All items under root, sorted by key: metadata.jsonl if present, else image + same-stem caption."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"dataset folder '{root}' does not exist (set data.path)")
    meta = root / "metadata.jsonl"
    pairs = _from_metadata(root, meta) if meta.is_file() else _from_folder(root, caption_ext)
    if not pairs:
        raise DatasetError(f"dataset folder '{root}' has no images ({', '.join(IMAGE_EXTS)}) with captions")
    items = []
    for path, text in pairs:
        items.append(Item(path.relative_to(root).as_posix(), path, text, content_id(path.read_bytes()), caption_id(text)))
    return sorted(items, key=lambda it: it.key)


# ---- buckets ---------------------------------------------------------------------------------


def make_buckets(resolution: int, multiple: int, max_aspect: float) -> list[tuple[int, int]]:
    """(width, height) pairs, sides multiples of `multiple`, area <= resolution**2, aspect <= max_aspect."""
    area = resolution * resolution
    buckets = set()
    w = multiple
    while w <= resolution * math.sqrt(max_aspect) + multiple:
        h = (area // w) // multiple * multiple
        if h >= multiple and max(w / h, h / w) <= max_aspect + 1e-6:
            buckets.add((w, h))
        w += multiple
    # keep only buckets that use most of the area (drop tiny ones produced by rounding down)
    return sorted(b for b in buckets if b[0] * b[1] >= 0.8 * area)


def assign_bucket(size: tuple[int, int], buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """Bucket whose aspect ratio is nearest (in log space) to the image's (width, height)."""
    ar = math.log(size[0] / size[1])
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - ar), -b[0] * b[1]))


def bucket_name(bucket: tuple[int, int]) -> str:
    return f"{bucket[0]}x{bucket[1]}"


UPSCALE_WARNING = 1.5  # covering a bucket often needs a few % of upscaling; 1.5x and more visibly blurs


def size_notes(key: str, size: tuple[int, int], bucket: tuple[int, int], max_aspect: float) -> list[str]:
    """Warnings for an image that trains but loses something: too small for its bucket (upscaled,
    blurred) or with an aspect beyond max_aspect (a bucket crop cuts much of it away)."""
    (w, h), (bw, bh) = size, bucket
    notes = []
    aspect = max(w / h, h / w)
    if aspect > max_aspect + 1e-6:
        scale = max(bw / w, bh / h)
        kept = bw * bh / (w * scale * h * scale)
        notes.append(f"image '{key}' is {w}x{h}, aspect {aspect:.1f}:1 beyond data.max_aspect = {max_aspect}: "
                     f"cropped to bucket {bw}x{bh}, keeping {kept:.0%} of it (crop it yourself or raise data.max_aspect)")
    if max(bw / w, bh / h) > UPSCALE_WARNING:
        notes.append(f"image '{key}' is {w}x{h}, smaller than its bucket {bw}x{bh}: upscaled "
                     f"{max(bw / w, bh / h):.1f}x, which blurs it (use a larger image or a lower data.resolution)")
    return notes


@dataclass(frozen=True)
class Variant:
    """How one cached variant is cut from the source image (all in pixels)."""

    resized: tuple[int, int]  # (width, height) the image is resized to before cropping
    crop_left: int
    crop_top: int
    flip: bool


def plan_variants(image_id: str, size: tuple[int, int], bucket: tuple[int, int], n: int, seed: int,
                  random_flip: bool, crop: str, zoom: float = 0.0) -> list[Variant]:
    """The seeded crop/flip plan: resize to cover the bucket (variant k > 0 zoomed in by up to
    `zoom`, so an image whose aspect already fits its bucket still gets distinct crops), then crop;
    odd variants are flipped. Seeded by (seed, image id, variant): independent of scan order and
    of how many processes share the work.
    """
    w, h = size
    bw, bh = bucket
    cover = max(bw / w, bh / h)
    out = []
    for k in range(n):
        rng = random.Random(f"{seed}:{image_id}:{k}")
        scale = cover * (1.0 + zoom * rng.random()) if k > 0 else cover
        rw, rh = max(bw, round(w * scale)), max(bh, round(h * scale))
        if crop == "center":
            left, top = (rw - bw) // 2, (rh - bh) // 2
        else:
            left, top = rng.randint(0, rw - bw), rng.randint(0, rh - bh)
        out.append(Variant((rw, rh), left, top, random_flip and k % 2 == 1))
    return out


# ---- images ----------------------------------------------------------------------------------


BAD_IMAGE_HINT = 'replace or remove the file, or set data.on_bad_image = "skip" to skip such files'


@contextlib.contextmanager
def _open_image(path: Path) -> Iterator[Any]:
    """PIL's Image.open, with every way a file can fail to be an image raised as a BadImage that
    names the file, the reason and what to do."""
    from PIL import Image, UnidentifiedImageError

    if path.stat().st_size == 0:
        raise BadImage(f"image '{path}' is an empty (zero-byte) file: {BAD_IMAGE_HINT}")
    try:
        with Image.open(path) as im:
            yield im
    except UnidentifiedImageError:
        kind = _signature(path)
        what = f"starts like a {kind} but is corrupt" if kind else "is not an image (or in a format PIL cannot read)"
        raise BadImage(f"'{path}' {what}: {BAD_IMAGE_HINT}") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise BadImage(f"image '{path}' is truncated or corrupt ({e}): {BAD_IMAGE_HINT}") from None


_SIGNATURES = {b"\xff\xd8\xff": "JPEG", b"\x89PNG": "PNG", b"GIF8": "GIF", b"BM": "BMP", b"II*\x00": "TIFF",
               b"MM\x00*": "TIFF", b"RIFF": "WebP"}


def _signature(path: Path) -> str | None:
    """The image format a file's first bytes claim, if any (tells 'corrupt' from 'not an image')."""
    with open(path, "rb") as f:
        head = f.read(8)
    return next((kind for magic, kind in _SIGNATURES.items() if head.startswith(magic)), None)


def load_image(path: Path, background: str = "white"):
    """Open an image as 8-bit RGB: EXIF orientation applied, alpha composited on `background`,
    16-bit, palette, grayscale and CMYK converted. Raises BadImage naming the file and the reason."""
    from PIL import Image, ImageOps

    with _open_image(path) as im:
        im.load()
        im = ImageOps.exif_transpose(im)
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        import numpy as np

        arr = np.asarray(im, dtype=np.float64)
        # I;16 is 16-bit by definition; mode I (32-bit ints) is judged by its values
        peak = 65535.0 if im.mode.startswith("I;16") or arr.max() > 255 else 255.0
        im = Image.fromarray((arr / peak * 255.0).round().clip(0, 255).astype("uint8"), "L")
    if im.mode == "P" or "transparency" in im.info:  # palette, or a tRNS colour key on L/RGB
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA"):
        im = im.convert("RGBA")
        bg = Image.new("RGBA", im.size, background)
        im = Image.alpha_composite(bg, im)
    return im.convert("RGB")


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) after EXIF orientation, read from the header only."""
    with _open_image(path) as im:
        w, h = im.size
        orientation = im.getexif().get(0x0112, 1)
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


def render_variant(image, v: Variant, bucket: tuple[int, int]):
    """Apply a Variant to an RGB PIL image -> PIL image of the bucket's size."""
    from PIL import Image

    im = image.resize(v.resized, Image.Resampling.LANCZOS)
    im = im.crop((v.crop_left, v.crop_top, v.crop_left + bucket[0], v.crop_top + bucket[1]))
    return im.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if v.flip else im
