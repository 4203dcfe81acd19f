"""events.jsonl and progress display.

Every stage appends one JSON object per line to artifacts/<run>/events.jsonl, each with `ts`,
`run`, `stage`, `event` and the event's fields (docs/configuration.md, "Events"). Lines are written with one
`write` on an O_APPEND file, so concurrent stages never interleave inside a line.

Progress: a rich bar with rate and ETA on a terminal; plain periodic lines otherwise (CI, logs).
Warnings and skipped inputs are printed to stderr as they happen (above a live bar), and a stage's
`done` event ends with a one-line summary (counts, warnings, where the output is).
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
    "info": "how the stage runs, for the record (message); not a warning",
    "step": "one optimizer step (step, loss, lr, samples_per_second, peak_vram_gb)",
    "checkpoint": "a resumable checkpoint was written (step, path)",
    "validation": "held-out loss with fixed noise per item (step, loss, items)",
    "stopped": "a stage stopped on request (Ctrl-C, SIGTERM, `lorapipe stop`): train after its step (step, saved), "
               "another stage keeping what it wrote",
    "done": "stage finished (seconds, plus stage summary fields)",
    "up_to_date": "stage skipped because its manifest matches (fingerprint)",
    "error": "stage failed (message, item when one input caused it)",
    "plan": "a stage's memory plan (budget, chosen settings, predicted peak; stages/core/memory/)",
    "sample": "a sample grid was rendered, base vs LoRA (path, prompts, seeds, adapter)",
    "profile": "runtime.profile_steps: where profiled steps' time went (path, ms_per_step, device, top)",
}

# The stable schema of events.jsonl: JSON type names per field (a list allows several). `ts`, `run`,
# `stage` and `event` are on every line. A field not listed here is a violation, except on `done`,
# which carries each stage's summary. tests/core/test_events_schema.py validates real runs against it and
# the events table of docs/configuration.md is printed from it (`describe_events`); change all three together.
COMMON_FIELDS: dict[str, Any] = {"ts": "number", "run": "string", "stage": "string", "event": "string"}
EVENT_SCHEMA: dict[str, dict[str, Any]] = {
    "start": {"required": {"pid": "integer"}, "optional": {"world_size": "integer"}},
    "loading": {"required": {"component": "string"}, "optional": {"precision": "string", "class": "string"}},
    "loaded": {"required": {"component": "string", "seconds": "number"}, "optional": {}},
    "preparing": {"required": {"done": "integer", "total": "integer", "encoded": "integer"}, "optional": {}},
    "skipped": {"required": {"item": "string", "reason": "string"}, "optional": {}},
    "warning": {"required": {"message": "string"}, "optional": {"item": ["string", "null"]}},
    "info": {"required": {"message": "string"}, "optional": {}},
    "step": {"required": {"step": "integer", "loss": "number", "lr": "number", "batch_size": "integer",
                          "samples_per_second": ["number", "null"], "peak_vram_gb": "number"},
             "optional": {"world_size": "integer", "expert": "string"}},
    "checkpoint": {"required": {"step": "integer", "path": "string"}, "optional": {}},
    "validation": {"required": {"step": "integer", "loss": "number", "items": "integer"}, "optional": {"expert": "string"}},
    "stopped": {"required": {"saved": "boolean"}, "optional": {"step": "integer", "checkpoint": "string", "rank": "integer",
                                                               "expert": "string"}},
    "done": {"required": {"seconds": "number"}, "extra": True,
             "optional": {"encoded": "integer", "total": "integer", "skipped": "integer", "step": "integer",
                          "loss_first": ["number", "null"], "loss_last": ["number", "null"], "files": "array",
                          "images": "integer", "unit": "string", "notes": "array"}},
    "up_to_date": {"required": {}, "optional": {"fingerprint": "string", "notes": "array", "expert": "string"}},
    "error": {"required": {"message": "string"},
              "optional": {"item": ["string", "null"], "type": "string", "rank": "integer"}},
    "plan": {"required": {"budget_gb": ["number", "null"], "budget_source": "string", "settings": "object",
                          "predicted_peak_gb": "number", "fits": "boolean"},
             "optional": {"note": "string", "allocator_gb": ["number", "null"], "context_gb": "number",
                          "predicted_total_gb": "number"}},
    "sample": {"required": {"path": "string", "prompts": "array", "seeds": "array", "adapter": "string"},
               "optional": {"seconds": "number", "edit_error": "object", "edit_closer_percent": "number"}},
    "profile": {"required": {"path": "string", "ms_per_step": "number", "device": "string", "top": "array"}, "optional": {}},
}
_JSON_TYPES: dict[str, Any] = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
                               "null": type(None), "array": list, "object": dict}


def _type_ok(value: Any, spec: str | list[str]) -> bool:
    names = [spec] if isinstance(spec, str) else spec
    if isinstance(value, bool):  # bool is an int in Python, not in JSON
        return "boolean" in names
    return any(isinstance(value, _JSON_TYPES[n]) for n in names)


def record_problems(name: str, spec: dict[str, Any], common: dict[str, Any], record: dict[str, Any],
                    schema_name: str) -> list[str]:
    """Every way `record` breaks `spec` ({"required", "optional", "extra"?} field -> JSON type) plus
    the `common` fields; shared by events (EVENT_SCHEMA) and manifests (schema.MANIFEST_SCHEMA)."""
    fields = {**common, **spec["required"]}
    problems = [f"{name}: missing field '{k}'" for k in fields if k not in record]
    allowed = {**fields, **spec["optional"]}
    for key, value in record.items():
        if key in allowed:
            if not _type_ok(value, allowed[key]):
                problems.append(f"{name}: field '{key}' = {str(value)[:60]!r} is not {allowed[key]}")
        elif not spec.get("extra"):
            problems.append(f"{name}: undocumented field '{key}' (add it to {schema_name})")
    return problems


def validate_event(record: dict[str, Any]) -> list[str]:
    """Every way one events.jsonl record breaks EVENT_SCHEMA (empty when it conforms)."""
    event = record.get("event")
    if event not in EVENT_SCHEMA:
        return [f"unknown event {event!r}"]
    return record_problems(event, EVENT_SCHEMA[event], COMMON_FIELDS, record, "EVENT_SCHEMA and docs/configuration.md")


def step_losses(events: list[dict[str, Any]], expert: str = "") -> list[float]:
    """The logged losses of the run's training history by step: each train attempt's steps replace
    those at and after its first one (a resume continues the curve, a restart replaces it). `expert`:
    only the steps of that expert's adapter (a two-expert run logs each one's steps with its name)."""
    by_step: dict[int, float] = {}
    fresh = True
    for e in events:
        if e.get("stage") != "train" or e["event"] not in ("start", "step"):
            continue
        if e["event"] == "step" and e.get("expert", "") != expert:
            continue
        if e["event"] == "start":
            fresh = True
            continue
        if fresh:
            by_step, fresh = {s: v for s, v in by_step.items() if s < e["step"]}, False
        by_step[e["step"]] = float(e["loss"])
    return [by_step[s] for s in sorted(by_step)]


def loss_ends(losses: list[float]) -> dict[str, float | None]:
    """Means of the first and the last tenth of `losses` (one loss at least): the "loss a -> b" of the
    train summary, the final manifest and `report`, all from the same logged steps."""
    k = max(1, len(losses) // 10)
    return {"loss_first": sum(losses[:k]) / k if losses else None,
            "loss_last": sum(losses[-k:]) / k if losses else None}


def describe_events() -> list[tuple[str, str, str]]:
    """(event, meaning, fields) rows for the events table of docs/configuration.md."""
    def fmt(fields: dict[str, Any], optional: bool) -> list[str]:
        return [f"{k}{'?' if optional else ''}: {' or '.join([t] if isinstance(t, str) else t)}" for k, t in fields.items()]

    rows = []
    for event, spec in EVENT_SCHEMA.items():
        fields = fmt(spec["required"], False) + fmt(spec["optional"], True) + (["...summary"] if spec.get("extra") else [])
        rows.append((event, EVENT_TYPES[event], ", ".join(fields)))
    return rows


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


class EventLog:
    """Appends events to <run_dir>/events.jsonl; warnings, skipped inputs and the stage's end are also
    shown on stderr as they happen (`terminal_line`)."""

    def __init__(self, run_dir: Path, run: str, stage: str, enabled: bool = True):
        self.run_dir, self.path = run_dir, run_dir / "events.jsonl"
        self.run, self.stage, self.enabled = run, stage, enabled
        self.warnings = 0  # warning and skipped events so far, for the end-of-stage summary
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
            self.warnings += event in ("warning", "skipped")
            shown = terminal_line(record, self.warnings, self.run_dir)
            if shown is not None:
                from rich.text import Text

                stderr_console().print(Text(*shown))
        return record


_STYLES = {"info": "dim", "warning": "yellow", "skipped": "yellow", "done": "green", "error": "red", "stopped": "yellow"}


def terminal_line(record: dict[str, Any], warnings: int, run_dir: Path) -> tuple[str, str] | None:
    """(text, rich style) of what stderr shows for an event, or None: warnings and skipped inputs as
    they happen; at the end, a summary built from the `done` event's fields (or the failure; its
    message is the CLI's one error line)."""
    event, stage = record["event"], record["stage"]
    if event == "warning":
        text = f"warning: {record['message']}"
    elif event == "info":
        text = f"note: {record['message']}"
    elif event == "skipped":
        text = f"skipped '{record['item']}': {record['reason']}"
    elif event == "done":
        text = f"{stage} done in {record['seconds']:.1f} s: " + "; ".join(_summary_parts(record, warnings, run_dir))
    elif event == "error" and _is_user_error(record.get("type")):
        return None  # the CLI's one `error:` line says it all
    elif event == "error":
        text = f"{stage} failed ({_count(warnings, 'warning')} before it; events in {run_dir / 'events.jsonl'})"
    elif event == "up_to_date" and record.get("notes"):  # a check asked of an up-to-date stage: its result
        text = f"{stage} up to date: " + "; ".join(record["notes"])
    elif event == "stopped" and "step" not in record:  # train says where it stopped itself
        text = f"{stage} stopped on request; what it wrote is kept ({_count(warnings, 'warning')} before it)"
    else:
        return None
    return text, _STYLES.get(event, "green")


