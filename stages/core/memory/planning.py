"""Which planner a stage runs, under which budget, and the settings a stage's fingerprint expects.

    cfg, plan = memory.plan_stage(cfg, family, "train", log)   # the budget applied, a `plan` event logged

Under an "auto" budget the cheap stages plan for the train stage's predicted peak (plan_for): that is the
one rule that looks across stages, and it runs only when a stage plans to run or `lorapipe plan` shows the
plans. A fingerprint asks its own stage's planner only (planned_caption_precision, planned_vae).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any

from stages.core.memory import budget as budgets
from stages.core.memory import calibration as cal
from stages.core.memory import captions, latents, sample, train
from stages.core.errors import ResourceError
from stages.core.memory.budget import Budget, parse_budget
from stages.core.memory.stage_plan import Planner, StagePlan


# Each stage's planner, as its module declares it (stages/registry.py names the module of each planned stage).
PLANNERS: dict[str, Planner] = {p.stage: p for p in (captions.PLANNER, latents.PLANNER, train.PLANNER, sample.PLANNER)}


def plan_for(cfg: Any, family: Any, src: Any, budget: Budget, stage: str) -> StagePlan:
    """The stage's plan. Under "auto" a stage declared `under_train_peak` plans for the train stage's
    predicted peak when it is below the free memory, so it never sets the run's memory: the one rule that
    looks across stages."""
    planner, budget = PLANNERS[stage], budgets.for_stage(budget, stage)
    if budget.source == "auto" and planner.under_train_peak:
        peak = PLANNERS["train"].plan(cfg, family, src, budgets.for_stage(budget, "train"))
        if peak.fits and peak.predicted_peak_gb * cal.FRAGMENTATION < budget.gb:
            plan = planner.plan(cfg, family, src, Budget(round(peak.predicted_peak_gb * cal.FRAGMENTATION, 3), "auto"))
            if plan.fits and not planner.forced_only(cfg, plan):
                plan.budget, plan.note = budget, "auto: planned for the train stage's predicted peak"
                return plan
    return planner.plan(cfg, family, src, budget)


PLAN_FILE = "plan.json"


def record_plans(run_dir: Path, plans: list[StagePlan], key: str) -> None:
    """Write each plan under its stage in `<run>/plan.json`: "planned" (what `lorapipe plan` predicts) or
    "ran" (the plan the stage ran with). The file is rewritten atomically under a lock on the run folder
    (stages may run side by side); a run folder that does not exist yet is left alone."""
    import fcntl
    import os

    from stages.core.artifacts import atomic_write_json, read_json

    if not run_dir.is_dir():
        return
    path = run_dir / PLAN_FILE
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            current = read_json(path) if path.is_file() else {}
        except (OSError, ValueError):
            current = {}  # a damaged file is rewritten
        stages = current.get("stages") if isinstance(current, dict) and isinstance(current.get("stages"), dict) else {}
        for plan in plans:
            stages.setdefault(plan.stage, {})[key] = plan.to_dict()
        atomic_write_json(path, {"stages": stages})
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def with_plan(cfg: Any, plan: StagePlan) -> Any:
    """`cfg` with the plan's settings written into the stage's section."""
    return PLANNERS[plan.stage].apply(cfg, plan.settings)


def unplanned(cfg: Any, stage: str, budget: Budget) -> StagePlan:
    """The configured settings as they are (CPU: no budget to plan for)."""
    return StagePlan(stage, budget, PLANNERS[stage].configured(cfg), 0.0, True, "no GPU: settings as configured")


def plans_for_gpu(cfg: Any) -> bool:
    """Whether `cfg`'s stages plan for a GPU budget (its device is CUDA; tests simulate one here)."""
    from stages.core.runtime import device_type

    return device_type(cfg.device) == "cuda"


def own_settings(cfg: Any, family: Any, stage: str) -> dict[str, Any] | None:
    """The settings `stage`'s own planner gives `cfg` on a GPU (None on CPU), without measuring free
    memory, so the fingerprint a later stage checks is the one this stage wrote; no other stage's planner
    runs. Under "auto" it plans for unlimited memory: what the stage stores is then what it stores under
    train's peak as well (`Planner.forced_only`); where the free memory forced other numbers, the stage records
    it (`forced_by_memory`)."""
    from stages.core.model_source import model_source

    if not plans_for_gpu(cfg):
        return None
    recorded = _recorded_plan(cfg, stage)
    if recorded is not None and recorded.get("key") == plan_key(cfg, family):
        return recorded["settings"]  # `status` and the up-to-date checks: no model built on the meta device
    value = parse_budget(cfg.gpu.vram_budget_gb)
    budget = (Budget(math.inf, "auto") if value == "auto"
              else budgets.cap_budget(float(value), budgets.planned_context_gb(stage)))
    return PLANNERS[stage].plan(cfg, family, model_source(cfg), budget).settings


# The cache stages whose fingerprints ask their own planner (own_settings), by the folder of their artifact
RECORDED_PLANS = ("encode-captions", "cache-latents")


