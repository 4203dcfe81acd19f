"""The denoiser's forward and backward replayed as CUDA graphs, one per batch shape.

    LORAPIPE_CUDA_GRAPHS=off lorapipe train --config ...   # the eager path, to compare

Why: at FLUX's LoRA shapes the step is bound by host work, not by the GPU. A FLUX step with
gradient checkpointing runs ~500 Linears three times (forward, recompute, backward), each one a
chain of Python in diffusers, peft and bitsandbytes (nf4: a dequantize op plus a matmul per pass),
and the GPU waits between those launches. A CUDA graph replays the same kernels with no Python
between them: on an H200, full-width FLUX blocks at 512 px, batch 4 ran 1.19x faster in nf4 and
1.05x in bf16, which brought nf4 from 1.18x to 1.05x the bf16 step (docs/performance.md).

The math is unchanged: a graph replays the kernels the eager step launched (bitsandbytes' ops,
cuBLAS, SDPA) on copies of the same inputs, so the loss is the same for the same inputs
(tests/stages/test_trainer_paths.py compares the two on the GPU). What a graph needs, and what happens
otherwise:

- Static shapes: one graph per input signature (shapes, dtypes, non-tensor arguments), captured the
  second time that signature is seen (a shape seen once, such as an epoch's short last batch, stays
  eager), at most MAX_GRAPHS of them, all in one memory pool.
- No random numbers inside the denoiser: a LoRA with dropout > 0 runs eager.
- Gradient checkpointing without RNG state bookkeeping (`checkpoint_function`): the blocks draw no
  random numbers when dropout is 0, so saving and restoring the RNG state around each block is
  pure host overhead, and reading the CUDA RNG state is not allowed while a graph is captured.
- Any capture failure falls back to eager for that signature, with a warning event.
"""

from __future__ import annotations

import functools
import gc
import math
import os
from collections import Counter
from typing import Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from stages.core.blockswap import SwappedCall, block_of, forget_slots

ENV = "LORAPIPE_CUDA_GRAPHS"
MODES = ("auto", "on", "off")
MAX_GRAPHS = 8
CAPTURE_AT = 2  # capture a signature the second time it is seen
WARMUP_ITERS = 1  # one forward+backward on a side stream before capture (lazy inits stay out of the graph)
# Under block swap none: that warmup's activations stay cached for its side stream, where neither the
# capture (its own pool) nor the cap can take them back, so a capture can need up to twice the step's
# activations (the likely reason Z-Image's capture at a 4 GB cap ran out of memory). The eager step
# before the capture (CAPTURE_AT) ran the same shapes on the compute stream, and the capture empties
# the cache first. Measured (bench results memory-*-room-h200.json): the captures under swap took
# 1.18-1.43x the eager step's activations.
SWAP_WARMUP_ITERS = 0


def graphs_mode(configured: str = "auto") -> str:
    """runtime.cuda_graphs, unless the LORAPIPE_CUDA_GRAPHS environment variable overrides it."""
    mode = os.environ.get(ENV, "").strip().lower() or configured
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r} is not one of {', '.join(MODES)}")
    return mode


def _checkpointed_call(module: Any) -> Callable[..., Any]:
    """What checkpointing calls, for forward and recompute: the module's `__call__`, or for a block
    that block swap stands in for, its call that may use the swap's reused device buffers."""
    return module.checkpointed if isinstance(module, SwappedCall) else module.__call__


def _checkpoint_no_rng(module: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(_checkpointed_call(module), *args, use_reentrant=False,
                                             preserve_rng_state=False, **kwargs)


def _checkpoint_rng(module: Any, *args: Any, **kwargs: Any) -> Any:
    """diffusers' default checkpoint function: the RNG state is saved and restored for the recompute."""
    return torch.utils.checkpoint.checkpoint(_checkpointed_call(module), *args, use_reentrant=False, **kwargs)


def _plain_checkpoint(dropout: float) -> Callable[..., Any]:
    """Without RNG state bookkeeping when nothing in the blocks is random (dropout 0), else diffusers' default."""
    return _checkpoint_no_rng if dropout == 0 else _checkpoint_rng


# runtime.keep_attention: the aten attention ops whose outputs (the output and its softmax statistics) a
# checkpointed block keeps, so its recompute skips attention, the one op in a block whose cost grows with
# the square of the tokens (FLUX.1 Kontext at 1024 px: 8,704 tokens).
ATTENTION_OPS = tuple(getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name))


