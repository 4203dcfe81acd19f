"""train's plan: the base's precision, checkpointed and swapped blocks, fp8 blocks, within a budget.
The options it tries, in order, and the room it leaves CUDA graphs are in train_options.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from stages.core.errors import ConfigError
from stages.core.memory import budget as budgets
from stages.core.memory import calibration as cal
from stages.core.memory.budget import Budget
from stages.core.memory.adapter import adapter_memory
from stages.core.memory.sizes import (_width, fp8_nf4_weight_bytes, meta_component, planned_frames, sample_tokens,
                                       weight_bytes, with_named_blocks)
from stages.core.memory.stage_plan import (Planner, StagePlan, changeable, data_settings, either, fitting, nf4_instead,
                                           planned_controls)
from stages.core.memory.train_options import graphs_mode, other_shapes_gb, train_options, with_fp8_nf4, with_graph_room


def fp8_host_short(host_gb: float) -> str:
    """Why "auto" leaves out an fp8 base that the GPU could run: the bf16 read an fp8 load of a single-file
    checkpoint (or of a folder whose keys diffusers converts) makes into host memory first does not fit what
    is available (a diffusers folder streams, as nf4 loads shard by shard; its host_gb is 0); "" when it
    fits or the host cannot tell."""
    available = budgets.host_available_bytes()
    if available is None or host_gb * cal.GB <= available:
        return ""
    return f"its bf16 read ({host_gb:.1f} GB) exceeds the {available / cal.GB:.1f} GB of host memory available"


def _base_precisions(cfg: Any, family: Any, host_gb: float, tokens: int) -> tuple[list[str], str, str]:
    """The base precisions train tries whole, in order: the configured one, or under "auto" the family's
    (calibration.AUTO_BASE_PRECISIONS) less fp8 where this process could not use it, and fp8 before bf16 where it was
    measured faster at a step of `tokens` (family.fp8_faster_from_tokens); why fp8 was left out where the
    GPU could run it ("" otherwise: a GPU without fp8 tensor cores is not news), and why it went first."""
    tcfg = cfg.train
    if tcfg.base_precision != "auto":
        return [tcfg.base_precision], "", ""
    precisions = list(family.auto_base_precisions or cal.AUTO_BASE_PRECISIONS)
    if tcfg.assistant_adapter:  # merged into the base weights, which an nf4 or fp8 base cannot take (lora.merge_assistant)
        precisions = [p for p in precisions if p not in ("nf4", "fp8")] or precisions
    if "fp8" not in precisions:
        return precisions, "", ""
    from stages.core.fp8 import fp8_supported

    supported, why = fp8_supported(), ""
    if supported:
        why = ("runtime.compile_transformer = 'off' (eager, one fp8 layer ran 0.50x bf16's speed: bench/fp8.md)"
               if cfg.runtime.compile_transformer == "off" else fp8_host_short(host_gb))
    if why or not supported:
        precisions.remove("fp8")
        return precisions, why, ""
    faster_from = family.fp8_faster_from_tokens
    if faster_from is None or tokens < faster_from or "bf16" not in precisions:
        return precisions, "", ""
    precisions.remove("fp8")
    precisions.insert(precisions.index("bf16"), "fp8")
    return precisions, "", (f"auto tried fp8 before bf16: {tokens} tokens a step, where {family.name}'s fp8 step was "
                            f"measured faster from {faster_from} (docs/performance.md)")


def plan(cfg: Any, family: Any, src: Any, budget: Budget) -> StagePlan:
    from stages.core import blockswap  # imports torch: the plan builds the denoiser on the meta device

    tcfg = cfg.train
    model = with_named_blocks(meta_component(src, family.denoiser_components[0]), family)
    blocks = blockswap.repeated_blocks(model)
    targets = tcfg.target_modules or list(family.default_lora_targets)
    adapter = adapter_memory(model, tcfg, cfg.runtime, targets, blocks)
    lora = adapter.resident_bytes
    side = max(d.resolution for d in cfg.dataset_configs())  # tokens: / family.pixels_per_token (VAE x patch)
    images = 1 + planned_controls(cfg, family)  # edit families: control tokens join the sequence
    image_tokens = sample_tokens(family, side, side, planned_frames(cfg, family))  # a clip: x its latent frames
    tokens = tcfg.batch_size * (images * image_tokens + cfg.captions.max_sequence_length)
    unit = tokens * (_width(blocks[0]) if blocks else _width(model)) * 2
    # host memory a load needs besides what the plan keeps there: a bf16 read of the base is a copy unless the
    # files are bf16 safetensors (then mapped pages: bench/fp8.md); fp8 streams a folder's shards whose keys
    # are the model's (fp8.streams, the loader's own test), else reads the base whole in bf16 first
    from stages.core.fp8 import streams
    from stages.core.model_source import stored_as_bf16, stored_dtypes

    stored, bf16_gb = stored_dtypes(src.weight_files(family.denoiser_components[0])), weight_bytes(model, "bf16") / cal.GB
    read_gb = 0.0 if stored_as_bf16(stored) else bf16_gb
    fp8_host_gb = 0.0 if streams(model, stored) else bf16_gb
    precisions, fp8_left_out, fp8_first = _base_precisions(cfg, family, fp8_host_gb, tokens)
    n, layout = len(blocks), cfg.runtime.block_swap_layout
    if layout == "spread" and not family.blocks_in_run_order:
        raise ConfigError(f"runtime.block_swap_layout = 'spread' does not suit {family.name}: its denoiser lists its blocks "
                          f"in another order than it runs them (SDXL's UNet runs down, mid, up), so block swap could not "
                          f"copy the next swapped block ahead of its use. Set runtime.block_swap_layout = 'last'.")
    keep_attention, per_block = cfg.runtime.keep_attention, family.attention_per_block
    fp8_fixed = tcfg.fp8_blocks
    if keep_attention and not per_block:
        raise ConfigError(f"runtime.keep_attention = true does not suit {family.name}: its denoiser's blocks do not each "
                          f"run one attention at their width (SDXL's UNet blocks hold several, or none), which is what "
                          f"the memory planner counts for it. Set runtime.keep_attention = false.")
    whole = {p: weight_bytes(model, p) for p in precisions}  # the whole base per precision
    # a step's activations: the checkpointed blocks keep their input, the others every activation their
    # backward reads, and the block being run (or recomputed) works in its own
    fixed_gb, per_sample_gb = family.outside_block_gb  # activations outside the blocks
    outside = (fixed_gb + per_sample_gb * tcfg.batch_size * images * (side // 16 * 16 / 512) ** 2) * cal.GB
    # per-token conditioning outside the blocks (Wan 2.2 TI2V's timestep per latent token), fp32 rows of the width
    outside += family.outside_rows_per_token * tcfg.batch_size * images * image_tokens * _width(model) * 4
    # the un-checkpointed blocks are the last ones (trainer: blocks[checkpointed:])
    own_units = family.block_saved_units
    # a block keeps what the adapter saves for the backward too (DoRA: its per-output scale's operands)
    per_token = unit / max(1, tokens)
    saved = [own_units.get(type(b).__name__, cal.BLOCK_SAVED_UNITS) + extra / per_token
             for b, extra in zip(blocks, adapter.block_saved_bytes_per_token)]
    work = cal.BLOCK_WORK_UNITS if family.block_work_units is None else family.block_work_units
    work += max(adapter.block_saved_bytes_per_token, default=0) / per_token
    kept = cal.ATTENTION_KEPT_UNITS if keep_attention else 0.0  # per checkpointed unswapped block
    # train.preservation adds no term: its base forwards run under no_grad (each block's transients freed as
    # the next runs, no more than the `work` a graded block holds), "dataset" before the graded forward and
    # "blank_prompt" after the graded backward freed its activations; blank_prompt's graded forward on the
    # empty caption then runs alone with a caption no longer than the batch's (Trainer._backward_once), so the
    # peak is one graded step's, as planned. What stays alive across them is one prediction, latent-sized.
    # one adapted layer at a time adds its transient (DoRA's weight norm, LoHa's and LoKr's delta weight)
    activations = lambda checkpointed, swapped=0: outside + adapter.transient_bytes + unit * (  # noqa: E731
        checkpointed * cal.CHECKPOINT_SAVED_UNITS + max(0, checkpointed - swapped) * kept + sum(saved[checkpointed:]) + work)
    options = with_fp8_nf4(train_options(cfg.runtime.gradient_checkpointing, precisions, n, sorted(precisions, key=whole.get)),
                            n, fp8_fixed)
    mixed = fp8_nf4_weight_bytes(model) if any(m is not None for *_, m in options) else []
    # each block's bytes that swapping it moves to host memory, for the precisions a swap option uses
    block_bytes = {p: [weight_bytes(b, p, codes_only=True) for b in blocks] for p in {p for p, k, _, _ in options if k}}
    candidates = []
    for precision, swapped, checkpointed, fp8_blocks in options:
        total = whole[precision] if fp8_blocks is None else mixed[fp8_blocks]
        host = [block_bytes[precision][i] for i in blockswap.swapped_positions(n, swapped, layout)]  # two slots of the largest
        resident = total - sum(host) + min(2, len(host)) * max(host, default=0)
        peak = resident + lora + activations(checkpointed, swapped) + cal.SWAP_EXTRA_GB * cal.GB * (swapped > 0)
        if precision == "nf4" and not swapped:  # diffusers' load quantizes on the GPU: the whole nf4 base is there
            peak = max(peak, total + lora)  # (a swap plan quantizes block by block: stages/core/nf4_blocks.py)
        checkpointing = checkpointed > 0 or (n == 0 and cfg.runtime.gradient_checkpointing is not False)
        settings = {"base_precision": precision, "gradient_checkpointing": checkpointing,
                    "checkpointed_blocks": checkpointed, "swapped_blocks": swapped, "blocks": n}
        if fp8_blocks is not None:  # read whole in bf16 into host memory, then quantized layer by layer
            settings["fp8_blocks"] = fp8_blocks
            if read_gb:
                settings["host_gb"] = round(read_gb, 2)
        elif swapped:  # the swapped blocks live in host memory (pinned), after the load's read
            settings["host_gb"] = round(read_gb + sum(host) / cal.GB, 2)
        elif precision == "fp8" and fp8_host_gb:  # a single file or converted keys: read whole in bf16 first
            settings["host_gb"] = round(fp8_host_gb, 2)
        if swapped and layout != "last":
            settings["swap_layout"] = layout
        candidates.append((settings, peak / cal.GB))
    plan = fitting(budget, candidates, "train", _smaller(cfg, family))
    grads_gb = adapter.grads_bytes / cal.GB  # the adapter's fp32 gradients: a step allocates them anew
    acts_gb = lambda s: activations(s["checkpointed_blocks"], s["swapped_blocks"]) / cal.GB  # noqa: E731
    for tried in plan.tried:
        tried["activations_gb"] = round(acts_gb(tried), 6)
        tried["lora_grads_gb"] = round(grads_gb, 6)
    partial = cfg.runtime.gradient_checkpointing == "auto"  # the checkpointed blocks chosen within the budget
    fewer_fp8 = plan.settings.get("fp8_blocks") is not None and fp8_fixed == "auto"
    mode = graphs_mode(cfg, budget)
    if plan.fits and (plan.settings["swapped_blocks"] or (partial and plan.settings["checkpointed_blocks"] < n) or fewer_fp8) \
            and mode:
        plan = with_graph_room(plan, candidates, acts_gb, grads_gb, budget, mode, fewer_fp8)
    # the eager steps of other caption lengths beside a CUDA graph's memory
    extra = other_shapes_gb(family, plan.settings, plan.predicted_peak_gb, acts_gb(plan.settings), grads_gb, budget, mode) \
        if plan.fits else 0.0
    if extra:
        said = f"{plan.note.rstrip('.')}." if plan.note else ""
        plan.note = (f"{said} With captions of several lengths up to {budget.total_gb(plan.predicted_peak_gb + extra):.1f} "
                     f"GB in all, within the cap: a length without a CUDA graph of its own runs eager beside the graph's "
                     f"memory (runtime.caption_tokens_multiple makes fewer lengths).").strip()
    if plan.fits and plan.settings.get("fp8_blocks") is not None:
        whole_fp8 = [peak for settings, peak in candidates
                     if settings["base_precision"] == "fp8" and "fp8_blocks" not in settings]
        why = (f"the whole fp8 base needs {min(whole_fp8) * cal.FRAGMENTATION:.1f} GB" if whole_fp8 else
               "train.fp8_blocks")
        said = f"{plan.note.rstrip('.')}." if plan.note else ""
        plan.note = (f"{said} fp8 for the first {plan.settings['fp8_blocks']} of {n} blocks, nf4 for the other "
                     f"blocks and outside them: {why}.").strip()
    if fp8_left_out:
        plan.note = f"{plan.note} auto left fp8 out: {fp8_left_out}.".strip()
    if fp8_first and plan.settings["base_precision"] == "fp8":
        plan.note = f"{plan.note} {fp8_first}.".strip()
    resident = plan.settings["checkpointed_blocks"] - plan.settings["swapped_blocks"]
    extra_gb = cal.ATTENTION_KEPT_UNITS * max(0, resident) * unit / cal.GB
    if (plan.fits and not keep_attention and resident > 0 and tokens // tcfg.batch_size >= cal.KEEP_ATTENTION_HINT_TOKENS
            and budget.gb is not None and per_block
            and (plan.predicted_peak_gb + extra_gb) * cal.FRAGMENTATION <= budget.gb):
        plan.note = (f"{plan.note} runtime.keep_attention = true fits this budget too (+{extra_gb:.1f} GB): the "
                     f"{resident} checkpointed blocks would keep their attention outputs and the recompute skip "
                     f"attention, which makes long sequences faster.").strip()
    short = host_shortfall(plan)
    if short:  # `plan` shows it now; train stops with it before loading (load_device)
        plan.note = f"{plan.note} {short}".strip()
    return plan


def host_shortfall(plan: StagePlan) -> str:
    """What stops a train plan whose host memory (a swap plan's swapped blocks, plus a bf16 copy of the base
    where its files are not bf16 safetensors; an fp8 base from a single file: its bf16 read) needs more
    than the host has available; "" when it fits or the host cannot tell."""
    swapped = plan.settings.get("swapped_blocks")
    need, available = plan.settings.get("host_gb"), budgets.host_available_bytes()
    if not need or available is None or need * cal.GB <= available:
        return ""
    if swapped:
        why = (f"the plan swaps {swapped} of {plan.settings.get('blocks')} blocks to fit the GPU budget "
               f"({plan.budget.gb or 0:.1f} GB), which needs {need:.1f} GB of host memory (the swapped blocks, "
               f"plus a bf16 copy of the base where its files are not bf16 safetensors)")
        fix = "give the stage more GPU memory (--vram) so that fewer blocks, or none, are swapped"
    else:
        why = (f"an fp8 base from a single-file checkpoint (or from a folder whose weights diffusers converts on "
               f"load) reads the base in bf16 ({need:.1f} GB) into host memory first")
        fix = ("point 'model' at a diffusers folder saved by diffusers (an fp8 load streams its shards), or use "
               "train.base_precision = 'nf4' or 'bf16', which load shard by shard")
    return f"train: {why}, but only {available / cal.GB:.1f} GB of host memory is available: free host memory, or {fix}"


def _apply(cfg: Any, s: dict[str, Any]) -> Any:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, base_precision=s["base_precision"]),
                               runtime=dataclasses.replace(cfg.runtime, gradient_checkpointing=s["gradient_checkpointing"]))


def _smaller(cfg: Any, family: Any) -> str:
    """What lowers train's memory below every plan it tried: an nf4 base where another is set, then the batch
    size, resolution and frames that can still go lower, with their values ("" when none can)."""
    lower = changeable(("train.batch_size", cfg.train.batch_size, cfg.train.batch_size > 1), *data_settings(cfg, family))
    return either(nf4_instead("train.base_precision", cfg.train.base_precision), lower)


PLANNER = Planner(
    "train", plan,
    # "auto" without a budget: every block checkpointed (None: all of them)
    configured=lambda cfg: {"base_precision": cfg.train.base_precision, "swapped_blocks": 0,
                            "gradient_checkpointing": cfg.runtime.gradient_checkpointing is not False,
                            "checkpointed_blocks": None},
    apply=_apply,
    to_change=("train.batch_size, data.resolution or train.base_precision = 'nf4' (or set runtime.cuda_graphs = 'off': "
               "capturing a graph takes memory of its own)"),
    keys={"base_precision": "train.base_precision", "gradient_checkpointing": "runtime.gradient_checkpointing"},
    oom_also="if it ran out while capturing CUDA graphs, runtime.cuda_graphs = 'off' leaves their memory free",
    last_resort=_smaller)