def recorded_plan(cfg: Any, family: Any, stage: str) -> dict[str, Any]:
    """What a cache stage's manifest records of the plan its fingerprint asked for ({} on CPU): its settings
    and the key of what they depend on, so a later check with the same key reads them instead of planning."""
    settings = own_settings(cfg, family, stage)
    return {} if settings is None else {"planned": {"key": plan_key(cfg, family), "settings": settings}}


def plan_key(cfg: Any, family: Any) -> str:
    """What own_settings' plan depends on, hashed: the config, the model's components (their configs and weight
    files' sizes and edges, ModelSource.identity), the planner's and the families' code, and the versions of the
    libraries that build the models it sizes. The GPU itself is not in it: these plans do not ask it anything."""
    from stages.core.artifacts import fingerprint
    from stages.core.model_source import model_source

    components = (*family.text_components, *family.vae_components, *family.denoiser_components)
    return fingerprint({"config": cfg.to_dict(), "model": model_source(cfg).identity(components), **_planner_code()})


@functools.lru_cache(maxsize=1)
def _planner_code() -> dict[str, Any]:
    """The planner's and the families' source, hashed, and the versions of diffusers and transformers: read once
    a process (they do not change under it)."""
    import hashlib
    from importlib.metadata import version

    code = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]  # stages/
    for path in sorted([*(root / "core" / "memory").glob("*.py"), *(root / "families").rglob("*.py")]):
        code.update(path.read_bytes())
    return {"code": code.hexdigest(), "libraries": [version(p) for p in ("diffusers", "transformers")]}


def _recorded_plan(cfg: Any, stage: str) -> dict[str, Any] | None:
    from stages.core.artifacts import read_manifest
    from stages.core.caches import captions_dir, latents_dir

    if stage not in RECORDED_PLANS:
        return None
    manifest = read_manifest((captions_dir if stage == "encode-captions" else latents_dir)(cfg))
    planned = (manifest or {}).get("planned")
    return planned if isinstance(planned, dict) and isinstance(planned.get("settings"), dict) else None


def planned_caption_precision(cfg: Any, family: Any) -> str | None:
    """The text-encoder precision encode-captions plans when it is "auto", from its own planner: what its
    fingerprint (and train's staleness check) expects the stored captions to be encoded in."""
    if cfg.captions.text_encoder_precision != "auto":
        return None
    return (own_settings(cfg, family, "encode-captions") or {}).get("text_encoder_precision")


def planned_vae(cfg: Any, family: Any) -> dict[str, Any] | None:
    """The VAE settings cache-latents plans (None on CPU), from its own planner: a budget too small for the
    configured precision lowers it, a smaller one tiles the encode, and the cache's fingerprint says so."""
    return own_settings(cfg, family, "cache-latents")


def forced_by_memory(cfg: Any, plan: StagePlan) -> str | None:
    """Why an "auto" cache-latents `plan` stores other numbers than `cfg` (as configured, before the
    plan) asks, naming the free memory that would avoid it; None when it does not. Only the free
    memory can force this: a cap gives the same plan at every stage, so the layout train expects."""
    if plan.stage != "cache-latents" or plan.budget.source != "auto" or not PLANNERS[plan.stage].forced_only(cfg, plan):
        return None
    configured = latents.configured_vae_precision(cfg)
    what = " and ".join(w for w, forced in [(f"the VAE in {plan.settings['vae_precision']}",
                                             plan.settings["vae_precision"] != configured),
                                            ("a tiled encode", plan.settings["tiled"])] if forced)
    need = min(t["predicted_peak_gb"] for t in plan.tried
               if t["vae_precision"] == configured and not t["tiled"]) * cal.FRAGMENTATION
    return (f"the free GPU memory forced {what} on cache-latents: rerun it with {need + cal.AUTO_MARGIN_GB:.1f} GB of GPU "
            f"memory free to encode the latents as configured ({configured}, untiled: {need:.2f} GB; the 'auto' budget "
            f"was {plan.budget.gb:.2f} GB, the free memory less {cal.AUTO_MARGIN_GB} GB). These latents are other numbers: "
            f"tiling moved random-weight VAEs' posterior mean by 24-81 % relative RMS, bf16 by 1.5-3 % "
            f"(bench/results/tiling-h200.json)")


def plan_stage(cfg: Any, family: Any, stage: str, log: Any, below_gb: float | None = None) -> tuple[Any, StagePlan]:
    """Resolve (and enforce) the budget, plan the stage, log a `plan` event; the config to run with.
    `below_gb`: plan as if the budget were at most that (the sample stage's retry after an out-of-memory
    error: the next smaller plan), without enforcing it."""
    from stages.core.model_source import model_source
    from stages.core.runtime import pick_device

    budget = budgets.resolve_budget(cfg.gpu.vram_budget_gb, pick_device(cfg.device), stage=stage)
    if below_gb is not None and budget.gb is not None:
        budget = dataclasses.replace(budget, gb=min(budget.gb, below_gb), given_gb=None)
    src = model_source(cfg)
    if budget.gb is None:
        plan = unplanned(cfg, stage, budget)
    else:
        plan = plan_for(cfg, family, src, budget, stage)
    log.emit("plan", **plan.to_dict())
    try:
        record_plans(cfg.run_dir, [plan], "ran")
    except OSError as e:  # the record is for the user to read; the stage's own writes report a full disk
        log.emit("warning", message=f"could not write {cfg.run_dir / PLAN_FILE}: {e}")
    _RAN[stage] = (plan, family, src)
    if not plan.fits:
        if budget.source == "cap":  # a given --vram: the stage would run out of memory after loading its models
            raise ResourceError(f"{stage}: {plan.note}; nothing was loaded or written")
        log.emit("warning", message=plan.note)
    if note := budgets.context_note(budget):
        log.emit("warning", message=note)
    return (with_plan(cfg, plan) if budget.gb is not None else cfg), plan