def _keep_attention_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_attention_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_attention_policy)


def _checkpoint_keeping_attention(module: Any, rng: bool, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False, preserve_rng_state=rng,
                                             context_fn=_keep_attention_context, **kwargs)


def keep_attention_checkpoint(dropout: float) -> Callable[..., Any]:
    """Checkpoint a block keeping its attention outputs (runtime.keep_attention): eager through the policy's
    dispatch mode, or for a block compiled in place inside a torch.compile'd checkpoint (`call`). A block that
    block swap stands in for is checkpointed as without it (its swapped call manages its own buffers)."""
    fallback = _plain_checkpoint(dropout)
    compiled: list[Callable[..., Any]] = []

    def call(module: Any, *args: Any, **kwargs: Any) -> Any:
        """The selective checkpoint inside torch.compile for a block compiled in place (regional compile):
        the policy's dispatch mode cannot see into a compiled block from outside, while a compiled call
        traces into it and the policy marks the attention ops for the partitioner (one graph per block class)."""
        if isinstance(module, SwappedCall):
            return fallback(module, *args, **kwargs)
        run = _checkpoint_keeping_attention
        if getattr(module, "_compiled_call_impl", None) is not None:
            compiled[:] = compiled or [torch.compile(_checkpoint_keeping_attention)]
            run = compiled[0]
        return run(module, dropout != 0, *args, **kwargs)

    return call


def checkpoint_function(dropout: float, direct: Iterable[torch.nn.Module] = (),
                        keep_attention: bool = False) -> Callable[..., Any]:
    """The gradient-checkpointing function for `enable_gradient_checkpointing`: without RNG state
    bookkeeping when nothing in the blocks is random (dropout 0), else as diffusers' default; with
    `keep_attention`, each checkpointed block keeps its attention outputs (`keep_attention_checkpoint`).

    Partial checkpointing: the blocks in `direct` run as plain calls (their activations are kept for
    backward, no recompute); every other module the model hands to the function is checkpointed. The
    model passes the block itself (diffusers: `self._gradient_checkpointing_func(block, *args)`), or
    under block swap the `SwappedCall` standing in for it, which is unwrapped here. Blocks are matched
    by identity: regional compile compiles each block in place (`module.compile()`), so a compiled block
    is the same object. The choice is made in Python at each call, so a CUDA graph captures the path the
    step took."""
    checkpoint = keep_attention_checkpoint(dropout) if keep_attention else _plain_checkpoint(dropout)
    skip = frozenset(id(b) for b in direct)
    if not skip:
        return checkpoint

    def partial(module: Any, *args: Any, **kwargs: Any) -> Any:
        if id(block_of(module)) in skip:
            return module(*args, **kwargs)
        return checkpoint(module, *args, **kwargs)

    return partial


# Under block swap a capture needs memory the eager step does not, and a swap plan sits close to its
# budget: "auto" captures only where the memory free at the capture is CAPTURE_ROOM times the eager
# step's activations, else runs eager (the measurements behind the factor: bench/LOG.md).
CAPTURE_ROOM = 2.0
# Without swap (partial checkpointing fills a budget with un-checkpointed blocks) 1.45x is the lowest room
# at which a measured capture ran; lower ones ran out of memory (bench/LOG.md).
UNSWAPPED_CAPTURE_ROOM = 1.45
# A batch shape first seen after graphs were captured (another bucket, a longer caption where the family cuts
# captions to the batch's longest) runs one eager step beside the graphs' pool, which the cap does not give back:
# under a budget its activations (the captured shapes' eager activations, scaled by its larger inputs, with this
# margin) must fit what is free, else the graphs are released and every step runs eager. Ideogram 4 under an fp8
# plan at an 18.5 GB cap ran its captured shape, then ran out of memory at the first step of a longer caption
# (bench/results/peers-ideogram4/).
NEW_SHAPE_ROOM = 1.15
SWAP_GRAPHS = (f"on under block swap where the capture has room (mode auto): captured at its second step if "
               f"the memory free under the budget is {CAPTURE_ROOM:g}x the eager step's activations, else eager; "
               f"runtime.cuda_graphs = 'on' captures regardless, 'off' never")


