"""Video clips as training items: probing, frame sampling and decoding. No torch needed.

A clip is a video file (VIDEO_EXTS, decoded with PyAV) or a folder of frames (images, in number order)
with a caption beside it (`walk.mp4` + `walk.txt`, or `walk/` + `walk.txt`). A clip trains on
`data.frames` frames taken `data.fps` apart (0: the clip's own frames, one after another), from a start
frame each cached variant draws (variant 0 starts at the first frame). A clip shorter than that span is
a bad input like a broken image: named with what to do, under data.on_bad_image.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.errors import DatasetError

VIDEO_EXTS = (".mp4", ".webm", ".mov", ".mkv", ".m4v")
FRAME_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
FOLDER_FPS = 24.0  # a folder of frames has no rate of its own: read as 24 fps (what data.fps resamples from)
SKIP_ADVICE = ', or set data.on_bad_image = "skip" to skip such files'  # cut from a skip's message (image_io.as_skipped)
BAD_CLIP_HINT = f"replace or remove the clip{SKIP_ADVICE}"


class BadClip(DatasetError):
    """A clip that cannot be decoded or is too short (cache-latents treats it as a BadImage)."""


@dataclass(frozen=True)
class ClipInfo:
    """What a probe of a clip's header finds: frame size, frame count and rate."""

    width: int
    height: int
    frames: int
    fps: float