def _is_user_error(name: str | None) -> bool:
    """Whether an error event's `type` is a UserError (the user's to fix), whose message the CLI prints."""
    from stages.core.errors import UserError

    def subclasses(cls: type) -> set[str]:
        return {cls.__name__}.union(*(subclasses(c) for c in cls.__subclasses__()))

    return name is not None and name in subclasses(UserError)


def _summary_parts(done: dict[str, Any], warnings: int, run_dir: Path) -> list[str]:
    parts, unit = [], done.get("unit", "images")  # what `images` and the encode pace count: images, clips or items
    if "total" in done:
        gpu = f", GPU busy {done['gpu_busy']:.0%}" if isinstance(done.get("gpu_busy"), float) else ""
        pace = (f" ({done['images_per_second']:.3g} {unit}/s, encoder busy {done['encoder_busy']:.0%}{gpu})"
                if isinstance(done.get("images_per_second"), float) and isinstance(done.get("encoder_busy"), float) else "")
        parts.append(f"{done.get('encoded', 0)} of {done['total']} encoded this run{pace}")
    if done.get("skipped"):
        parts.append(f"{_count(done['skipped'], 'input')} skipped")
    if "step" in done:
        loss = (f", loss {done['loss_first']:.4g} -> {done['loss_last']:.4g}"
                if isinstance(done.get("loss_first"), float) and isinstance(done.get("loss_last"), float) else "")
        whose = f"{done['expert']} expert: " if "expert" in done else ""
        parts.append(f"{whose}step {done['step']}{loss}")
    if "images" in done:
        parts.append(_count(done["images"], unit.removesuffix("s")))
    if isinstance(done.get("edit_closer_percent"), (int, float)):
        parts.append(f"LoRA output {done['edit_closer_percent']:+.1f}% closer to the edit targets than the base's")
    if gpu := _gpu_part(done):
        parts.append(gpu)
    parts.append(_count(warnings, "warning") + (" (above, and in events.jsonl)" if warnings else ""))
    files = done.get("files") or []
    parts.append(f"output: {', '.join(map(str, files))}" if files else f"output in {run_dir}")
    return parts + list(done.get("notes") or [])


