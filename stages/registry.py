"""The stages of a run, each declared once: what it reads and writes, and how to call it.

    from stages import registry
    registry.get("train").fingerprint_parts(cfg)

The CLI's stage commands, `run`'s order and skipping, `status`, `stop`, `inspect`, `plan`, train's
check of its caches, the locks' conflicts and the Makefile's dependencies (tests/e2e/test_cli.py holds
it) all read this table. A stage module is imported only when one of its callables is called, so
`import pipeline` stays torch-free; a stage never imports another stage (tests/core/test_import_contract.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from stages.core import caches


def _lazy(module: str, attr: str) -> Callable[..., Any]:
    """`module.attr`, imported on its first call."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    call.__qualname__ = call.__name__ = f"{module}.{attr}"
    return call


def _plain_change(cfg: Any, manifest: dict[str, Any], key: str, old: Any, new: Any) -> str:
    from stages.core.stage import describe_change

    return describe_change(key, old, new)


@dataclass(frozen=True)
class Stage:
    name: str
    """The command, and the stage's name in events, locks and manifests."""
    module: str
    """The module with its `run`, `fingerprint_parts` and the hooks declared below."""
    reads: tuple[str, ...]
    """The stages whose outputs it reads while it runs (they may not run beside it)."""
    writes: str
    """What it writes, under the run's folder."""
    produces: str
    """What a rerun changes, as `status` names it to the stages below."""
    artifact_dir: Callable[[Any], Path]
    """The folder whose manifest says whether the stage is up to date."""
    fingerprint_parts: Callable[[Any], dict[str, Any]]
    """What the artifact is built from (cheap: no model weights); the manifest stores it."""
    run: Callable[..., dict[str, Any]]
    """Build the artifact; returns its manifest."""
    follows: tuple[str, ...] | None = None
    """The stages whose rerun makes it stale (its fingerprint holds theirs); None: those it reads."""
    optional: bool = False
    """Not part of a plain `run`, which adds it when the run asks (sample.after_train)."""
    planner: str | None = None
    """The module that declares its memory planner (its PLANNER: stages/core/memory/stage_plan.Planner);
    None: the stage needs no GPU budget. `plan` shows the plans of the stages that have one."""
    takes_force: bool = False
    """`run --force` hands `--force` to the stage's command (a cache deletes itself once it has checked the config;
    sample renders again)."""
    one_process: bool = False
    """Always one process, never one per GPU through torchrun."""
    check: Callable[[Any], Any] | None = None
    """Checks the model and data the stage needs, before it loads anything."""
    partial_state: Callable[[Any], str | None] = lambda cfg: None
    """Why an artifact without a manifest is incomplete, and what continues it (None: nothing to say)."""
    damaged_rows: Callable[[Any, dict[str, Any]], list[str]] = lambda cfg, manifest: []
    """The damaged rows of an up-to-date artifact, as reasons it is stale."""
    lacks: Callable[[Any, dict[str, Any]], list[str]] = lambda cfg, manifest: []
    """What an artifact whose fingerprint matches lacks of what cfg asks, as reasons it is stale: export-lora a
    format's file; cache-latents the images skipped under data.on_bad_image = "skip" while cfg says "error"."""
    describe_change: Callable[..., str] = _plain_change
    """(cfg, manifest, key, old, new) -> a changed fingerprint part as a user reads it."""
    other_settings: Callable[[Any], str | None] = lambda cfg: None
    """When the artifact was made with other settings than cfg: what differs and what to run."""
    request_stop: Callable[[Path, bool], Any] | None = None
    """(run folder, save) -> asks the running stage to stop; None: `stop` sends it SIGTERM."""
    units: Callable[[Any], list[Any]] = lambda cfg: [cfg]
    """The configs the stage makes one artifact each for: [cfg], or one per expert it trains (train and
    export-lora of train.expert = "both": caches.expert_configs). A stage is up to date when each one is."""

    @property
    def planned(self) -> bool:
        return self.planner is not None

    @property
    def upstream(self) -> tuple[str, ...]:
        """The stages whose rerun makes this one stale (`status` passes staleness down along these)."""
        return self.reads if self.follows is None else self.follows

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


def each_expert(cfg: Any) -> list[Any]:
    """One config per adapter the run trains (stages.core.caches.expert_configs with the family's experts)."""
    if cfg.train.expert != "both":
        return [cfg]
    from stages.families import get_family

    return caches.expert_configs(cfg, get_family(cfg.family).experts)


def _declare(name: str, module: str, hooks: tuple[str, ...] = (), **fields: Any) -> Stage:
    callables = {attr: _lazy(module, attr) for attr in ("fingerprint_parts", "run", *hooks)}
    return Stage(name=name, module=module, **callables, **fields)


