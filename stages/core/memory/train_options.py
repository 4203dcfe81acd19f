"""The train planner's options, in the order it tries them, and the room a budget-bound plan leaves
CUDA graphs to capture."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from stages.core.memory import calibration as cal
from stages.core.memory.budget import Budget
from stages.core.memory.stage_plan import StagePlan

# CUDA graphs under block swap (stages/core/fastpath.py, CaptureRoom): the trainer captures where the
# memory free under the budget is fastpath.CAPTURE_ROOM times the eager step's activations, else it runs
# eager, whose host time sets the pace at small images (512 px: FLUX at 6 GB 0.14-0.19x, Qwen-Image at
# 8 GB 0.16x their unconstrained speed; bench/memory.md). So a swap plan swaps more blocks, where that
# leaves the room: under graphs a swapped block costs little (Qwen-Image at 8 GB, 512 px: 0.53x under
# graphs with 27 swapped; FLUX at 6 GB, 1024 px: 0.91x with 54). The planner's room predicts the one the
# runtime measures: in the five swap rows that weighed it (bench/results/memory-*-room-h200.json) the
# memory free at the capture was 0.14-0.25 GB below the budget less the planned peak without activations,
# and the eager step's activations (its allocation peak over what was allocated at its first call) were
# 0.10-0.20 GB above the formula's: the LoRA's gradients, allocated in the step (0.06-0.09 GB at rank 16),
# and ~0.1 GB more. With those allowances (the gradients scale with the LoRA's size) the planner's room came
# out 0.92-0.99x the measured one in those rows, which they were fitted on; the margin covers the rest
# (calibration.GRAPH_FREE_SLACK_GB, GRAPH_ACTIVATIONS_EXTRA_GB, GRAPH_ROOM_MARGIN).
cal.GRAPH_FREE_SLACK_GB, cal.GRAPH_ACTIVATIONS_EXTRA_GB = 0.25, 0.13
cal.GRAPH_ROOM_MARGIN = 1.05


def graph_room(settings_peak_gb: float, acts_gb: float, grads_gb: float, budget: Budget, swapped: bool = True) -> float:
    """A plan's room for a capture as the runtime will measure it, by the planner's figures: the
    budget less what stays allocated between steps (the predicted peak without the activations and, under
    swap, the swap's allocator margin) and the measured slack, over what a step allocates (its
    activations, the LoRA's gradients `grads_gb`, and the measured extra)."""
    free = budget.gb - (settings_peak_gb - acts_gb - cal.SWAP_EXTRA_GB * swapped) - cal.GRAPH_FREE_SLACK_GB
    return free / (acts_gb + grads_gb + cal.GRAPH_ACTIVATIONS_EXTRA_GB) if acts_gb > 0 else math.inf


def other_shapes_gb(family: Any, settings: dict[str, Any], peak_gb: float, acts_gb: float, grads_gb: float,
                    budget: Budget, mode: str | None) -> float:
    """What a capped train holds beyond its predicted peak where CUDA graphs capture and its batches come in
    several caption lengths (family.captions_cut_to_longest; the plan does not know the captions): a length
    without a graph of its own runs eager beside the graph's memory, one step's activations more, bounded by the
    cap (train checks the room before such a step). Qwen-Image at 1024 px with 512-token captions held 7.18 GB
    at `--vram 8` (55 blocks swapped) where its peak was predicted at 5.77, and 15.65 at 16 GB (nf4 whole) against
    14.72 (bench/results/budget-grid/). The plan's note gives the total with it. 0 without a cap, without
    graphs, where a capture would find no room, or for a family whose captions have one length."""
    from stages.core import fastpath

    if not family.captions_cut_to_longest or mode is None or budget.source != "cap" or budget.gb is None:
        return 0.0
    swapped = bool(settings["swapped_blocks"])
    want = (fastpath.CAPTURE_ROOM if swapped else fastpath.UNSWAPPED_CAPTURE_ROOM) * cal.GRAPH_ROOM_MARGIN
    if mode == "auto" and graph_room(peak_gb, acts_gb, grads_gb, budget, swapped) < want:
        return 0.0
    return max(0.0, min(acts_gb + grads_gb + cal.GRAPH_ACTIVATIONS_EXTRA_GB, budget.gb / cal.FRAGMENTATION - peak_gb))


def graphs_mode(cfg: Any, budget: Budget) -> str | None:
    """runtime.cuda_graphs' mode ("auto" or "on") where train may capture CUDA graphs under this budget,
    else None (CPU, LoRA dropout, or "off")."""
    from stages.core import fastpath

    mode = fastpath.graphs_mode(cfg.runtime.cuda_graphs)
    return mode if budget.source != "cpu" and budget.gb is not None and cfg.train.dropout == 0 and mode != "off" else None


def with_graph_room(plan: StagePlan, candidates: list[tuple[dict[str, Any], float]], acts_of: Callable[[dict[str, Any]], float],
                     grads_gb: float, budget: Budget, mode: str, fewer_fp8: bool = False) -> StagePlan:
    """A budget-bound plan that leaves CUDA graphs room to capture, else `plan` as it is (under "auto" it
    will run eager); its note says which. A swap plan swaps more blocks (the fewest more that leave the
    room; same precision and checkpointing); a plan whose checkpointing `auto` chose within the budget (no
    swap) checkpoints more blocks (the fewest more; same precision): at a cap near the step's peak a capture
    without room ran out of memory and so did the eager steps after it (FLUX.2 klein, nf4, 1024 px at the
    diffusers script's 5.08 GB: 23 of 25 blocks checkpointed; bench/results/peers-klein-1024-b1-g3.json).
    `fewer_fp8` (an fp8 base whose fp8 blocks the planner chose within the budget): where checkpointing more
    leaves no room, the fewest fewer fp8 blocks that do (same checkpointing): klein's 22 fp8 blocks at the
    script's 5.74 GB reserved peak left 2.10 GB for a capture that wanted 2.33, so every step ran eager, 0.29 s
    against 0.20 with graphs (bench/results/peers-klein-1024-b1-fitreserved-fp8-expandable.json).
    `acts_of(settings)`: a plan's activations in GB."""
    from stages.core import fastpath

    swapped = bool(plan.settings["swapped_blocks"])
    want = (fastpath.CAPTURE_ROOM if swapped else fastpath.UNSWAPPED_CAPTURE_ROOM) * cal.GRAPH_ROOM_MARGIN
    # (setting varied, +1: more of it gives room / -1: fewer does, settings kept, what the note calls it)
    ways = ([("swapped_blocks", 1, ("base_precision", "checkpointed_blocks"), "swapped")] if swapped else
            [("checkpointed_blocks", 1, ("base_precision", "swapped_blocks", "fp8_blocks"), "checkpointed")]
            + ([("fp8_blocks", -1, ("base_precision", "swapped_blocks", "checkpointed_blocks"), "in fp8")]
               if fewer_fp8 else []))
    room_at = lambda s, peak: graph_room(peak, acts_of(s), grads_gb, budget, swapped)  # noqa: E731
    room = room_at(plan.settings, plan.predicted_peak_gb)

    def first_with_room(vary: str, sign: int, keep: tuple[str, ...]) -> tuple[dict[str, Any], float] | None:
        """The first candidate (the fewest more, or fewer, of `vary`) with the rest as planned that fits and leaves the room."""
        return next(((s, peak) for s, peak in candidates
                     if all(s.get(k) == plan.settings.get(k) for k in keep) and s.get(vary) is not None
                     and (s[vary] - plan.settings[vary]) * sign > 0
                     and peak * cal.FRAGMENTATION <= budget.gb and room_at(s, peak) >= want), None)

    hit = None if room >= want else next(((way, h) for way in ways if (h := first_with_room(*way[:3])) is not None), None)
    if hit is not None:
        (vary, sign, _, what), (settings, peak) = hit
        extra, room = abs(settings[vary] - plan.settings[vary]), room_at(settings, peak)
        more, than = ("more", "the budget needs") if sign > 0 else ("fewer", "the budget allows")
        why = ("eager steps under swap can be host-bound, most at small images" if swapped else
               "a capture without room can run out of memory" if vary == "checkpointed_blocks" else
               "eager steps at the cap run slower")
        note = (f"{extra} {more} block{'s' * (extra > 1)} {what} than {than}, to leave CUDA graphs room to "
                f"capture ({room:.1f}x the step's activations free; {want:.1f}x wanted): {why}")
        plan = dataclasses.replace(plan, settings=settings, predicted_peak_gb=peak, note=note)
    elif room < want:
        then = ("runtime.cuda_graphs = 'on' captures anyway and may run out of memory there"
                if mode == "on" else
                "train checks at the capture, else runs eager, which can be host-bound, most at small images")
        plan.note = (f"CUDA graphs may have no room to capture under this {'swap ' * swapped}plan ({room:.1f}x the step's "
                     f"activations free, {want:.1f}x wanted; {then}; a larger --vram gives them room)")
    plan.settings = {**plan.settings, "graph_room": round(room, 2)}
    return plan


def train_options(configured: bool | str, precisions: list[str], n: int,
                   swap_order: list[str] | None = None) -> list[tuple[str, int, int]]:
    """(precision, swapped blocks, checkpointed blocks) in the order train tries them, cheapest in speed
    first: every precision without swapping (in `precisions`' order, fastest first; as configured,
    then checkpointed), then more and more blocks swapped, all checkpointed, the precisions in
    `swap_order` (never fp8: its base is quantized on the GPU from a host copy, with no block kept in
    host memory; smallest first: an nf4 block copies a quarter of a bf16 block's bytes, and fewer
    of them must be swapped). A smaller precision that fits whole beats swapping: SDXL at a 4 GB cap
    ran 0.23x with 38 of 70 bf16 blocks swapped, where its nf4 base fits at 3.0 GB and runs 0.79x of
    bf16 (bench/results/memory-zimage-sdxl-h200.json, bench-sdxl-E.json); Qwen-Image at 8 GB ran
    0.40x with 56 of 60 bf16 blocks swapped and 0.50x with 36 nf4 blocks (before swap ran under
    CUDA graphs).

    "auto" tries, at each precision in turn, 0, 1, ..., n checkpointed blocks (fewest first: each
    un-checkpointed block saves its recompute: 29 % of an eager FLUX.2 klein step for all of them,
    bench/LOG.md), so it un-checkpoints only what fits at the precision the other settings would pick,
    and never swaps a block or moves to the next precision to un-checkpoint one: swapping costs far more
    than recompute (FLUX at 8 GB, 15 blocks swapped: 0.85x)."""
    if configured == "auto":
        whole = [(p, 0, k) for p in precisions for k in range(n + 1)]
    else:
        whole = [(p, 0, n if c else 0) for p in precisions for c in dict.fromkeys((configured, True))]
    return whole + [(p, k, n) for p in (swap_order or precisions) if p != "fp8" for k in range(1, n + 1)]


def with_fp8_nf4(options: list[tuple[str, int, int]], n: int, fixed: int | str = "auto") -> list[tuple[str, int, int, int | None]]:
    """`train_options`' options with how many blocks stay fp8 (None: the precision whole), and after the
    last whole fp8 option the same checkpointing with the first n-1, n-2, ... blocks in fp8 and the rest
    nf4 (stages/core/fp8.py `quantize_fp8_nf4`): where the whole fp8 base does not fit, its fastest
    blocks go as far as the budget allows before the plan falls to nf4 whole. Most fp8 blocks first, then
    fewest checkpointed: on FLUX.2 klein at 1024 px a GB of fp8 blocks saved ~21 ms a step (nf4 0.252 s,
    fp8 0.209 s, 2.0 GB apart: docs/performance.md), a GB of un-checkpointed blocks ~9 ms.
    Under "auto" at least a quarter of the blocks (rounded up) stay fp8: fewer would take too little off
    the step to be worth the memory (klein's 16 of 25 took 17 % off nf4's). `fixed` (train.fp8_blocks as a
    number below n): the fp8 options have exactly that many fp8 blocks."""
    out: list[tuple[str, int, int, int | None]] = [(p, s, k, None) for p, s, k in options]
    whole_fp8 = [i for i, (p, s, _, _) in enumerate(out) if p == "fp8" and not s]
    if not whole_fp8 or n < 2 or (fixed != "auto" and fixed >= n):
        return out
    at = whole_fp8[-1] + 1
    counts = range(n - 1, math.ceil(n / 4) - 1, -1) if fixed == "auto" else [fixed]
    mixed = [("fp8", 0, out[i][2], m) for m in counts for i in whole_fp8]
    if fixed != "auto":  # the whole fp8 base is not an option then
        return [o for i, o in enumerate(out[:at]) if i not in whole_fp8] + mixed + out[at:]
    return out[:at] + mixed + out[at:]
