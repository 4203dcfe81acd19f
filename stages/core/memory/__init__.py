"""The memory planner: every stage asks it, before loading weights, which settings fit its GPU budget.

    cfg, plan = memory.plan_stage(cfg, family, "train", log)   # the budget applied, a `plan` event logged
    lorapipe plan --config configs/flux-dev.toml --vram 8   # the same plans, as a table

budget.py       the budget ("auto" or a cap), the allocator under a cap, host memory
sizes.py        weights' bytes from meta-device components
calibration.py  the measured constants, each with where it was measured
captions.py, latents.py, train.py (+ train_options.py), sample.py   one planner per stage, each declared as
                its module's PLANNER (stage_plan.Planner): plan(cfg, family, src, budget), its configured
                settings, how a plan applies to the config, and what to lower after an out-of-memory error
planning.py     which planner a stage runs under which budget; the settings a fingerprint expects; out-of-memory errors
apply.py        applying a plan at run time (where weights load, VAE tiling, block swap)

The names below are the package's interface (`memory.plan_stage`, `memory.Budget`, ...). A test that
replaces a constant or function replaces it in the module that defines it (e.g. `calibration.SWAP_EXTRA_GB`).
"""

from __future__ import annotations

from stages.core.memory import calibration, sizes
from stages.core.memory.calibration import (
    ATTENTION_KEPT_UNITS, ATTENTION_SCORE_BYTES, AUTO_BASE_PRECISIONS, AUTO_MARGIN_GB, BLOCK_SAVED_UNITS, BLOCK_WORK_UNITS,
    CFG_BATCH, CHECKPOINT_SAVED_UNITS, CUDA_CONTEXT_GB, FRAGMENTATION, GB, GRAPH_ROOM_MARGIN,
    NF4_BYTES_PER_WEIGHT, SWAP_EXTRA_GB, VAE_ELEMENTS_PER_PIXEL, VAE_TILE_PIXELS)
from stages.core.memory.budget import (
    ALLOC_CONF_VARS, CAP_ALLOC_CONF, Budget, allocator_cap_gb, allocator_for_cap, allocator_setting, allocator_summary,
    cap_budget, context_note, host_available_bytes, measure_context, parse_budget, planned_context_gb, process_total_gb,
    resolve_budget, retries_note, stage_context_gb)
from stages.core.memory.sizes import fp8_nf4_weight_bytes, meta_component, module_components, weight_bytes
from stages.core.memory.stage_plan import Planner, StagePlan
from stages.core.memory import captions, latents, sample, train, train_options
from stages.core.memory.captions import HOST_BYTES, OFFLOAD_PRECISION, Placement, offload_placement
from stages.core.memory.captions import plan as plan_captions
from stages.core.memory.latents import plan as plan_latents
from stages.core.memory.sample import plan as plan_sample
from stages.core.memory.train import fp8_host_short, host_shortfall
from stages.core.memory.train import plan as plan_train
from stages.core.memory.train_options import graph_room
from stages.core.memory.apply import (
    apply_train_plan, apply_vae_plan, checkpointed_blocks, load_device, text_encoder_runtime)
from stages.core.memory.planning import (
    PLAN_FILE, PLANNERS, RECORDED_PLANS, forced_by_memory, oom_advice, own_settings, plan_for, plan_key, plan_stage,
    planned_caption_precision, recorded_plan,
    planned_vae, plans_for_gpu, record_plans, translate_oom, unplanned, with_plan)

__all__ = [
    "ALLOC_CONF_VARS", "ATTENTION_KEPT_UNITS", "ATTENTION_SCORE_BYTES", "AUTO_BASE_PRECISIONS", "AUTO_MARGIN_GB",
    "BLOCK_SAVED_UNITS", "BLOCK_WORK_UNITS", "Budget", "CAP_ALLOC_CONF", "CFG_BATCH", "CHECKPOINT_SAVED_UNITS",
    "CUDA_CONTEXT_GB", "FRAGMENTATION", "GB", "GRAPH_ROOM_MARGIN", "HOST_BYTES",
    "NF4_BYTES_PER_WEIGHT", "OFFLOAD_PRECISION", "PLAN_FILE", "PLANNERS", "Placement", "Planner", "SWAP_EXTRA_GB",
    "StagePlan", "VAE_ELEMENTS_PER_PIXEL", "VAE_TILE_PIXELS", "allocator_cap_gb", "allocator_for_cap",
    "allocator_setting", "allocator_summary", "apply_train_plan", "apply_vae_plan", "calibration", "cap_budget",
    "captions", "checkpointed_blocks", "context_note", "forced_by_memory", "fp8_host_short", "fp8_nf4_weight_bytes",
    "graph_room", "host_available_bytes", "host_shortfall", "latents", "load_device",
    "measure_context", "meta_component", "module_components", "offload_placement", "oom_advice", "own_settings",
    "parse_budget", "plan_captions", "plan_for", "plan_latents", "plan_sample", "plan_stage", "plan_train",
    "RECORDED_PLANS", "plan_key", "planned_caption_precision", "recorded_plan", "planned_context_gb", "stage_context_gb", "planned_vae", "plans_for_gpu", "process_total_gb",
    "record_plans", "resolve_budget", "retries_note", "sample", "sizes", "text_encoder_runtime", "train",
    "train_options", "translate_oom", "unplanned", "weight_bytes", "with_plan"]
