"""A corpus of messy inputs, generated (never downloaded) for tests/stages/test_bad_input.py.

    from tests.badinput import write_image_cases, write_caption_case
    cases = write_image_cases(Path("/tmp/corpus"))     # {file name: what it is}

Images are drawn with PIL in the modes and containers real datasets contain: CMYK JPEG, 16-bit
PNG, palette and RGBA PNGs with transparency, grayscale, an EXIF-rotated JPEG, an image smaller
than any bucket, an extreme aspect ratio, a byte-identical duplicate, a very long caption; and the
broken ones: truncated, corrupt, zero-byte, not an image at all. Every image gets a caption file.

Dataset-level cases: paths that leave the dataset folder (symlinks to files outside,
`../` and absolute metadata.jsonl names), files the scan leaves out or merges (a FIFO, a broken
symlink, an unread format, two images sharing one caption), captions with a BOM or NUL bytes.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
from PIL import Image

# Marker colours: the top-left quarter of every drawn image is RED, the rest BLUE, so orientation
# and colour conversions can be checked pixel by pixel.
RED, BLUE = (220, 30, 30), (30, 70, 220)

# cases that cache-latents can read (possibly with a warning) and those it cannot
READABLE = ("cmyk.jpg", "gray16.png", "palette.png", "rgba.png", "gray.png", "exif_rotated.jpg", "tiny.png",
            "extreme_aspect.png", "duplicate.png", "long_caption.png")
UNREADABLE = ("truncated.jpg", "corrupt.jpg", "zero_byte.png", "not_an_image.png")


def quadrant_image(w: int, h: int) -> Image.Image:
    """An RGB image, RED in its top-left quarter and BLUE elsewhere."""
    arr = np.empty((h, w, 3), np.uint8)
    arr[:] = BLUE
    arr[: h // 2, : w // 2] = RED
    return Image.fromarray(arr, "RGB")


def png_bytes(im: Image.Image, **kwargs) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG", **kwargs)
    return buf.getvalue()


def write_good_images(folder: Path, n: int, prefix: str = "good") -> list[str]:
    """n ordinary RGB images with distinct content and captions; returns their file names."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(n):
        arr = np.asarray(quadrant_image(64 + 4 * i, 64)).copy()
        tag = prefix.encode()[:32]
        arr[-1, : len(tag), 1] = list(tag)  # the prefix written into the last row: distinct content ids
        im = Image.fromarray(arr, "RGB")
        name = f"{prefix}_{i:02d}.png"
        (folder / name).write_bytes(png_bytes(im))
        (folder / name).with_suffix(".txt").write_text(f"a red and blue test card number {prefix} {i}")
        names.append(name)
    return names


def _gray16() -> Image.Image:
    """A 16-bit grayscale ramp whose values span 0..65535 (PIL mode I;16)."""
    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    return Image.fromarray(ramp)  # uint16 -> mode I;16


def _palette() -> bytes:
    """A 4-colour palette PNG: the left half is entry 3, which is transparent; on the right, RED
    above BLUE."""
    idx = np.ones((64, 64), np.uint8)  # entry 1: BLUE
    idx[:32, 32:] = 0  # entry 0: RED
    idx[:, :32] = 3
    im = Image.fromarray(idx, "P")
    im.putpalette([*RED, *BLUE, 0, 255, 0, 0, 0, 0])
    return png_bytes(im, transparency=3)


def _rgba() -> Image.Image:
    """RGBA, the right half fully transparent."""
    im = quadrant_image(64, 64).convert("RGBA")
    alpha = np.full((64, 64), 255, np.uint8)
    alpha[:, 32:] = 0
    im.putalpha(Image.fromarray(alpha, "L"))
    return im


