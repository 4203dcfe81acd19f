"""A small synthetic caption data set of drawn shapes (PIL only), for fast CPU runs.

``make_demo_dataset(folder)`` writes ``shape_000.png`` + ``shape_000.txt`` pairs: one circle,
square or triangle in one of six colours, small or large, at one of five places, on a plain
background of one of four colours; the caption says exactly that, e.g.
``"a large red circle at the left on a white background"``.  Every caption is different (the
combinations are drawn without replacement), shapes, colours and backgrounds are balanced, image
sizes are taken in turn from ``sizes`` (several aspect ratios), and the output depends only on
the arguments.
"""

from __future__ import annotations

import random
from pathlib import Path

__all__ = ["SHAPES", "COLOURS", "BACKGROUNDS", "PLACES", "SIZES_WORDS", "make_demo_dataset", "make_edit_dataset",
           "make_clip_dataset"]

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (30, 70, 220),
    "yellow": (240, 210, 20),
    "purple": (140, 50, 180),
    "orange": (245, 140, 20),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
    "pink": (250, 200, 215),
}
PLACES: tuple[str, ...] = ("in the center", "at the left", "at the right", "at the top", "at the bottom")
SIZES_WORDS: dict[str, float] = {"small": 0.3, "large": 0.6}  # shape extent / shorter image side

MAX_SIDE = 128


def _draw(draw, shape: str, box: tuple[float, float, float, float], fill) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
    else:  # pragma: no cover - guarded by SHAPES
        raise ValueError(shape)


def _centre(place: str, w: int, h: int, r: float, margin: float) -> tuple[float, float]:
    cx, cy = w / 2, h / 2
    if place == "at the left":
        cx = r + margin
    elif place == "at the right":
        cx = w - r - margin
    elif place == "at the top":
        cy = r + margin
    elif place == "at the bottom":
        cy = h - r - margin
    return cx, cy


def _grain(image, seed: int, sigma: float = 10.0):
    """Add seeded film grain. Perfectly flat colours make every GroupNorm group of a random VAE
    near-constant, which amplifies float32 rounding ~1000x; real photos are never flat."""
    import numpy as np
    from PIL import Image

    arr = np.asarray(image, dtype=np.float32)
    arr = arr + np.random.default_rng(seed).normal(0.0, sigma, arr.shape)
    return Image.fromarray(arr.round().clip(0, 255).astype(np.uint8), "RGB")


