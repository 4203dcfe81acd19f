"""Which planner a stage runs, under which budget, and the settings a stage's fingerprint expects.

    cfg, plan = memory.plan_stage(cfg, family, "train", log)   # the budget applied, a `plan` event logged

Under an "auto" budget the cheap stages plan for the train stage's predicted peak (plan_for): that is the
one rule that looks across stages, and it runs only when a stage plans to run or `lorapipe plan` shows the
plans. A fingerprint asks its own stage's planner only (planned_caption_precision, planned_vae).
"""

from __future__ import annotations

import math
from typing import Any

from stages.core.memory import budget as budgets
from stages.core.memory import calibration as cal
from stages.core.memory import captions, latents, sample, train
from stages.core.memory.apply import with_plan
from stages.core.memory.budget import Budget, parse_budget
from stages.core.memory.stage_plan import StagePlan


PLANNERS = {"encode-captions": captions.plan, "cache-latents": latents.plan, "train": train.plan, "sample": sample.plan}


def plan_for(cfg: Any, family: Any, src: Any, budget: Budget, stage: str) -> StagePlan:
    """The stage's plan. Under "auto" the cheap stages plan for the train stage's predicted peak
    when it is below the free memory, so they never set the run's memory."""
    if budget.source == "auto" and stage in ("encode-captions", "cache-latents"):
        peak = train.plan(cfg, family, src, budget)
        if peak.fits and peak.predicted_peak_gb * cal.FRAGMENTATION < budget.gb:
            plan = PLANNERS[stage](cfg, family, src, Budget(round(peak.predicted_peak_gb * cal.FRAGMENTATION, 3), "auto"))
            if plan.fits and not _forced_only(cfg, plan):
                plan.budget, plan.note = budget, "auto: planned for the train stage's predicted peak"
                return plan
    return PLANNERS[stage](cfg, family, src, budget)


def _forced_only(cfg: Any, plan: StagePlan) -> bool:
    """A plan that "auto" takes only when the free memory forces it, not to stay under train's peak:
    an encode-captions plan that offloads layers (slower, for memory nobody else needs), or one plan of
    either stage that stores other numbers than its planner gives with memory to spare (captions: another
    text-encoder precision than its first; latents: a lower VAE precision, a tiled encode: FLUX.2 klein
    at 1024 px cached bf16 latents on a free H200 for a 3 GB train stage). So what these stages store
    under "auto" is what their own planner gives, which their fingerprints ask (`own_settings`)."""
    if plan.stage == "encode-captions":
        return (bool(plan.settings.get("offload_gb"))
                or plan.settings["text_encoder_precision"] != captions.first_precision(cfg))
    if plan.stage != "cache-latents":
        return False
    configured = latents.configured_vae_precision(cfg)
    return plan.settings["vae_precision"] != configured or plan.settings["tiled"]


def unplanned(cfg: Any, stage: str, budget: Budget) -> StagePlan:
    """The configured settings as they are (CPU: no budget to plan for)."""
    settings = {"encode-captions": {"text_encoder_precision": cfg.captions.text_encoder_precision,
                                    "batch_size": cfg.captions.batch_size},
                "cache-latents": {"vae_precision": cfg.latents.vae_precision, "sliced": False, "tiled": False},
                "sample": {"precision": cfg.sample.precision, "cpu_offload": cfg.sample.cpu_offload},
                "train": {"base_precision": cfg.train.base_precision, "swapped_blocks": 0,
                          # "auto" without a budget: every block checkpointed (None: all of them)
                          "gradient_checkpointing": cfg.runtime.gradient_checkpointing is not False,
                          "checkpointed_blocks": None}}[stage]
    return StagePlan(stage, budget, settings, 0.0, True, "no GPU: settings as configured")


def plans_for_gpu(cfg: Any) -> bool:
    """Whether `cfg`'s stages plan for a GPU budget (its device is CUDA; tests simulate one here)."""
    from stages.core.runtime import pick_device

    return pick_device(cfg.device).type == "cuda"


def own_settings(cfg: Any, family: Any, stage: str) -> dict[str, Any] | None:
    """The settings `stage`'s own planner gives `cfg` on a GPU (None on CPU), without measuring free
    memory, so the fingerprint a later stage checks is the one this stage wrote; no other stage's planner
    runs. Under "auto" it plans for unlimited memory: what the stage stores is then what it stores under
    train's peak as well (`_forced_only`); where the free memory forced other numbers, the stage records
    it (`forced_by_memory`)."""
    from stages.core.model_source import model_source

    if not plans_for_gpu(cfg):
        return None
    value = parse_budget(cfg.gpu.vram_budget_gb)
    budget = Budget(math.inf, "auto") if value == "auto" else Budget(float(value), "cap")
    return PLANNERS[stage](cfg, family, model_source(cfg), budget).settings


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
    if plan.stage != "cache-latents" or plan.budget.source != "auto" or not _forced_only(cfg, plan):
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

    budget = budgets.resolve_budget(cfg.gpu.vram_budget_gb, pick_device(cfg.device))
    if below_gb is not None and budget.gb is not None:
        budget = Budget(min(budget.gb, below_gb), budget.source)
    if budget.gb is None:
        plan = unplanned(cfg, stage, budget)
    else:
        plan = plan_for(cfg, family, model_source(cfg), budget, stage)
    log.emit("plan", **plan.to_dict())
    if not plan.fits:
        log.emit("warning", message=plan.note)
    return (with_plan(cfg, plan) if budget.gb is not None else cfg), plan