def is_clip(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_EXTS or path.is_dir()


def frame_files(folder: Path) -> list[Path]:
    """The frames of a folder clip in natural order: the numbers in their names compared as numbers, so
    unpadded `1.png, 2.png, 10.png` keep that order (by name, 10 would come before 2)."""
    return sorted((p for p in folder.iterdir() if p.suffix.lower() in FRAME_EXTS and p.is_file()), key=natural_key)


def natural_key(path: Path) -> tuple[list[Any], str]:
    """Sort key of a name with its digit runs as numbers (`frame_2` before `frame_10`); the whole name breaks
    ties (`01.png`, `1.png`). re.split with a group alternates text and digits, so like compares with like."""
    parts = re.split(r"(\d+)", path.name)
    return [int(t) if i % 2 else t for i, t in enumerate(parts)], path.name


def missing_frame(frames: list[Path]) -> str | None:
    """The first absent frame's name in a folder of frames numbered one after another (`0000.png`,
    `frame_7.png`...: a common prefix, then a number), or None when none is absent or the names are not
    numbered that way."""
    numbered = [re.fullmatch(r"(.*?)(\d+)", p.stem) for p in frames]
    if len(frames) < 2 or not all(numbered) or len({m.group(1) for m in numbered}) > 1:
        return None
    numbers = sorted(int(m.group(2)) for m in numbered)
    for a, b in zip(numbers, numbers[1:]):
        if b > a + 1:
            m, width = numbered[0], len(numbered[0].group(2))
            return f"{m.group(1)}{a + 1:0{width}d}{frames[0].suffix}"
    return None


def probe(path: Path) -> ClipInfo:
    """A clip's size, frame count and rate from its headers (a video stream's declared count, else its
    duration x rate; a folder: its first frame's size and its frame count). Raises BadClip."""
    if path.is_dir():
        from stages.core.image_io import image_size

        frames = frame_files(path)
        if not frames:
            raise BadClip(f"clip folder '{path}' holds no frames ({', '.join(FRAME_EXTS)}): add its frames or remove it")
        gap = missing_frame(frames)
        if gap:
            raise BadClip(f"clip folder '{path}' is missing frame {gap} (its frames are numbered and one is absent, "
                          f"so the clip would jump there): add the frame or renumber the frames after it, "
                          f"{BAD_CLIP_HINT.replace('replace or remove the clip', 'or remove the folder')}")
        return ClipInfo(*image_size(frames[0]), len(frames), FOLDER_FPS)
    with _open(path) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        count = int(stream.frames or 0)
        if count <= 0 and stream.duration and stream.time_base and fps:
            count = int(float(stream.duration * stream.time_base) * fps + 0.5)
        if count <= 0:
            count = sum(1 for _ in container.decode(stream))
        return ClipInfo(stream.codec_context.width, stream.codec_context.height, count, fps or FOLDER_FPS)


class _open:
    """av.open with every way a file can fail to be a video raised as a BadClip naming the file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Any:
        import av

        if os.path.getsize(self.path) == 0:
            raise BadClip(f"clip '{self.path}' is an empty (zero-byte) file: {BAD_CLIP_HINT}")
        try:
            self.container = av.open(str(self.path))
        except (av.FFmpegError, OSError) as e:
            raise BadClip(f"clip '{self.path}' cannot be opened as a video ({e}): {BAD_CLIP_HINT}") from None
        if not self.container.streams.video:
            self.container.close()
            raise BadClip(f"clip '{self.path}' has no video stream: {BAD_CLIP_HINT}")
        return self.container

    def __exit__(self, *exc: Any) -> None:
        self.container.close()


def step(info: ClipInfo, fps: float) -> float:
    """Source frames between two trained frames: 1 at the clip's own rate (fps 0)."""
    return info.fps / fps if fps > 0 else 1.0


def span(info: ClipInfo, frames: int, fps: float) -> int:
    """Source frames a sample of `frames` frames `fps` apart covers."""
    return round((frames - 1) * step(info, fps)) + 1


def too_short(path: Path, info: ClipInfo, frames: int, fps: float) -> str | None:
    """Why the clip cannot give `frames` frames at `fps` (a one-line message naming it and what to do), or None."""
    need = span(info, frames, fps)
    if info.frames >= need:
        return None
    rate = f" at data.fps = {fps:g} (the clip runs at {info.fps:g} fps)" if fps > 0 else ""
    return (f"clip '{path}' has {info.frames} frames but data.frames = {frames}{rate} needs {need}: lower data.frames"
            f"{' or data.fps' if fps > 0 else ''}, or {BAD_CLIP_HINT}")


def start_frames(seed: int, clip_id: str, info: ClipInfo, frames: int, fps: float, n: int) -> list[int]:
    """The first source frame of each of `n` variants: 0 for the first, seeded draws over the clip for
    the rest (by seed, clip id and variant, like the crop plan)."""
    room = max(0, info.frames - span(info, frames, fps))
    return [0 if k == 0 else random.Random(f"{seed}:{clip_id}:start:{k}").randint(0, room) for k in range(n)]


def frame_indices(info: ClipInfo, start: int, frames: int, fps: float) -> list[int]:
    s = step(info, fps)
    return [min(info.frames - 1, start + round(k * s)) for k in range(frames)]


def read_frames(path: Path, wanted: list[int], background: str = "white") -> list[Any]:
    """The clip's frames at the source indices `wanted` (any order, repeats allowed) as RGB PIL images.
    Raises BadClip naming the clip when it ends early or cannot be decoded."""
    if path.is_dir():
        from stages.core.image_io import load_image

        files = frame_files(path)
        if max(wanted) >= len(files):
            raise BadClip(f"clip folder '{path}' has {len(files)} frames, fewer than it had when scanned: rerun")
        return [load_image(files[i], background) for i in wanted]
    import av

    need, found = set(wanted), {}
    last = max(wanted)
    with _open(path) as container:
        try:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in need:
                    found[i] = frame.to_image().convert("RGB")
                if i >= last:
                    break
        except (av.FFmpegError, OSError) as e:
            raise BadClip(f"clip '{path}' is truncated or corrupt ({e}): {BAD_CLIP_HINT}") from None
    if len(found) < len(need):
        raise BadClip(f"clip '{path}' ends after {max(found, default=-1) + 1} frames, before frame {last + 1} that "
                      f"data.frames needs (its header promised more): {BAD_CLIP_HINT}")
    return [found[i] for i in wanted]


def write_mp4(path: Path, frames: list[Any], fps: float) -> bool:
    """Frames (RGB PIL images of one size) as an H.264 mp4 through PyAV, atomically; False (nothing written)
    when this PyAV build has no H.264 or MPEG-4 encoder."""
    import av

    tmp = path.with_name(path.name + ".partial")
    for codec in ("libx264", "mpeg4"):
        try:
            av.codec.Codec(codec, "w")
        except Exception:  # noqa: BLE001 - av raises UnknownCodecError or ValueError by version
            continue
        with av.open(str(tmp), "w", format="mp4") as out:
            stream = out.add_stream(codec, rate=round(fps))
            stream.width, stream.height = frames[0].size[0] // 2 * 2, frames[0].size[1] // 2 * 2
            stream.pix_fmt = "yuv420p"
            for im in frames:
                out.mux(stream.encode(av.VideoFrame.from_image(im.crop((0, 0, stream.width, stream.height)))))
            out.mux(stream.encode())
        os.replace(tmp, path)
        return True
    return False


def write_animation(path: Path, frames: list[Any], fps: float) -> None:
    """Frames as a looping animated WebP or GIF (by the suffix), atomically, through Pillow."""
    tmp = path.with_name(path.name + ".partial")
    fmt = "WEBP" if path.suffix.lower() == ".webp" else "GIF"
    frames[0].save(tmp, format=fmt, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0,
                   **({"lossless": True} if fmt == "WEBP" else {}))
    os.replace(tmp, path)