def _exif_rotated() -> bytes:
    """A JPEG stored 48 wide x 64 tall with EXIF orientation 6 (display rotated 90° clockwise):
    displayed it is 64 wide x 48 tall with RED in its top-left quarter."""
    shown = quadrant_image(64, 48)
    stored = shown.transpose(Image.Transpose.ROTATE_90)  # undoing orientation 6 rotates 90° clockwise
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    stored.save(buf, "JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


def _truncated_jpeg() -> bytes:
    """A noisy 96x96 JPEG cut off halfway: its header reads fine, decoding fails (so it is found
    only when the image is loaded, after other images were cached)."""
    noise = np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8)
    data = _jpeg(Image.fromarray(noise, "RGB"))
    return data[: len(data) // 2]


def _jpeg(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=95)
    return buf.getvalue()


def write_image_cases(folder: Path, long_caption_words: int = 120) -> dict[str, str]:
    """Every image case into `folder`, each with a caption; returns {file name: description}."""
    folder.mkdir(parents=True, exist_ok=True)
    good = png_bytes(quadrant_image(64, 72))  # unlike any write_good_images() image
    files = {
        "cmyk.jpg": ("CMYK JPEG", _jpeg(quadrant_image(64, 64).convert("CMYK"))),
        "gray16.png": ("16-bit grayscale PNG", png_bytes(_gray16())),
        "palette.png": ("palette PNG with a transparent entry", _palette()),
        "rgba.png": ("RGBA PNG, right half transparent", png_bytes(_rgba())),
        "gray.png": ("8-bit grayscale PNG", png_bytes(quadrant_image(64, 64).convert("L"))),
        "exif_rotated.jpg": ("JPEG with EXIF orientation 6", _exif_rotated()),
        "tiny.png": ("8x8 image, smaller than any bucket", png_bytes(quadrant_image(8, 8))),
        "extreme_aspect.png": ("640x16 image, aspect 40:1", png_bytes(quadrant_image(640, 16))),
        "original.png": ("an ordinary image", good),
        "duplicate.png": ("byte-identical copy of original.png", good),
        "long_caption.png": ("ordinary image whose caption exceeds the token limit", png_bytes(quadrant_image(60, 64))),
        "truncated.jpg": ("JPEG cut off halfway (header intact)", _truncated_jpeg()),
        "corrupt.jpg": ("JPEG signature followed by garbage", b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4),
        "zero_byte.png": ("empty file", b""),
        "not_an_image.png": ("text file with a .png extension", b"this is not a picture\n" * 20),
    }
    for name, (description, data) in files.items():
        (folder / name).write_bytes(data)
        caption = f"test card {name}"
        if name == "long_caption.png":
            caption = " ".join(f"word{i}" for i in range(long_caption_words))
        if name == "duplicate.png":
            caption = "the same picture with another caption"
        (folder / name).with_suffix(".txt").write_text(caption)
    return {name: description for name, (description, _) in files.items()}


def write_caption_case(folder: Path, case: str) -> Path:
    """One good image plus one image with a caption problem; returns the problem image's path.
    case: 'missing' (no caption file), 'empty' (blank caption), 'not_utf8' (Latin-1 bytes),
    'bom' (UTF-8 with a byte-order mark), 'nul' (a NUL byte inside the text)."""
    write_good_images(folder, 1)
    image = folder / f"{case}.png"
    image.write_bytes(png_bytes(quadrant_image(64, 64)))
    caption = image.with_suffix(".txt")
    if case == "empty":
        caption.write_text("  \n")
    elif case == "not_utf8":
        caption.write_bytes("une photo prise à l'été".encode("latin-1"))
    elif case == "bom":
        caption.write_bytes(b"\xef\xbb\xbf" + BOM_CAPTION.encode())
    elif case == "nul":
        caption.write_bytes(b"a red card\x00\x00 with a hidden tail")
    elif case != "missing":
        raise ValueError(case)
    return image


BOM_CAPTION = "a card saved by Notepad"
OUTSIDE_TEXT = "text of a file outside the dataset"
# path cases: symlinks leaving the folder (allowed by data.follow_symlinks_outside) and metadata.jsonl
# names leaving it (refused whatever the key says)
SYMLINK_CASES = ("caption_symlink", "image_symlink")
METADATA_CASES = ("metadata_parent", "metadata_absolute")


def write_path_case(folder: Path, case: str) -> Path:
    """One good image plus one whose image or caption lies outside `folder` (beside it); returns
    the path the scan must name (the symlink, or metadata.jsonl)."""
    write_good_images(folder, 1)
    outside = folder.parent / f"outside-{folder.name}"
    outside.mkdir(exist_ok=True)
    secret, picture = outside / "secret.txt", outside / "x.png"
    secret.write_text(OUTSIDE_TEXT)
    picture.write_bytes(png_bytes(quadrant_image(64, 60)))
    if case == "caption_symlink":
        (folder / "x.png").write_bytes(png_bytes(quadrant_image(60, 60)))
        (folder / "x.txt").symlink_to(secret)
        return folder / "x.txt"
    if case == "image_symlink":
        (folder / "x.png").symlink_to(picture)
        (folder / "x.txt").write_text("a picture that lives elsewhere")
        return folder / "x.png"
    name = {"metadata_parent": f"../{outside.name}/x.png", "metadata_absolute": str(picture)}[case]
    rows = [{"file_name": "good_00.png", "text": "a good card"}, {"file_name": name, "text": "escaped"}]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "metadata.jsonl"


# files the scan leaves out or merges, each kind with the file names its warning must list
DROPPED_CASES = {
    "special": ("fifo.png", "broken.png"),
    "format": ("anim.gif", "phone.heic"),
    "shared": ("twin.png", "twin.jpg"),
}


def write_dropped_cases(folder: Path) -> dict[str, tuple[str, ...]]:
    """Two good images plus every kind of DROPPED_CASES, each with a caption; returns DROPPED_CASES."""
    write_good_images(folder, 2)
    os.mkfifo(folder / "fifo.png")  # reading it would block: the scan must not open it
    (folder / "broken.png").symlink_to(folder / "no-such-file.png")
    (folder / "anim.gif").write_bytes(b"GIF89a" + bytes(32))
    (folder / "phone.heic").write_bytes(bytes(32))
    (folder / "twin.png").write_bytes(png_bytes(quadrant_image(64, 64)))
    (folder / "twin.jpg").write_bytes(_jpeg(quadrant_image(64, 64)))
    for stem in ("fifo", "broken", "anim", "phone", "twin"):
        (folder / f"{stem}.txt").write_text(f"caption of {stem}")
    return DROPPED_CASES
