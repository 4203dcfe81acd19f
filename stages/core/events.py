"""events.jsonl and progress display.

Every stage appends one JSON object per line to artifacts/<run>/events.jsonl, each with `ts`,
`run`, `stage`, `event` and the event's fields (README: "Events"). Lines are written with one
`write` on an O_APPEND file, so concurrent stages never interleave inside a line.

Progress: a rich bar with rate and ETA on a terminal; plain periodic lines otherwise (CI, logs).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

EVENT_TYPES = {
    "start": "stage started (fields: pid, config fingerprint)",
    "loading": "a model component is being loaded (component, class)",
    "loaded": "a model component finished loading (component, seconds)",
    "preparing": "cache-build progress (done, total, encoded)",
    "skipped": "an input was skipped (item, reason)",
    "warning": "something the user should know (message)",
    "step": "one optimizer step (step, loss, lr, samples_per_second, peak_vram_gb)",
    "checkpoint": "a resumable checkpoint was written (step, path)",
    "stopped": "training stopped on request (step, saved)",
    "done": "stage finished (seconds, plus stage summary fields)",
    "up_to_date": "stage skipped because its manifest matches (fingerprint)",
    "error": "stage failed (message, item when one input caused it)",
}


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


class EventLog:
    def __init__(self, run_dir: Path, run: str, stage: str, enabled: bool = True):
        self.path = run_dir / "events.jsonl"
        self.run, self.stage, self.enabled = run, stage, enabled
        run_dir.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        assert event in EVENT_TYPES, event
        record = {"ts": round(time.time(), 3), "run": self.run, "stage": self.stage, "event": event}
        record.update({k: _clean(v) for k, v in fields.items()})
        if self.enabled:
            line = (json.dumps(record, default=str) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return record


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Progress:
    """`with Progress("encode", total) as p: p.advance(n, loss=...)` — rich on a TTY, lines otherwise."""

    def __init__(self, label: str, total: int, unit: str = "items", every_s: float = 10.0):
        self.label, self.total, self.unit, self.every_s = label, total, unit, every_s
        self.done = 0
        self.tty = sys.stderr.isatty() and os.environ.get("LORAPIPE_PLAIN") != "1"
        self._bar: Any = None
        self._t0 = self._last = time.time()

    def __enter__(self) -> "Progress":
        if self.tty:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self._bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[info]}"), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, rate="", info="")
        else:
            print(f"[{self.label}] 0/{self.total} {self.unit}", file=sys.stderr, flush=True)
        return self

    def advance(self, n: int = 1, **info: Any) -> None:
        self.done += n
        now = time.time()
        rate = self.done / max(now - self._t0, 1e-9)
        text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
        if self._bar is not None:
            self._bar.update(self._task, advance=n, rate=f"{rate:.2f} {self.unit}/s", info=text)
        elif now - self._last >= self.every_s or self.done >= self.total:
            self._last = now
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            print(f"[{self.label}] {self.done}/{self.total} {self.unit} {rate:.2f}/s eta {eta:.0f}s {text}",
                  file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()
