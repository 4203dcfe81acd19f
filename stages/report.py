"""Training report: loss (raw and smoothed, and the held-out validation loss), learning rate and
samples/s over steps, from events.jsonl.

    lorapipe report demo                      # -> artifacts/demo/report.png + a summary
    lorapipe report demo --out loss.png --smooth 0.95 --json

Reads only artifacts/<run>/events.jsonl (no torch, no model): works while training runs, or on a
copy of the file from another machine. Drawn with PIL, so it needs no plotting library.

A run's events keep every attempt of `train`. The curve is rebuilt the way the checkpoints were:
each attempt's steps replace those at and after its first step, so a resume from checkpoint-40
continues the curve at 41 and a fresh restart replaces it. A two-expert run (Wan 2.2 A14B) logs each
expert's steps with its name: each expert has its own curve (`experts_in`, report-<expert>.png).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.core.events import loss_ends, read_events
from stages.core.runspec import command_for

WIDTH, PANEL_H, MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 960, 230, 78, 24, 34, 30
RAW, SMOOTH, LR, SPEED, GRID, TEXT = "#9ecae1", "#08519c", "#d94801", "#238b45", "#e5e5e5", "#333333"
VALIDATION = "#cb181d"


@dataclass
class Curve:
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    speed: list[float | None] = field(default_factory=list)
    vram: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)  # `validation` events: held-out loss
    val_loss: list[float] = field(default_factory=list)


def experts_in(events: list[dict[str, Any]]) -> list[str]:
    """The experts whose steps the run's events hold, in the order they trained ([""]: one adapter)."""
    found = dict.fromkeys(e.get("expert", "") for e in events if e.get("stage") == "train" and e["event"] == "step")
    return list(found) or [""]


