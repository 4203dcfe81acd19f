"""`runtime.profile_steps`: where a training step's time goes, measured by torch.profiler.

The profiler runs over `steps` consecutive steps after the warm-up (`runtime.warmup_steps_excluded`,
so compile and CUDA-graph capture are not in it) and writes `profile.json` beside the LoRA: on
CUDA the GPU kernels summed by name, longest first, each with its milliseconds per step and share
of the profiled GPU time, plus host-to-device copies (block swap) counted apart; on CPU the
operators' own CPU time. bench/dtype_probe.py reads a step the same way.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

TOP = 40


def kernel_table(prof: Any, steps: int, cuda: bool, top: int = TOP) -> dict[str, Any]:
    """A finished profile's kernels (CUDA) or operators (CPU), summed by name, per step."""
    from torch.autograd import DeviceType

    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    # on CUDA the kernels alone: a CPU operator (aten::mm, a graph replay) also carries its kernels' time
    events = [e for e in prof.key_averages() if own(e) > 0 and (not cuda or e.device_type == DeviceType.CUDA)]
    total = sum(own(e) for e in events) or 1.0
    events.sort(key=own, reverse=True)
    h2d = sum(own(e) for e in events if "HtoD" in e.key)
    return {"device": "cuda" if cuda else "cpu", "steps": steps, "ms_per_step": round(total / 1000 / steps, 2),
            "host_to_device_ms_per_step": round(h2d / 1000 / steps, 2),
            "top": [{"name": e.key[:200], "ms": round(own(e) / 1000 / steps, 3), "calls": e.count // steps,
                     "pct": round(100 * own(e) / total, 1)} for e in events[:top]]}


@contextlib.contextmanager
def profiled(steps: int, cuda: bool) -> Iterator[Callable[[], dict[str, Any]]]:
    """Profile the block; the yielded function returns its table once the block has ended."""
    from torch.profiler import ProfilerActivity, profile

    result: dict[str, Any] = {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield lambda: result
        if cuda:
            torch.cuda.synchronize()
    result.update(kernel_table(prof, steps, cuda))


class StepProfiler:
    """Starts before step `first` + 1, stops after `steps` steps and writes `path` (JSON, atomically)."""

    def __init__(self, first: int, steps: int, path: Path, cuda: bool, enabled: bool = True) -> None:
        self.first, self.steps, self.path, self.cuda = first, steps, path, cuda
        self.enabled = enabled and steps > 0
        self._ctx: Any = None
        self.table: dict[str, Any] | None = None

    def before(self, done: int) -> None:
        if self.enabled and done == self.first and self._ctx is None and self.table is None:
            self._ctx = profiled(self.steps, self.cuda)
            self._get = self._ctx.__enter__()

    def close(self) -> None:
        """Stop an unfinished profile (the run stopped or failed inside it); nothing is written."""
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    def after(self, done: int) -> dict[str, Any] | None:
        """The table once the profiled steps are done (and written to `path`), else None."""
        if self._ctx is None or done < self.first + self.steps:
            return None
        self._ctx.__exit__(None, None, None)
        self._ctx, self.table = None, self._get()
        from stages.core.artifacts import atomic_write_json

        atomic_write_json(self.path, self.table)
        return self.table