class CaptureRoom:
    """Whether a CUDA graph capture fits the budget: the memory free under it (after emptying the
    cache) against `factor` times the eager steps' activations, measured as the allocation peak over
    what was allocated when the denoiser was first called. A loading peak above the steps' makes the
    estimate larger, never smaller."""

    def __init__(self, device: torch.device, budget_gb: float, factor: float):
        self.device, self.budget, self.factor = device, int(budget_gb * 2**30), factor
        self.base: int | None = None
        self.eager_need = 0  # the largest eager step's activations weighed at a capture (bytes)

    def first_call(self) -> None:
        if self.base is None:
            self.base = torch.cuda.memory_allocated(self.device)

    def check(self) -> tuple[bool, str]:
        """(room?, the figures weighed)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        need = max(torch.cuda.max_memory_allocated(self.device) - (self.base or 0), 0)
        self.eager_need = max(self.eager_need, need)
        free = self.budget - torch.cuda.memory_reserved(self.device)
        return free >= self.factor * need, (f"{free / 2**30:.2f} GB free under the {self.budget / 2**30:.2f} GB "
                                            f"budget for a capture that wants {self.factor:g}x the eager step's "
                                            f"{need / 2**30:.2f} GB of activations")

    def eager_fits(self, scale: float) -> tuple[bool, str]:
        """(room?, the figures weighed) for the first, eager step of a batch shape not seen before, while the
        captured graphs keep their pool: the memory free under the budget against NEW_SHAPE_ROOM times the
        captured shapes' eager activations, scaled by how much larger the new shape's inputs are (`scale`)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        want = NEW_SHAPE_ROOM * max(1.0, scale) * self.eager_need
        free = self.budget - torch.cuda.memory_reserved(self.device)
        return free >= want, (f"{free / 2**30:.2f} GB free under the {self.budget / 2**30:.2f} GB budget beside the "
                              f"graphs' memory, for a new batch shape's eager step that may want {want / 2**30:.2f} GB")


def graphs_plan(rt: Any, dropout: float, mode: str, swapped: int = 0) -> tuple[bool, str]:
    """(use graphs?, why) for this run: `mode` as graphs_mode gives it, train.dropout, and `swapped`, the
    blocks the memory plan swaps."""
    if mode == "off":
        return False, f"off (runtime.cuda_graphs or {ENV} = off)"
    if not rt.is_cuda:
        return False, "off (no CUDA device)"
    if dropout > 0:
        return False, f"off (train.dropout = {dropout}: random numbers inside the denoiser)"
    if swapped and mode == "auto":
        return True, SWAP_GRAPHS
    return True, f"on (mode {mode}): one graph per batch shape, captured at its second step"


_LEAF_TYPES = (type(None), bool, int, float, str)


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, list[Any], Any] | None:
    """(hashable key, flat leaves, tree spec) of a call, or None if it cannot be graphed."""
    leaves, spec = tree_flatten((args, kwargs))
    parts: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.dtype, str(leaf.device), leaf.requires_grad))
        elif isinstance(leaf, _LEAF_TYPES):
            parts.append(("value", leaf))
        else:
            return None
    return (str(spec), tuple(parts)), leaves, spec


def _cuda_capture(fn: Callable[..., Any], sample_args: tuple[torch.Tensor, ...], pool: Any,
                  warmup: int = WARMUP_ITERS) -> Callable[..., Any]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the eager steps' cached blocks are not usable by the graph's pool
    return torch.cuda.make_graphed_callables(fn, sample_args, num_warmup_iters=warmup,
                                             allow_unused_input=True, pool=pool)