# In the order `run` runs them.
ALL: tuple[Stage, ...] = (
    _declare("encode-captions", "stages.encode_captions", ("check", "damaged_rows", "describe_change"),
             reads=(), writes=caches.CAPTIONS, produces="captions", artifact_dir=caches.captions_dir,
             planner="stages.core.memory.captions", takes_force=True),
    _declare("cache-latents", "stages.cache_latents", ("check", "damaged_rows", "lacks", "describe_change"),
             reads=(), writes=caches.LATENTS, produces="latents", artifact_dir=caches.latents_dir,
             planner="stages.core.memory.latents", takes_force=True),
    _declare("train", "stages.train", ("partial_state", "describe_change", "other_settings", "request_stop"),
             reads=("encode-captions", "cache-latents"), writes=f"{caches.LORA}/", produces="the LoRA",
             artifact_dir=caches.lora_final_dir, planner="stages.core.memory.train", units=each_expert),
    # reads one small adapter and needs no GPU
    _declare("export-lora", "stages.export_lora", ("lacks",), reads=("train",), writes=f"{caches.EXPORT}/",
             produces="the export", artifact_dir=caches.export_dir, takes_force=True, one_process=True,
             units=each_expert),
    # reads the checkpoints as well as the export; its fingerprint holds the export's
    _declare("sample", "stages.sample", reads=("train", "export-lora"), follows=("export-lora",),
             writes=f"{caches.SAMPLES}/", produces="the samples", artifact_dir=caches.samples_dir,
             optional=True, planner="stages.core.memory.sample", one_process=True, takes_force=True),
)
BY_NAME = {s.name: s for s in ALL}
NAMES = tuple(BY_NAME)
REQUIRED = tuple(s.name for s in ALL if not s.optional)  # a plain `run`
OPTIONAL = tuple(s.name for s in ALL if s.optional)
PLANNED = tuple(s.name for s in ALL if s.planned)


def run_stages(cfg: Any) -> tuple[str, ...]:
    """The stages a plain `lorapipe run` of `cfg` runs, in order: the required ones, and sample where
    sample.after_train asks for it."""
    return REQUIRED + (OPTIONAL if cfg.sample.after_train else ())


def get(name: str) -> Stage:
    return BY_NAME[name]


def reads_of(name: str) -> tuple[Stage, ...]:
    """The stages `name` reads, as declared."""
    return tuple(BY_NAME[u] for u in BY_NAME[name].reads)


def conflicts(name: str) -> tuple[tuple[str, str], ...]:
    """(other stage, why) for each stage that may not run beside `name`: those that read what it
    writes, or write what it reads."""
    me = BY_NAME[name]
    return tuple((s.name, f"reads {me.writes}, which {name} writes" if name in s.reads
                  else f"writes {s.writes}, which {name} reads")
                 for s in ALL if s.name in me.reads or name in s.reads)


@dataclass(frozen=True)
class State:
    """One artifact of a stage as `status` and `inspect` show it."""
    expert: str
    """The expert whose artifact it is ("" for the run's one artifact)."""
    up_to_date: bool
    reasons: tuple[str, ...]
    """Why it is stale or blocked (empty when up to date)."""
    blocked: bool = False
    """Its inputs cannot be checked (a missing caption file, an unreadable folder: the reason names it and
    the fix), or a stage above it is blocked: `run` would stop there."""

    @property
    def state(self) -> str:
        return "blocked" if self.blocked else "up to date" if self.up_to_date else "stale"


def states(cfg: Any) -> dict[str, list[State]]:
    """Each stage's artifacts (the run's one, or one per expert) in `run`'s order, up to date, stale or
    blocked, and why. A stage above that will rerun makes the ones that follow it stale ("because latents
    will change"), for every expert or for its own; one that is blocked blocks them. `status` and `inspect`
    both show this."""
    changing: dict[str, set[str]] = {}  # stage -> the experts ("" for all) whose artifacts will change
    blocking: dict[str, set[str]] = {}  # the same, for the stages that cannot check their inputs
    out = {}
    for stage in ALL:
        units = stage.units(cfg)
        out[stage.name] = [_state(stage, unit, unit.train.expert if len(units) > 1 else "", changing, blocking)
                           for unit in units]
    return out


def _state(stage: Stage, cfg: Any, expert: str, changing: dict[str, set[str]],
           blocking: dict[str, set[str]]) -> State:
    """The State of one artifact of `stage`; adds it to `changing` when stale, to `blocking` when blocked."""
    from stages.core.errors import UserError
    from stages.core.stage import freshness

    def above(marks: dict[str, set[str]]) -> list[str]:
        return [u for u in stage.upstream if marks.get(u) and (not expert or expert in marks[u] or "" in marks[u])]

    try:
        ok, reasons, _, same = freshness(stage, cfg)
        blocked = False
    except (UserError, OSError) as e:  # a user's error in the inputs must not hide the other stages
        ok, reasons, same, blocked = False, [f"cannot check its inputs: {e}"], False, True
    waits, rerun = above(blocking), above(changing)
    if waits:  # the stage above names the error (most often this one's too: one dataset)
        reasons = [f"waits on {' and '.join(waits)}, which {'is' if len(waits) == 1 else 'are'} blocked",
                   *([] if blocked else reasons)]
        ok, blocked = False, True
    elif rerun:
        ok, reasons = False, [f"because {' and '.join(BY_NAME[u].produces for u in rerun)} will change", *reasons]
    if blocked:
        blocking.setdefault(stage.name, set()).add(expert)
    elif not ok and not (same and not rerun):  # a rerun that only repairs or completes it changes nothing below
        changing.setdefault(stage.name, set()).add(expert)
    return State(expert, ok, () if ok else tuple(reasons), blocked)