def _gpu_part(done: dict[str, Any]) -> str | None:
    """On a GPU: the stage's reserved peak and the process's total with its CUDA context (what a --vram number
    counts, as nvidia-smi does) and, for train, how the denoiser ran:
    blocks swapped, and under CUDA graphs or eager and why (under block swap eager can be several
    times slower: docs/memory-and-speed.md). None on CPU."""
    peak = (done.get("peak_vram_gb") or {}).get("reserved")
    if not (str(done.get("device", "")).startswith("cuda") or (isinstance(peak, (int, float)) and peak > 0)):
        return None
    bits = [f"peak {peak:.2f} GB reserved"] if isinstance(peak, (int, float)) else []
    total = (done.get("peak_vram_gb") or {}).get("total")
    if bits and isinstance(total, (int, float)):
        bits[0] += f" ({total:.2f} GB with the CUDA context)"
    runtime = done.get("runtime") or {}
    swap = runtime.get("block_swap") or {}
    if swap.get("swapped_blocks"):
        bits.append(f"{swap['swapped_blocks']} of {runtime.get('blocks', '?')} blocks swapped")
    graphs = runtime.get("cuda_graphs")
    if graphs is not None:
        bits.append({"graphs": "CUDA graphs", "failed": "eager: the CUDA graph capture failed",
                     "released": "CUDA graphs, then eager: released for a new batch shape under the budget",
                     "no room": "eager: no room to capture CUDA graphs", "eager": "eager"}[graphs_ran(graphs)])
    return ", ".join(bits) or None