# The plan each stage of this process ran with, and its family and model source (plan_stage), for translate_oom's advice.
_RAN: dict[str, tuple[StagePlan, Any, Any]] = {}


def translate_oom(error: BaseException, cfg: Any, stage: str) -> ResourceError | None:
    """A CUDA out-of-memory error as a ResourceError that names the stage, the budget, the peak it reached
    and what to change: where the stage planned under a budget, the settings its planner chooses below the
    peak reached that differ from those it ran with (`oom_advice`); None for any other error."""
    import sys

    torch_mod = sys.modules.get("torch")
    if torch_mod is None or not isinstance(error, torch_mod.cuda.OutOfMemoryError):
        return None
    peak = torch_mod.cuda.max_memory_reserved() / cal.GB if torch_mod.cuda.is_available() else 0.0
    budget = getattr(getattr(cfg, "gpu", None), "vram_budget_gb", "auto")
    budget_text = "auto: the free memory at start" if budget == "auto" else f"{budget} GB"
    kept = "everything already written is kept and the rerun continues from it"
    ran, family, src = _RAN.get(stage, (None, None, None))
    if ran is not None and ran.budget.gb is not None:
        try:
            advice = oom_advice(cfg, family, src, ran, peak)
        except Exception:  # the advice is a courtesy: the error itself must come out whatever planning meets
            advice = None
        planner = PLANNERS[stage]
        ran_with = ", ".join(f"{k}={v}" for k, v in ran.settings.items() if k not in ("blocks", "layers"))
        smaller = planner.last_resort(cfg, family) if family is not None else ""
        advice = advice or (f"the planner has no smaller plan that fits below that: {smaller}" if smaller else
                            "the planner has no smaller plan that fits below that, and no setting that lowers it "
                            "can go lower: give it a larger --vram")
        return ResourceError(f"{stage} ran out of GPU memory (budget {budget_text}, peak reached {peak:.2f} GB reserved, "
                             f"planned {ran_with}): {advice}{'; ' + planner.oom_also if planner.oom_also else ''}; {kept}")
    to_change = PLANNERS[stage].to_change if stage in PLANNERS else "the batch size"
    return ResourceError(
        f"{stage} ran out of GPU memory (budget {budget_text}, peak reached {peak:.2f} GB): rerun with a lower "
        f"--vram (gpu.vram_budget_gb) so the planner picks smaller settings, or lower {to_change}; {kept}")


OOM_STEPS = (0.95, 0.9, 0.8, 0.7, 0.6, 0.5)  # fractions of the memory reached that the advice plans under, in turn


def oom_advice(cfg: Any, family: Any, src: Any, ran: StagePlan, peak_gb: float) -> str | None:
    """What to change after `ran` (the plan a stage ran with) ran out of memory at `peak_gb` reserved: the
    stage's planner run under budgets below what it reached (OOM_STEPS of the peak, or of the budget where no
    peak was measured) until it fits other settings than `ran`; the config keys whose value changes, named
    with that value, and the --vram that makes the planner choose it. None where no smaller plan fits."""
    planner = PLANNERS[ran.stage]
    assert ran.budget.gb is not None
    reached = min(peak_gb, ran.budget.gb) if peak_gb > 0 else ran.budget.gb
    for step in OOM_STEPS:
        smaller = dataclasses.replace(ran.budget, gb=round(reached * step, 3), source="cap", given_gb=None)
        plan = planner.plan(cfg, family, src, smaller)
        changed = {k: v for k, v in plan.settings.items() if ran.settings.get(k) != v}
        if plan.fits and changed:
            break
    else:
        return None
    vram = f"--vram {math.floor(smaller.vram_gb * 10) / 10:.1f}"  # rounded down: the planner chooses the same there
    named = [f"{planner.keys[k]} = {_toml(v)}" for k, v in changed.items() if k in planner.keys]
    others = ", ".join(f"{k}={v}" for k, v in changed.items() if k not in planner.keys and k not in ("blocks", "layers"))
    if named:
        return (f"set {' and '.join(named)} (the planner's choice under {vram}"
                f"{', with ' + others if others else ''}), or rerun with {vram} (gpu.vram_budget_gb)")
    return f"rerun with {vram} (gpu.vram_budget_gb): the planner then chooses {others}"


def _toml(value: Any) -> str:
    """A setting's value as a TOML config spells it."""
    return str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, str) else str(value)