def make_demo_dataset(
    folder: str | Path,
    n: int = 12,
    seed: int = 0,
    sizes: tuple[tuple[int, int], ...] = ((96, 64), (64, 96), (80, 80)),
) -> Path:
    """Write ``n`` images ``shape_NNN.png`` (sizes taken in turn from ``sizes``, as (width,
    height)) with same-stem ``.txt`` captions into ``folder`` (created if missing); return the folder.

    Captions are distinct (at most ``3*6*4*2*5 = 720`` combinations); deterministic in
    ``(n, seed, sizes)``.  Sides must be 16..128 px so CPU runs stay fast.
    """
    from PIL import Image, ImageDraw

    if n < 1:
        raise ValueError("n must be >= 1")
    if not sizes:
        raise ValueError("sizes must not be empty")
    for w, h in sizes:
        if not (16 <= w <= MAX_SIDE and 16 <= h <= MAX_SIDE):
            raise ValueError(f"image sides must be within 16..{MAX_SIDE} px, got {(w, h)}")
    combos = [
        (size_word, colour, shape, place, bg)
        for shape in SHAPES
        for colour in COLOURS
        for bg in BACKGROUNDS
        for size_word in SIZES_WORDS
        for place in PLACES
    ]
    if n > len(combos):
        raise ValueError(f"at most {len(combos)} distinct captions, asked for {n}")
    rng = random.Random(seed)
    rng.shuffle(combos)
    # Balance the set: shapes cycle, colours and backgrounds follow shuffled cycles, each shape
    # meets every image size; the shuffled order decides the rest (and ties).
    colour_cycle, bg_cycle = list(COLOURS), list(BACKGROUNDS)
    rng.shuffle(colour_cycle)
    rng.shuffle(bg_cycle)
    chosen = []
    for i in range(n):
        want = {2: SHAPES[i % len(SHAPES)], 1: colour_cycle[i % len(colour_cycle)], 4: bg_cycle[i % len(bg_cycle)]}
        for keys in ((2, 1, 4), (2, 1), (2,), ()):  # relax the wish until a combination is left
            pick = next((c for c in combos if all(c[k] == want[k] for k in keys)), None)
            if pick is not None:
                break
        combos.remove(pick)
        chosen.append(pick)

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for i, (size_word, colour, shape, place, bg) in enumerate(chosen):
        w, h = sizes[(i + i // len(SHAPES)) % len(sizes)]
        image = Image.new("RGB", (w, h), BACKGROUNDS[bg])
        r = SIZES_WORDS[size_word] * min(w, h) / 2
        margin = max(2.0, 0.06 * min(w, h))
        cx, cy = _centre(place, w, h, r, margin)
        jitter = max(1.0, margin / 2)
        cx += rng.uniform(-jitter, jitter) if place in ("at the top", "at the bottom", "in the center") else 0.0
        cy += rng.uniform(-jitter, jitter) if place in ("at the left", "at the right", "in the center") else 0.0
        _draw(ImageDraw.Draw(image), shape, (cx - r, cy - r, cx + r, cy + r), COLOURS[colour])
        image = _grain(image, seed * 1000 + i)
        stem = f"shape_{i:03d}"
        image.save(folder / f"{stem}.png")
        (folder / f"{stem}.txt").write_text(f"a {size_word} {colour} {shape} {place} on a {bg} background")
    return folder


EDIT_COLOUR = "blue"  # the edit the demo teaches: recolour the shape blue


def make_edit_dataset(
    folder: str | Path,
    n: int = 12,
    seed: int = 0,
    sizes: tuple[tuple[int, int], ...] = ((96, 64), (64, 96), (80, 80)),
) -> Path:
    """Edit pairs for the edit families' demo: ``shape_NNN_control.png`` draws one shape in a colour
    that is not blue, ``shape_NNN.png`` (the target) is the same drawing, grain included, with the
    shape blue, and ``shape_NNN.txt`` is the instruction, e.g. ``"make the red circle blue"``. Only
    the shape's colour changes, so a tiny model can learn the edit in a few dozen steps.
    Deterministic in ``(n, seed, sizes)``."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    colours = [c for c in COLOURS if c != EDIT_COLOUR]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        shape, colour = SHAPES[i % len(SHAPES)], colours[(i // len(SHAPES) + i) % len(colours)]
        bg = list(BACKGROUNDS)[rng.randrange(len(BACKGROUNDS))]
        r = SIZES_WORDS["large"] * min(w, h) / 2
        cx, cy = _centre(rng.choice(PLACES), w, h, r, max(2.0, 0.06 * min(w, h)))
        stem = f"shape_{i:03d}"
        for name, fill in ((f"{stem}_control.png", COLOURS[colour]), (f"{stem}.png", COLOURS[EDIT_COLOUR])):
            image = Image.new("RGB", (w, h), BACKGROUNDS[bg])
            _draw(ImageDraw.Draw(image), shape, (cx - r, cy - r, cx + r, cy + r), fill)
            _grain(image, seed * 1000 + i).save(folder / name)
        (folder / f"{stem}.txt").write_text(f"make the {colour} {shape} {EDIT_COLOUR}")
    return folder


MOTIONS: dict[str, tuple[float, float]] = {"moving right": (1, 0), "moving left": (-1, 0), "moving down": (0, 1),
                                           "moving up": (0, -1)}


def make_clip_dataset(
    folder: str | Path,
    n: int = 8,
    seed: int = 0,
    frames: int = 12,
    fps: float = 24.0,
    sizes: tuple[tuple[int, int], ...] = ((96, 64), (64, 64)),
) -> Path:
    """Write ``n`` clips of one drawn shape moving across a plain background, with captions that say so
    (``"a small red circle moving right on a white background"``): ``clip_NNN.mp4`` (H.264 or MPEG-4 through
    PyAV), every fourth one as a folder of PNG frames ``clip_NNN/`` instead, plus two still images
    ``still_NNN.png`` (1-frame clips). ``frames`` frames at ``fps``; deterministic in the arguments."""
    from PIL import Image, ImageDraw

    from stages.core.video import write_mp4

    rng = random.Random(seed)
    combos = [(s, c, sh, m, bg) for sh in SHAPES for c in COLOURS for bg in BACKGROUNDS for s in SIZES_WORDS
              for m in MOTIONS]
    rng.shuffle(combos)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for i, (size_word, colour, shape, motion, bg) in enumerate(combos[:n + 2]):
        w, h = sizes[0] if i >= n else sizes[i % len(sizes)]  # the stills share one bucket
        r = SIZES_WORDS[size_word] * min(w, h) / 2
        (dx, dy), travel = MOTIONS[motion], (w - 2 * r, h - 2 * r)
        clip = []
        for k in range(frames if i < n else 1):
            f = k / max(1, frames - 1)
            cx = w / 2 + dx * travel[0] * (f - 0.5)
            cy = h / 2 + dy * travel[1] * (f - 0.5)
            image = Image.new("RGB", (w, h), BACKGROUNDS[bg])
            _draw(ImageDraw.Draw(image), shape, (cx - r, cy - r, cx + r, cy + r), COLOURS[colour])
            clip.append(_grain(image, seed * 100000 + i * 100 + k))
        if i >= n:  # a still image: what the shape looks like, with no motion in its caption
            clip[0].save(folder / f"still_{i - n:03d}.png")
            (folder / f"still_{i - n:03d}.txt").write_text(f"a {size_word} {colour} {shape} on a {bg} background")
            continue
        stem = f"clip_{i:03d}"
        if i % 4 == 3 or not write_mp4(folder / f"{stem}.mp4", clip, fps):
            (folder / stem).mkdir(exist_ok=True)
            for k, image in enumerate(clip):
                image.save(folder / stem / f"{k:04d}.png")
        (folder / f"{stem}.txt").write_text(f"a {size_word} {colour} {shape} {motion} on a {bg} background")
    return folder