def train_curve(events: list[dict[str, Any]], expert: str = "") -> Curve:
    """The step events of the run's history (of `expert`'s adapter) as the final adapter saw it (see module
    docstring)."""
    by_step: dict[int, dict[str, Any]] = {}
    val: dict[int, float] = {}
    attempt_start = True
    for e in events:
        if e.get("stage") != "train" or e["event"] in ("step", "validation", "done") and e.get("expert", "") != expert:
            continue
        if e["event"] == "start":
            attempt_start = True
        elif e["event"] == "step":
            if attempt_start:  # this attempt rewrites history from its first step on
                by_step = {s: r for s, r in by_step.items() if s < e["step"]}
                val = {s: v for s, v in val.items() if s < e["step"]}
                attempt_start = False
            by_step[e["step"]] = e
        elif e["event"] == "validation":
            val[e["step"]] = float(e["loss"])
    curve = Curve(val_steps=sorted(val), val_loss=[val[s] for s in sorted(val)])
    for s in sorted(by_step):
        r = by_step[s]
        curve.steps.append(s)
        curve.loss.append(float(r["loss"]))
        curve.lr.append(float(r["lr"]))
        curve.speed.append(r.get("samples_per_second"))
        curve.vram.append(float(r.get("peak_vram_gb") or 0.0))
    return curve


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with bias correction (TensorBoard's), so early points are not
    dragged toward zero."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i) if weight > 0 else v)
    return out


def smooth(values: list[float], weight: float) -> list[float]:
    """Two-sided EMA (the mean of a forward and a backward pass): as smooth as TensorBoard's, without
    its lag, which on a short run draws the smoothed loss above every raw point."""
    forward, backward = ema(values, weight), ema(values[::-1], weight)[::-1]
    return [(a + b) / 2 for a, b in zip(forward, backward)]


def current_history(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events since the last train attempt that started at step 1 (older attempts were replaced)."""
    begin, attempt = 0, None
    for i, e in enumerate(events):
        if e.get("stage") == "train" and e["event"] == "start":
            attempt = i
        elif e.get("stage") == "train" and e["event"] == "step" and attempt is not None:
            if e["step"] == 1:
                begin = attempt
            attempt = None
    return events[begin:]


def summary(events: list[dict[str, Any]], curve: Curve, weight: float, expert: str = "") -> dict[str, Any]:
    """Numbers for the printed summary and --json (counts cover the current history only)."""
    events = [e for e in current_history(events) if e.get("expert", "") == expert or e["event"] not in ("step", "done")]
    n = len(curve.steps)
    sm = smooth(curve.loss, weight)
    best = min(range(n), key=sm.__getitem__) if n else None
    speeds = [s for s in curve.speed if s is not None]
    done = [e for e in events if e.get("stage") == "train" and e["event"] == "done"]
    return {
        "steps": n, "last_step": curve.steps[-1] if n else None,
        **loss_ends(curve.loss),
        "loss_smoothed_min": sm[best] if best is not None else None,
        "loss_smoothed_min_step": curve.steps[best] if best is not None else None,
        "lr_max": max(curve.lr) if n else None, "lr_last": curve.lr[-1] if n else None,
        "samples_per_second_median": statistics.median(speeds) if speeds else None,
        "peak_vram_gb": max(curve.vram) if n else None,
        "validation_loss_last": curve.val_loss[-1] if curve.val_loss else None,
        "validation_loss_min": min(curve.val_loss) if curve.val_loss else None,
        "validation_loss_min_step": curve.val_steps[curve.val_loss.index(min(curve.val_loss))] if curve.val_loss else None,
        "train_seconds": done[-1].get("seconds") if done else None,
        "batch_sizes": done[-1].get("batch_sizes") if done else None,  # {size: steps}, from the train stage
        "checkpoints": sum(1 for e in events if e.get("stage") == "train" and e["event"] == "checkpoint"),
        "stops": sum(1 for e in events if e["event"] == "stopped"),
        "errors": [e.get("message") for e in events if e["event"] == "error"],
    }


# ---- drawing ---------------------------------------------------------------------------------


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 x 10^k apart) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0) * 0.1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float) -> str:
    return "0" if abs(v) < 1e-12 else f"{v:.4g}"


class Panel:
    """One chart: a frame, round ticks and labels, and polylines mapped into its box."""

    def __init__(self, draw: Any, font: Any, top: int, title: str, x_range: tuple[float, float],
                 y_values: list[float]):
        self.draw, self.font = draw, font
        self.box = (MARGIN_L, top + MARGIN_T, WIDTH - MARGIN_R, top + PANEL_H - MARGIN_B)
        lo, hi = (min(y_values), max(y_values)) if y_values else (0.0, 1.0)
        pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
        self.y_ticks = nice_ticks(lo - pad, hi + pad)
        self.y_range = (min(self.y_ticks[0], lo - pad), max(self.y_ticks[-1], hi + pad))
        self.x_range = x_range if x_range[1] > x_range[0] else (x_range[0], x_range[0] + 1)
        draw.text((MARGIN_L, top + 8), title, fill=TEXT, font=font)
        self._axes()

    def xy(self, x: float, y: float) -> tuple[float, float]:
        (x0, y0, x1, y1), (a, b), (lo, hi) = self.box, self.x_range, self.y_range
        return x0 + (x - a) / (b - a) * (x1 - x0), y1 - (y - lo) / (hi - lo) * (y1 - y0)

    def _axes(self) -> None:
        x0, y0, x1, y1 = self.box
        for t in self.y_ticks:
            _, y = self.xy(self.x_range[0], t)
            self.draw.line([(x0, y), (x1, y)], fill=GRID)
            self.draw.text((x0 - 6, y), _label(t), fill=TEXT, font=self.font, anchor="rm")
        for t in nice_ticks(*self.x_range, n=8):
            x, _ = self.xy(t, self.y_range[0])
            self.draw.line([(x, y0), (x, y1)], fill=GRID)
            self.draw.text((x, y1 + 4), f"{t:g}", fill=TEXT, font=self.font, anchor="mt")
        self.draw.rectangle(self.box, outline="#999999")

    def line(self, xs: list[int], ys: list[float | None], color: str, width: int = 2) -> None:
        """A polyline; None values break it (e.g. samples/s before the warmup steps are excluded)."""
        run: list[tuple[float, float]] = []
        for x, y in list(zip(xs, ys)) + [(None, None)]:
            if y is None or x is None:
                if len(run) > 1:
                    self.draw.line(run, fill=color, width=width, joint="curve")
                elif len(run) == 1:
                    cx, cy = run[0]
                    self.draw.ellipse([cx - 2, cy - 2, cx + 2, cy + 2], fill=color)
                run = []
            else:
                run.append(self.xy(x, y))

    def legend(self, items: list[tuple[str, str]]) -> None:
        x, y = self.box[2] - 10, self.box[1] - 22
        for text, color in reversed(items):
            w = self.draw.textlength(text, font=self.font)
            self.draw.text((x - w, y), text, fill=color, font=self.font)
            x -= w + 18


def draw_report(curve: Curve, weight: float, title: str, out: Path) -> Path:
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=13)
    image = Image.new("RGB", (WIDTH, 3 * PANEL_H + 50), "white")
    draw = ImageDraw.Draw(image)
    draw.text((WIDTH // 2, 8), title, fill=TEXT, font=ImageFont.load_default(size=15), anchor="mt")
    xs, x_range = curve.steps, (min(curve.steps), max(curve.steps))
    sm = smooth(curve.loss, weight)
    loss = Panel(draw, font, 30, "loss", x_range, curve.loss + curve.val_loss)
    loss.line(xs, curve.loss, RAW, 1)
    loss.line(xs, sm, SMOOTH, 3)
    legend = [("raw", RAW), (f"smoothed (two-sided EMA {weight:g})", SMOOTH)]
    if curve.val_loss:
        loss.line(curve.val_steps, curve.val_loss, VALIDATION, 2)
        for x, y in zip(curve.val_steps, curve.val_loss):
            cx, cy = loss.xy(x, y)
            draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=VALIDATION)
        legend.append(("validation (held out)", VALIDATION))
    loss.legend(legend)
    Panel(draw, font, 30 + PANEL_H, "learning rate", x_range, curve.lr).line(xs, curve.lr, LR)
    speeds = [s for s in curve.speed if s is not None]
    speed = Panel(draw, font, 30 + 2 * PANEL_H, "samples/s (steady state)", x_range, speeds)
    speed.line(xs, curve.speed, SPEED)
    draw.text((WIDTH // 2, image.height - 6), "step", fill=TEXT, font=font, anchor="mb")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    image.save(tmp, optimize=True)
    tmp.replace(out)
    return out


def run(run_dir: Path, out: Path | None = None, weight: float = 0.9, expert: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Draw the report PNG for one run folder, of `expert`'s adapter (`experts_in`; default: the first whose
    steps the events hold); returns (png path, summary)."""
    from stages.core.errors import UserError

    events = read_events(run_dir)
    if not events:
        raise UserError(f"'{run_dir / 'events.jsonl'}' is missing or empty: run a stage of run '{run_dir.name}' first")
    expert = experts_in(events)[0] if expert is None else expert
    curve = train_curve(events, expert)
    if not curve.steps:
        raise UserError(f"run '{run_dir.name}' has no training steps in its events.jsonl yet: "
                        f"run `{command_for(run_dir, 'train')}` first")
    if not 0 <= weight < 1:
        raise UserError(f"--smooth must be in [0, 1), got {weight}")
    title = f"run '{run_dir.name}'{f', {expert} expert' if expert else ''}: {len(curve.steps)} steps"
    png = draw_report(curve, weight, title, out or run_dir / "report.png")
    return png, summary(events, curve, weight, expert)


def format_summary(s: dict[str, Any]) -> list[str]:
    def f(v: Any, spec: str = ".4g") -> str:
        return "-" if v is None else format(v, spec)

    lines = [f"steps            {s['steps']} (last {s['last_step']})",
             f"loss             {f(s['loss_first'])} -> {f(s['loss_last'])} (first/last 10% mean); smoothed min "
             f"{f(s['loss_smoothed_min'])} at step {s['loss_smoothed_min_step']}",
             f"learning rate    max {f(s['lr_max'], '.3g')}, last {f(s['lr_last'], '.3g')}",
             f"samples/s        {f(s['samples_per_second_median'], '.3g')} (median, steady state)",
             f"peak VRAM        {f(s['peak_vram_gb'], '.3g')} GB;  train time {f(s['train_seconds'], '.1f')} s",
             f"batch sizes      {batch_histogram(s.get('batch_sizes'))}",
             f"checkpoints      {s['checkpoints']} written; {s['stops']} stop(s); {len(s['errors'])} error(s)"]
    if s.get("validation_loss_last") is not None:  # runs without held-out items print no line
        lines.insert(2, f"validation loss  {validation_line(s)}")
    lines += [f"  error: {m}" for m in s["errors"][-3:]]
    return lines


def validation_line(s: dict[str, Any]) -> str:
    return (f"{s['validation_loss_last']:.4g} last; min {s['validation_loss_min']:.4g} at step "
            f"{s['validation_loss_min_step']} (held-out items, fixed noise)")


def last_validation(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest `validation` event of the run (for `status`)."""
    found = [e for e in events if e.get("stage") == "train" and e.get("event") == "validation"]
    return found[-1] if found else None


def batch_histogram(sizes: dict[str, int] | None) -> str:
    """{"4": 10, "1": 2} -> "4 x 10 steps, 1 x 2 steps" (largest first); "-" before a finished train."""
    if not sizes:
        return "-"
    return ", ".join(f"{size} x {steps} step{'s' * (steps != 1)}"
                     for size, steps in sorted(sizes.items(), key=lambda kv: -int(kv[0])))
