"""Reading images and loss masks as the stages see them (EXIF orientation, alpha, 16-bit and palette
modes), every failure a `BadImage` naming the file and what to do; cutting a variant from an image."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from stages.core.aspect_buckets import Variant
from stages.core.errors import DatasetError
from stages.core.video import SKIP_ADVICE


class BadImage(DatasetError):
    """An image, clip or loss mask that cannot be read; the message names the file and what to do."""


BAD_IMAGE_HINT = f"replace or remove the file{SKIP_ADVICE}"


def as_skipped(reason: str) -> str:
    """A bad image's (or clip's) message as a skip reports it: without the advice to set
    data.on_bad_image = "skip", which is already set."""
    return reason.replace(SKIP_ADVICE, "")


@contextlib.contextmanager
def _open_image(path: Path) -> Iterator[Any]:
    """PIL's Image.open, with every way a file can fail to be an image raised as a BadImage that
    names the file, the reason and what to do."""
    from PIL import Image, UnidentifiedImageError

    try:
        f = open(path, "rb")
    except OSError as e:  # permission denied, removed since the scan, ...
        raise BadImage(f"image '{path}' cannot be read ({e.strerror or e}): fix its permissions, {BAD_IMAGE_HINT}") from None
    with f:
        if os.fstat(f.fileno()).st_size == 0:
            raise BadImage(f"image '{path}' is an empty (zero-byte) file: {BAD_IMAGE_HINT}")
        try:
            with Image.open(f) as im:
                yield im
        except UnidentifiedImageError:
            kind = _signature(f)
            what = f"starts like a {kind} but is corrupt" if kind else "is not an image (or in a format PIL cannot read)"
            raise BadImage(f"'{path}' {what}: {BAD_IMAGE_HINT}") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise BadImage(f"image '{path}' is truncated or corrupt ({e}): {BAD_IMAGE_HINT}") from None


_SIGNATURES = {b"\xff\xd8\xff": "JPEG", b"\x89PNG": "PNG", b"GIF8": "GIF", b"BM": "BMP", b"II*\x00": "TIFF",
               b"MM\x00*": "TIFF", b"RIFF": "WebP"}


def _signature(f: Any) -> str | None:
    """The image format an open file's first bytes claim, if any (tells 'corrupt' from 'not an image')."""
    f.seek(0)
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


def load_mask(path: Path, image_size: tuple[int, int]):
    """A loss mask as an 8-bit grey PIL image (EXIF orientation applied) of the image's size.
    Raises BadImage naming the mask, like a broken image."""
    from PIL import ImageOps

    with _open_image(path) as im:
        im.load()
        im = ImageOps.exif_transpose(im)
    if im.size != tuple(image_size):
        raise BadImage(f"loss mask '{path}' is {im.size[0]}x{im.size[1]} but its image is "
                       f"{image_size[0]}x{image_size[1]}: save the mask at the image's size")
    return im.convert("L") if im.mode != "L" else im


def mask_at_latents(mask, v: Variant, bucket: tuple[int, int], latent_hw: tuple[int, int]):
    """The mask cut as variant `v` cuts its image, averaged over each latent cell -> float32 (h, w)
    in [0, 1] (255 -> 1.0 exactly, so an all-white mask is all ones)."""
    import numpy as np

    (h, w), (bw, bh) = latent_hw, bucket[:2]
    arr = np.asarray(render_variant(mask, v, bucket), dtype=np.float32) / 255.0
    return arr.reshape(h, bh // h, w, bw // w).mean(axis=(1, 3), dtype=np.float32)


def render_variant(image, v: Variant, bucket: tuple[int, int]):
    """Apply a Variant to an RGB PIL image -> PIL image of the bucket's size."""
    from PIL import Image

    im = image.resize(v.resized, Image.Resampling.LANCZOS)
    im = im.crop((v.crop_left, v.crop_top, v.crop_left + bucket[0], v.crop_top + bucket[1]))
    return im.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if v.flip else im