class GraphedDenoiser:
    """Called like the denoiser; replays a CUDA graph per call signature.

    Attribute reads (`dtype`, `config`, ...) go to the model, so a family's `loss()` takes this
    object where it takes the model. Gradients reach the LoRA parameters through the graph's
    backward, which autograd accumulates into `.grad` as usual.
    """

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter], log: Any,
                 capture: Callable[..., Callable[..., Any]] | None = None, max_graphs: int = MAX_GRAPHS,
                 warmup: int = WARMUP_ITERS, room: Any = None):
        self.model, self.params, self.log = model, tuple(params), log
        self.max_graphs = max_graphs
        self._capture = capture or functools.partial(_cuda_capture, warmup=warmup)
        self._room = room  # a CaptureRoom: capture only where it fits ("auto" under a GPU budget)
        self._no_room: set[Any] = set()  # shapes left eager for want of room
        self._room_checks: list[str] = []  # each check's figures, in order
        self._pool: Any = None
        self._seen: Counter = Counter()
        self._graphs: dict[Any, Callable[..., Any]] = {}
        self._failed: set[Any] = set()
        self._oom = False  # a capture ran out of memory: no further shape is captured (each would need as much)
        self._released = ""  # why the graphs were released for a new shape's eager step ("" while they are kept)
        self._weighed = 0  # the most input elements of a shape whose eager activations the room weighed
        self._past_limit = 0  # repeated shapes left eager past max_graphs
        self.replays = 0

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sig = signature(args, kwargs) if torch.is_grad_enabled() else None
        if sig is None:
            return self.model(*args, **kwargs)
        key, leaves, spec = sig
        graph = self._graphs.get(key)
        if graph is None:
            self._seen[key] += 1
            if self._room is not None:
                self._room.first_call()
                if self._seen[key] == 1 and self._graphs:
                    self._make_room_for_new_shape(leaves)
            if self._seen[key] == CAPTURE_AT and len(self._graphs) >= self.max_graphs and key not in self._failed:
                self._warn_full(leaves)
            if (self._seen[key] < CAPTURE_AT or key in self._failed or key in self._no_room or self._oom
                    or self._released or len(self._graphs) >= self.max_graphs):
                return self.model(*args, **kwargs)
            if self._room is not None:
                fits, why = self._room.check()
                self._weighed = max(self._weighed, _elements(leaves))
                self._room_checks.append(("" if fits else "no room: ") + why)
                if not fits:
                    self._no_room.add(key)
                    return self.model(*args, **kwargs)
            graph = self._make(key, leaves, spec)
            if graph is None:
                return self.model(*args, **kwargs)
        self.replays += 1
        return graph(leaves)

    def _make_room_for_new_shape(self, leaves: list[Any]) -> None:
        """Before a new batch shape's first (eager) step while graphs hold their pool: where that step may not fit
        what the budget leaves free (CaptureRoom.eager_fits), release the graphs so it runs, and every step
        after it, eager."""
        fits, why = self._room.eager_fits(_elements(leaves) / max(1, self._weighed))
        self._room_checks.append(("" if fits else "released: ") + why)
        if fits:
            return
        self._graphs.clear()
        self._pool = None
        forget_slots(self.model)
        _release_graph_memory()
        self._released = why
        shapes = [tuple(leaf.shape) for leaf in leaves if isinstance(leaf, torch.Tensor)][:2]
        self.log.emit("warning", message=f"CUDA graphs released: batch shape {shapes} is new and its eager step may "
                                         f"not fit beside their memory ({why}); every step runs eager from here (slower). "
                                         f"A larger --vram keeps them")

    def _warn_full(self, leaves: list[Any]) -> None:
        """A repeated batch shape past the graph limit runs eager from now on: say so for the first such shape
        (the summary counts them all: with captions cut to the batch's longest, every caption length is a shape)."""
        self._past_limit += 1
        if self._past_limit > 1:
            return
        shapes = [tuple(leaf.shape) for leaf in leaves if isinstance(leaf, torch.Tensor)][:2]
        self.log.emit("warning", message=f"batch shape {shapes} runs without a CUDA graph, as will any other shape "
                                         f"past the first {self.max_graphs}: each graph holds memory for its replays "
                                         f"(those steps are slower). Shapes differ by aspect bucket and, in families "
                                         f"that cut captions to the batch's longest, by caption length: fewer buckets "
                                         f"(data.max_aspect, data.bucket_merge) and caption lengths rounded up "
                                         f"(--set runtime.caption_tokens_multiple=64) give fewer shapes")

    def _make(self, key: Any, leaves: list[Any], spec: Any) -> Callable[..., Any] | None:
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        static = tuple(leaves[i].detach().clone().requires_grad_(leaves[i].requires_grad) for i in at)
        template = [None if i in at else leaf for i, leaf in enumerate(leaves)]  # the key fixes the rest

        def forward(*tensors: torch.Tensor) -> Any:
            full = list(template)
            for i, t in zip(at, tensors[:len(at)]):
                full[i] = t
            args, kwargs = tree_unflatten(full, spec)
            return self.model(*args, **kwargs)

        failure = None
        try:
            if self._pool is None and torch.cuda.is_available():
                self._pool = torch.cuda.graph_pool_handle()
            graphed = self._capture(forward, static + self.params, self._pool)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager
            # only text (the exception's frames hold its tensors), its first line: CUDA's errors go on with a
            # docs link and advice about CUDA_LAUNCH_BLOCKING that say nothing about this capture
            failure = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            self._oom = self._oom or "out of memory" in failure  # torch.cuda.OutOfMemoryError's text says so too
        if failure is not None:  # out of the except block, so what the capture allocated can be freed now
            del static
            self._failed.add(key)
            forget_slots(self.model)
            _release_graph_memory()
            then = "; no other shape is captured either (each would need as much memory)" if self._oom else ""
            self.log.emit("warning", message=f"CUDA graph capture failed for input shapes "
                                             f"{[tuple(leaves[i].shape) for i in at]}; this shape runs eager{then}: {failure}")
            return None
        self._graphs[key] = functools.partial(_replay, graphed, at, self.params)
        return self._graphs[key]

    def summary(self) -> dict[str, Any]:
        room = {"no_room": len(self._no_room), "room": self._room_checks} if self._room is not None else {}
        stopped = ({"stopped": "a capture ran out of memory"} if self._oom else
                   {"stopped": f"released for a new shape's eager step: {self._released}"} if self._released else {})
        past = {"past_limit": self._past_limit} if self._past_limit else {}
        return {"graphs": len(self._graphs), "failed": len(self._failed), "replays": self.replays, **room, **past, **stopped}