def graphs_ran(graphs: dict[str, Any]) -> str:
    """How train's denoiser ran, from its summary's `runtime.cuda_graphs` (fastpath.GraphedDenoiser's
    summary and plan): "graphs" (a shape captured), "failed" (a capture failed: eager), "released" (graphs
    captured, then released for a new shape's eager step under the budget), "no room" (no room to capture
    under block swap: eager) or "eager"."""
    return ("graphs" if graphs.get("graphs") else "failed" if graphs.get("failed")
            else "released" if str(graphs.get("stopped", "")).startswith("released")
            else "no room" if graphs.get("no_room") else "eager")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


_CONSOLE: Any = None


def stderr_console() -> Any:
    """The one rich console on stderr: progress bars draw on it, and event lines printed through it
    appear above a live bar. Never wraps (log files keep one event per line)."""
    global _CONSOLE
    if _CONSOLE is None:
        from rich.console import Console

        _CONSOLE = Console(stderr=True, highlight=False, soft_wrap=True)
    return _CONSOLE


def table_console() -> Any:
    """A rich console on stdout for the tables commands print (`plan`, `inspect`): the terminal's width, or 160
    columns where the output is piped, so that a table's columns are not cut at rich's default 80."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


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
                                     TextColumn("{task.fields[info]}"), transient=False, console=stderr_console())
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
