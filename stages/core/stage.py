"""What every stage shares: the lock, start/done/error events, and fingerprint comparison.

A stage module declares NAME, `artifact_dir(cfg)`, `fingerprint_parts(cfg)` (cheap: no model
weights) and `run(cfg) -> manifest`. The manifest stores the parts it was built from, so `status`
and `run` can say exactly why a stage is stale (DVC's habit: staleness from content hashes computed
before the stage runs).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from stages.core.artifacts import fingerprint, read_manifest, stage_lock
from stages.core.events import EventLog


class UserError(RuntimeError):
    """Raised for problems the user can fix; pipeline.py prints the message without a traceback."""


@dataclass
class StageContext:
    cfg: Any
    stage: str
    log: EventLog
    t0: float = field(default_factory=time.time)

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    def elapsed(self) -> float:
        return round(time.time() - self.t0, 3)


@contextlib.contextmanager
def running_stage(cfg: Any, stage: str) -> Iterator[StageContext]:
    """Hold the stage lock and log start / error for the body."""
    with stage_lock(cfg.run_dir, stage):
        ctx = StageContext(cfg, stage, EventLog(cfg.run_dir, cfg.run, stage))
        ctx.log.emit("start", pid=os.getpid())
        try:
            yield ctx
        except KeyboardInterrupt:
            ctx.log.emit("error", message="interrupted")
            raise
        except Exception as e:
            ctx.log.emit("error", message=str(e), item=getattr(e, "item", None), type=type(e).__name__)
            raise


def describe_change(key: str, old: Any, new: Any) -> str:
    if isinstance(old, list) and isinstance(new, list):
        added, removed = len(set(new) - set(old)), len(set(old) - set(new))
        return f"{key}: {added} new, {removed} removed"
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return "; ".join(f"{key}.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)
    return f"{key}: {old!r} -> {new!r}"


def staleness(stage_module: Any, cfg: Any) -> tuple[bool, list[str]]:
    """(up_to_date, reasons) for one stage, from its manifest and its current fingerprint parts."""
    manifest = read_manifest(stage_module.artifact_dir(cfg))
    if manifest is None:
        return False, ["never built (no manifest)"]
    if not manifest.get("complete", True):
        return False, [manifest.get("incomplete_reason", "incomplete")]
    parts = stage_module.fingerprint_parts(cfg)
    if manifest.get("fingerprint") == fingerprint(parts):
        return True, []
    old = manifest.get("fingerprint_parts", {})
    reasons = [describe_change(k, old.get(k), parts.get(k)) for k in sorted(set(old) | set(parts)) if old.get(k) != parts.get(k)]
    return False, reasons or ["fingerprint changed"]
