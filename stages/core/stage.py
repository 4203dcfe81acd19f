"""What every stage shares: the lock, start/done/error events, and fingerprint comparison.

A stage is declared in stages/registry.py: its `artifact_dir(cfg)`, `fingerprint_parts(cfg)` (cheap:
no model weights), `run(cfg) -> manifest` and optional hooks. The manifest stores the parts it was
built from, so `status` and `run` can say exactly why a stage is stale (DVC's habit: staleness from
content hashes computed before the stage runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Sequence

from stages.core.artifacts import (disk_full, fingerprint, lock_holder_pid, manifest_damage, manifest_path, read_manifest,
                                   repair_advice, stage_lock)
from stages.core.errors import StageLocked, UserError  # noqa: F401 - UserError is imported from here too
from stages.core.events import EventLog

def refuse_beside(cfg: Any, stage: str, beside: Sequence[tuple[str, str]]) -> None:
    """StageLocked when a stage of `beside` ((stage, why), stages.registry.conflicts: those that read
    what `stage` writes, or write what it reads) is running (its lock is held): naming it, its pid and
    how to stop it."""
    from stages.core.config import command

    for other, why in beside:
        pid = lock_holder_pid(cfg.run_dir, other)
        if pid is None:
            continue
        raise StageLocked(f"stage '{other}' of run '{cfg.run}' is running (pid {pid}) and {why}: wait for it to "
                          f"finish, or stop it with `{command(cfg, 'stop')}`")


@dataclass
class StageContext:
    cfg: Any
    stage: str
    log: EventLog
    t0: float = field(default_factory=time.time)
    dist: Any = None  # stages.core.distributed.Dist: this process's rank in a torchrun job

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    def elapsed(self) -> float:
        return round(time.time() - self.t0, 3)


@contextlib.contextmanager
def running_stage(cfg: Any, stage: str, rerun: tuple[str, ...] = (), own_signals: bool = False,
                  beside: Sequence[tuple[str, str]] = ()) -> Iterator[StageContext]:
    """Join the torchrun job if any, hold the stage lock and log start / error for the body. The stages
    of `beside` (stages.registry.conflicts) may not be running.

    Under torchrun only rank 0 takes the lock and writes events; the others wait at a barrier until
    it holds the lock (if it cannot, it exits and torchrun stops them). On success all ranks leave
    together, after rank 0 has written its outputs."""
    from stages.core import distributed
    from stages.core.memory import allocator_for_cap
    from stages.core.runspec import working_on

    working_on(cfg.run_dir)
    if cfg.device != "cpu":  # before anything starts CUDA (the process group's device, the plan's free memory)
        allocator_for_cap(cfg.gpu.vram_budget_gb)
    with distributed.process_group(cfg.device) as dist:
        with stage_lock(cfg.run_dir, stage) if dist.is_main else contextlib.nullcontext():
            if dist.is_main:  # both stages hold their own lock before they look: one of two racing ones refuses
                refuse_beside(cfg, stage, beside)
            distributed.barrier(dist)
            with _logged(cfg, stage, dist, rerun) as ctx, _sigterm_interrupts(not own_signals):
                yield ctx
                distributed.barrier(dist)


@contextlib.contextmanager
def _sigterm_interrupts(active: bool) -> Iterator[None]:
    """SIGTERM (`lorapipe stop`, a supervisor) stops the stage as Ctrl-C does, by KeyboardInterrupt: every
    block unwinds (the progress display gives the cursor back), a `stopped` event is logged and the rows
    written are kept. (train reads its signals between steps itself: `own_signals`.)"""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _logged(cfg: Any, stage: str, dist: Any, rerun: tuple[str, ...]) -> Iterator[StageContext]:
    """Start / error events around the stage; `rerun`: the flags of the command that continues it."""
    from stages.core.config import command

    ctx = StageContext(cfg, stage, EventLog(cfg.run_dir, cfg.run, stage, enabled=dist.is_main), dist=dist)
    ctx.log.emit("start", pid=os.getpid(), world_size=dist.world_size)
    # Errors are logged by whichever rank meets them (an unreadable image may be in rank 1's share).
    errors = ctx.log if dist.is_main else EventLog(cfg.run_dir, cfg.run, stage)
    rank = {"rank": dist.rank} if dist.is_distributed else {}
    try:
        yield ctx
    except KeyboardInterrupt:
        errors.emit("stopped", saved=True, **rank)
        raise
    except Exception as e:
        from stages.core.memory import translate_oom  # a CUDA OOM becomes a ResourceError (exit 2)
        from stages.core.runtime import translate_cudnn_crash  # so does a crash under the cuDNN attention opt-in

        full = (translate_oom(e, cfg, stage) or translate_cudnn_crash(e, cfg, stage)
                or disk_full(e, cfg.run_dir, f" ({stage})", command(cfg, stage, *rerun)))  # a bare ENOSPC gets named
        err = full or e
        errors.emit("error", message=str(err), item=getattr(e, "item", None), type=type(err).__name__, **rank)
        if full is not None:
            raise full from e
        raise


def describe_change(key: str, old: Any, new: Any) -> str:
    if isinstance(old, list) and isinstance(new, list) and all(isinstance(v, dict) for v in old + new):
        # per-entry settings (cache-latents' `datasets`): name each entry's changed keys
        changes = [describe_change(f"{key}[{i}]", a, b) for i, (a, b) in enumerate(zip(old, new)) if a != b]
        return "; ".join(changes + ([f"{key}: {len(old)} -> {len(new)} entries"] if len(old) != len(new) else []))
    if isinstance(old, list) and isinstance(new, list):
        as_set = lambda values: {json.dumps(v, sort_keys=True, default=str) for v in values}  # noqa: E731
        added, removed = len(as_set(new) - as_set(old)), len(as_set(old) - as_set(new))
        return f"{key}: {added} new, {removed} removed"
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return "; ".join(f"{key}.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)
    if any(isinstance(v, str) and len(v) == 16 and set(v) <= set("0123456789abcdef") for v in (old, new)):
        # another artifact's fingerprint: its hash says nothing to a user
        return f"{key} {'was rebuilt since' if old and new else 'was built since' if new else 'is missing'}"
    return f"{key}: {old!r} -> {new!r}"


def model_change(model: str, old: Any, new: Any) -> str:
    """The `model` fingerprint part changed (`ModelSource.identity`: a content hash of a local folder or file, or a
    hub id and revision) as a user reads it: a hub reference by name, a local path that is gone, or changed files."""
    if isinstance(old, str) and isinstance(new, str) and old.startswith("hub:") and new.startswith("hub:"):
        return f"model: {old[4:]} -> {new[4:]}"
    if isinstance(new, str) and not new.startswith("hub:") and model and not Path(model).expanduser().exists():
        return f"model: '{model}' does not exist"
    return f"model: the files of '{model}' are not the ones it was built from"


def changed_items(before: dict[str, str], now: dict[str, str], what: str) -> str:
    """What changed among a stage's inputs, by file (item key -> content id, as built and as now):
    'image of cat.png changed; 1 new image (dog.png); 1 removed (owl.png)'."""
    from stages.core.errors import listing

    changed = sorted(k for k in now if k in before and before[k] != now[k])
    new = sorted(k for k in now if k not in before)
    gone = sorted(k for k in before if k not in now)
    parts = [f"{what} of {listing(changed)} changed"] if changed else []
    parts += [f"{len(new)} new {what}{'s' if len(new) > 1 else ''} ({listing(new)})"] if new else []
    parts += [f"{len(gone)} removed ({listing(gone)})"] if gone else []
    return "; ".join(parts) or f"{what}s changed"


def staleness(stage: Any, cfg: Any) -> tuple[bool, list[str]]:
    """(up_to_date, reasons) for one stage (a stages.registry.Stage), from its manifest and its current
    fingerprint parts."""
    found = freshness(stage, cfg)
    return found.ok, found.reasons


def freshness(stage: Any, cfg: Any) -> Freshness:
    """`staleness`, and the manifest's message when the artifact is stale only because the free memory
    forced its settings (no other plan fitted) and no row is damaged: a later stage may use it with
    that warning, while `staleness` still counts it stale, so `run` retries it. A stage with several
    artifacts (one per expert: `stage.units`) is up to date when each is; its reasons name the expert."""
    units = stage.units(cfg)
    if len(units) == 1:
        return _freshness(stage, units[0])
    found = [(unit.train.expert, _freshness(stage, unit)) for unit in units]
    reasons = [f"expert {expert}: {reason}" for expert, f in found if not f.ok for reason in f.reasons]
    forced = [f.forced for _, f in found if not f.ok]
    return Freshness(all(f.ok for _, f in found), reasons, "; ".join(forced) if forced and all(forced) else None,
                     same=all(f.same for _, f in found))


class Freshness(NamedTuple):
    ok: bool
    reasons: list[str]
    forced: str | None
    """The manifest's message when only the free memory forced its settings (`freshness`)."""
    same: bool = False
    """The artifact's fingerprint is the config's: a rerun only repairs or completes it (damaged rows, a format's
    file), so what later stages read keeps its fingerprint and they stay up to date."""


