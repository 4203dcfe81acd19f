"""Fault injection for the crash tests: make a stage signal itself at a chosen point.

    LORAPIPE_KILL_AFTER="cache-latents:3" lorapipe cache-latents -c my.toml   # SIGKILL after 3 rows
    LORAPIPE_KILL_AFTER="train:4:TERM,mid-save:1:TERM" lorapipe train ...  # stop, 2nd signal mid-save

The value is a comma-separated list of `<point>:<n>[:<signal>]`; when `point` is hit for the n-th
time in this process, the process sends itself the signal (default KILL, which no handler can
catch: the same as a pre-empted job or the OOM killer). Points the stages call:

    encode-captions, cache-latents   after each row is on disk (its journal record complete)
    mid-row                          inside a row's journal record: half of it written
    train                            after each optimizer step
    mid-save                         inside a checkpoint or lora/final save: adapter and state written,
                                     manifest not yet, folder not yet renamed into place
    sample                           after each rendered image

Unset (always, outside tests) a hit costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "LORAPIPE_KILL_AFTER"
_counts: Counter[str] = Counter()
_seen_spec = ""


def parse(spec: str) -> list[tuple[str, int, signal.Signals]]:
    """`"train:3:TERM,mid-save:1"` -> [("train", 3, SIGTERM), ("mid-save", 1, SIGKILL)]."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        if len(fields) not in (2, 3) or not fields[1].isdigit():
            raise ValueError(f"{ENV}: '{part}' must look like <point>:<n>[:<signal>], e.g. cache-latents:3:KILL")
        sig = signal.Signals[f"SIG{fields[2].upper()}"] if len(fields) == 3 else signal.SIGKILL
        out.append((fields[0], int(fields[1]), sig))
    return out


def hit(point: str) -> None:
    """Count one pass through `point`; signal this process if the spec asks for it now."""
    global _seen_spec
    spec = os.environ.get(ENV, "")
    if not spec:
        _seen_spec = ""  # unset in between: the same spec set again later counts afresh
        return
    if spec != _seen_spec:  # a new spec (tests set it per run) starts counting afresh
        _counts.clear()
        _seen_spec = spec
    _counts[point] += 1
    for name, n, sig in parse(spec):
        if name == point and _counts[point] == n:
            os.kill(os.getpid(), sig)
