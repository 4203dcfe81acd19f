"""Aspect buckets and the seeded crop/flip plan of each cached variant: pure functions of image sizes, ids
and settings (no torch, no PIL), so every process that shares the work plans the same crops."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

from stages.core.errors import listing


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


def _log_aspect(size: tuple[int, int]) -> float:
    return math.log(size[0] / size[1])


def assign_bucket(size: tuple[int, int], buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """Bucket whose aspect ratio is nearest (in log space) to the image's (width, height)."""
    ar = _log_aspect(size)
    return min(buckets, key=lambda b: (abs(_log_aspect(b) - ar), -b[0] * b[1]))


def merge_buckets(sizes: dict[str, tuple[int, int]], buckets: list[tuple[int, int]],
                  fill: int) -> dict[str, tuple[int, int]]:
    """image id -> bucket such that every used bucket can fill a batch of `fill` (data.bucket_merge).

    Images first go to their nearest bucket. While no bucket holds `fill` images, the emptiest
    occupied bucket is folded into the occupied bucket nearest its aspect. Then every image of a
    bucket holding fewer than `fill` moves to the bucket nearest its own aspect among those holding at
    least `fill`. Pure and ordered: the same sizes give the same plan. With fewer than `fill` images
    in all nothing can fill a batch, and images stay in their nearest bucket."""
    assigned = {i: assign_bucket(s, buckets) for i, s in sorted(sizes.items())}
    if fill <= 1 or len(assigned) < fill:
        return assigned
    counts = Counter(assigned.values())
    while max(counts.values()) < fill:
        emptiest = min(counts, key=lambda b: (counts[b], b))
        n = counts.pop(emptiest)
        target = assign_bucket(emptiest, sorted(counts))
        counts[target] += n
        assigned = {i: target if b == emptiest else b for i, b in assigned.items()}
    full = sorted(b for b, c in counts.items() if c >= fill)
    return {i: b if counts[b] >= fill else assign_bucket(sizes[i], full) for i, b in assigned.items()}


def bucket_plan(images: dict[str, tuple[str, tuple[int, int]]], buckets: list[tuple[int, int]], fill: int,
                max_aspect: float) -> tuple[dict[str, tuple[int, int]], list[tuple[str | None, str]]]:
    """image id -> bucket for images {id: (key, size)}, merged so buckets fill batches of `fill`
    when fill > 1 (0: nearest bucket only); and the (item key, warning) pairs: size notes and, after
    a merge, which images moved and how much of each the crop keeps."""
    assigned = merge_buckets({i: size for i, (_, size) in images.items()}, buckets, fill)
    notes: list[tuple[str | None, str]] = [
        (key, note) for i, (key, size) in sorted(images.items(), key=lambda kv: kv[1][0])
        for note in size_notes(key, size, assigned[i], max_aspect)]
    moved = [f"'{key}' {size[0]}x{size[1]} to {bucket_name(assigned[i])} (keeps {kept_fraction(size, assigned[i]):.0%})"
             for i, (key, size) in sorted(images.items(), key=lambda kv: kv[1][0])
             if assigned[i] != assign_bucket(size, buckets)]
    if moved:
        notes.append((None, f"data.bucket_merge moved {len(moved)} images into buckets holding at least {fill}, "
                            f"cropping more of them: {listing(moved)}"))
    return assigned, notes


def kept_fraction(size: tuple[int, int], bucket: tuple[int, int]) -> float:
    """Share of an image that a crop to `bucket` keeps (the image is first resized to cover it)."""
    (w, h), (bw, bh) = size, bucket[:2]
    scale = max(bw / w, bh / h)
    return bw * bh / (w * scale * h * scale)


def bucket_name(bucket: tuple[int, int]) -> str:
    return f"{bucket[0]}x{bucket[1]}"


UPSCALE_WARNING = 1.5  # covering a bucket often needs a few % of upscaling; 1.5x and more visibly blurs


def size_notes(key: str, size: tuple[int, int], bucket: tuple[int, int], max_aspect: float) -> list[str]:
    """Warnings for an image that trains but loses something: too small for its bucket (upscaled,
    blurred) or with an aspect beyond max_aspect (a bucket crop cuts much of it away)."""
    (w, h), (bw, bh) = size, bucket[:2]
    notes = []
    aspect = max(w / h, h / w)
    if aspect > max_aspect + 1e-6:
        kept = kept_fraction(size, bucket)
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
    start: int = 0  # a clip's first source frame (stages.core.video.start_frames); 0 for an image


def plan_variants(image_id: str, size: tuple[int, int], bucket: tuple[int, int], n: int, seed: int,
                  random_flip: bool, crop: str, zoom: float = 0.0) -> list[Variant]:
    """The seeded crop/flip plan: resize to cover the bucket (variant k > 0 zoomed in by up to
    `zoom`, so an image whose aspect already fits its bucket still gets distinct crops), then crop;
    odd variants are flipped. Seeded by (seed, image id, variant): independent of scan order and
    of how many processes share the work.
    """
    w, h = size
    bw, bh = bucket[:2]
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