def _elements(leaves: list[Any]) -> int:
    """The input elements of a call (its tensors' sizes summed): how a shape's activations compare with another's."""
    return sum(leaf.numel() for leaf in leaves if isinstance(leaf, torch.Tensor))


def _release_graph_memory() -> None:
    """Give back what a failed capture allocated, or what released graphs held (their pool's blocks, the
    graphs' tensors), so the eager steps that follow have that memory."""
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a capture error can surface here again; the cache is freed anyway
            pass
        torch.cuda.empty_cache()


def _replay(graphed: Callable[..., Any], at: list[int], params: tuple[torch.Tensor, ...], leaves: list[Any]) -> Any:
    return graphed(*(leaves[i] for i in at), *params)


def wrap_denoiser(model: torch.nn.Module, params: list[torch.nn.Parameter], rt: Any, cfg: Any,
                  log: Any, swapped: int = 0, budget_gb: float | None = None) -> tuple[Any, str]:
    """(what the loss calls, why): a GraphedDenoiser where graphs apply, else the model itself. "auto"
    captures only where the capture has room under the stage's budget (`budget_gb`, CaptureRoom):
    UNSWAPPED_CAPTURE_ROOM times the eager step's activations free, CAPTURE_ROOM under block swap, where
    the capture also skips the side-stream warmup. At FLUX.2 klein's 5.08 GB cap a capture without room
    ran out of memory, and the eager steps after it too (bench/results/peers-klein-1024-b1-g3.json)."""
    mode = graphs_mode(cfg.runtime.cuda_graphs)
    use, why = graphs_plan(rt, cfg.train.dropout, mode, swapped=swapped)
    if not use:
        return model, why
    room = None
    if mode == "auto" and budget_gb is not None and math.isfinite(budget_gb):
        room = CaptureRoom(rt.device, budget_gb, CAPTURE_ROOM if swapped else UNSWAPPED_CAPTURE_ROOM)
        if not swapped:
            why = (f"{why}, where {UNSWAPPED_CAPTURE_ROOM:g}x the eager step's activations are free under the "
                   f"{budget_gb:g} GB budget (else eager)")
    return GraphedDenoiser(model, params, log, warmup=SWAP_WARMUP_ITERS if swapped else WARMUP_ITERS, room=room), why