def _freshness(stage: Any, cfg: Any) -> Freshness:
    folder = stage.artifact_dir(cfg)
    damage = manifest_damage(folder)
    if damage is not None:  # read_manifest would warn: the reason says it all
        where = manifest_path(folder).relative_to(cfg.run_dir) if folder.is_relative_to(cfg.run_dir) else manifest_path(folder)
        return Freshness(False, [f"damaged: {where} cannot be read ({damage}); {repair_advice(folder)}"], None)
    manifest = read_manifest(folder)
    partial = stage.partial_state(cfg) if manifest is None else None
    if partial:
        return Freshness(False, [partial], None)
    if manifest is None and folder.exists():
        return Freshness(False, [f"incomplete: '{folder}' has no manifest (its last run was interrupted or failed); "
                       f"rerun it to finish (caches continue where they stopped; train continues with --resume)"], None)
    if manifest is None:
        return Freshness(False, ["never built: no manifest yet"], None)
    parts = stage.fingerprint_parts(cfg)
    if not manifest.get("complete", True):
        changed = manifest.get("fingerprint") != fingerprint(parts) and stage.other_settings(cfg)
        return Freshness(False, [changed or manifest.get("incomplete_reason", "incomplete")], None)
    if manifest.get("fingerprint") == fingerprint(parts):
        damaged = stage.damaged_rows(cfg, manifest) + stage.lacks(cfg, manifest)
        return Freshness(not damaged, damaged, None, same=True)
    if forced_only(manifest, parts):
        message = manifest["memory_forced"]["message"]
        return Freshness(False, [message], None if stage.damaged_rows(cfg, manifest) else message)
    old = manifest.get("fingerprint_parts", {})
    reasons = [model_change(cfg.model, old.get(k), parts.get(k)) if k == "model" else  # a hash, said as the path
               stage.describe_change(cfg, manifest, k, old.get(k), parts.get(k)) for k in sorted(set(old) | set(parts))
               if old.get(k) != parts.get(k)]
    return Freshness(False, reasons or ["fingerprint changed"], None)


def forced_only(manifest: dict[str, Any], parts: dict[str, Any]) -> bool:
    """Whether the artifact differs from what `parts` (the config's) asks only by the settings the
    free GPU memory forced on the run that wrote it (its manifest's `memory_forced`)."""
    forced = manifest.get("memory_forced")
    return bool(forced) and manifest.get("fingerprint") == fingerprint({**parts, **forced["parts"]})
