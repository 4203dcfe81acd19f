"""Block swap: the frozen base's repeated blocks live in (pinned) host memory and visit the GPU one
at a time, for forward, for the recompute of gradient checkpointing, and for backward.

    swap = install_block_swap(model, n_blocks=28, device=torch.device("cuda"))   # before training
    swap.summary()   # {"swapped_blocks": 28, "host_gb": ..., "prefetch": ...}

How it works (same math as the unswapped model, only placement changes):
- The blocks are the members of the model's ModuleLists whose class is in diffusers'
  `_repeated_blocks` (FLUX: FluxTransformerBlock + FluxSingleTransformerBlock, 19 + 38; Qwen-Image:
  60 QwenImageTransformerBlock; Z-Image: 30 ZImageTransformerBlock; SDXL: its 70 BasicTransformerBlock
  inside the attention layers). The last `n_blocks` of them (in execution order) are swapped.
- A swapped block's frozen parameters move to host memory (pinned on CUDA). Trainable parameters
  (LoRA A/B) stay on the GPU and stay the block's own, so the optimizer state stays there too.
- The model's loops iterate those ModuleLists; the swapped lists yield a `_SwappedCall` in place of
  the block. Calling it copies the block's frozen weights to the GPU (a prefetched copy made on a side
  stream when one is ready), runs the block with those copies substituted for its parameters
  (`torch.nn.utils.stateless._reparametrize_module`), then drops them. Autograd keeps the copies the
  block's backward needs (a matmul saves its weight) and frees them once that backward has run. With
  gradient checkpointing the saved tensors of a block are not kept: the recompute in backward calls
  the block again, which copies its weights again. Without checkpointing the copies stay alive until
  backward, so the planner turns checkpointing on whenever it swaps.
- Regional compile (`compile_repeated_blocks`) compiles the block's own `__call__`; the copying
  happens outside it, and the substituted weights are ordinary inputs to the compiled graph (dynamo
  treats module parameters as inputs), so a swapped block runs the same compiled code.
- CUDA graphs are turned off while blocks are swapped (the planner sets train.cuda_graphs = "off"):
  a captured graph would replay the copies into the graph pool and pin every swapped block's weights.
- nf4 (bitsandbytes Params4bit): `.to(device)` of a quantized Params4bit moves its quant_state too,
  so copies keep their quantization state. It moves it in place (bitsandbytes 0.50 `QuantState.to`),
  and the host parameter shares that state: after a block's first copy its absmax and code tables
  (1/64 of a weight's bytes in fp32, less with double quantization) stay on the GPU and only the
  4-bit codes travel, asynchronously from pinned memory. A plan that swaps an nf4 base loads it quantized block by
  block (stages/core/nf4_blocks.py), so the swapped blocks never reach the GPU whole.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.nn.utils.stateless import _reparametrize_module


def repeated_block_lists(model: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """(name, ModuleList) of every list of the model's repeated block classes, in registration order
    (which is the order the DiT families run them in)."""
    classes = set(getattr(model, "_repeated_blocks", ()) or ())
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, torch.nn.ModuleList) and len(m) and all(type(b).__name__ in classes for b in m)]


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [b for _, blocks in repeated_block_lists(model) for b in blocks]


def quantized(p: torch.Tensor) -> bool:
    """A bitsandbytes Params4bit that holds quantized weights (its quant_state travels with it)."""
    return getattr(p, "quant_state", None) is not None


def frozen_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)


@dataclass
class BlockSwap:
    """Moves the frozen weights of a set of blocks between host and device, one block ahead."""

    device: torch.device
    blocks: list[torch.nn.Module]
    host: dict[int, dict[str, torch.nn.Parameter]] = field(default_factory=dict)  # id(block) -> frozen params
    order: dict[int, int] = field(default_factory=dict)  # id(block) -> position among the swapped blocks
    copies: int = 0
    prefetch_hits: int = 0

    def __post_init__(self) -> None:
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._ahead: tuple[int, dict[str, torch.Tensor], Any] | None = None  # (position, copies, event)
        for k, block in enumerate(self.blocks):
            self.order[id(block)] = k
            self.host[id(block)] = self._to_host(block)

    def _to_host(self, block: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        frozen = {}
        for name, p in block.named_parameters():
            if p.requires_grad:
                continue
            host = p.data.to("cpu")
            if self.stream is not None:
                host = host.pin_memory()
            p.data = host
            if quantized(p):
                p.quant_state.to(torch.device("cpu"))
            frozen[name] = p
        return frozen

    def _copy(self, position: int) -> dict[str, torch.Tensor]:
        """Device copies of one block's frozen weights (on CPU: real clones, so a CPU test copies too)."""
        self.copies += 1
        host = self.host[id(self.blocks[position])]
        if self.stream is None:  # a Params4bit's deepcopy copies its quant_state too (a clone would drop it)
            return {name: copy.deepcopy(p) if quantized(p) else p.detach().clone() for name, p in host.items()}
        return {name: p.to(self.device, non_blocking=True) for name, p in host.items()}

    def _start_prefetch(self, position: int) -> None:
        if not 0 <= position < len(self.blocks) or self.stream is None:
            return
        with torch.cuda.stream(self.stream):
            copies = self._copy(position)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._ahead = (position, copies, event)

    def fetch(self, block: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The block's frozen weights on the device; starts copying the next block (the one after it
        going forward, the one before it going backward)."""
        position = self.order[id(block)]
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == position:
            self.prefetch_hits += 1
            torch.cuda.current_stream(self.device).wait_event(ahead[2])
            copies = ahead[1]
            for t in copies.values():  # used on the compute stream now: the allocator must wait for it
                t.record_stream(torch.cuda.current_stream(self.device))
        else:
            copies = self._copy(position)
        backward = torch._C._current_graph_task_id() != -1  # a recompute inside backward walks the blocks down
        self._start_prefetch(position + (-1 if backward else 1))
        return copies

    def call(self, block: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with _reparametrize_module(block, self.fetch(block)):
            return block(*args, **kwargs)

    def summary(self) -> dict[str, Any]:
        return {"swapped_blocks": len(self.blocks), "host_gb": round(sum(map(frozen_bytes, self.blocks)) / 2**30, 3),
                "copies": self.copies, "prefetch_hits": self.prefetch_hits}


class _SwappedCall:
    """What a swapped ModuleList yields instead of a block: calling it runs the block with its
    weights fetched. The model code only calls its blocks (directly or through the checkpoint
    function, which calls `__call__`)."""

    def __init__(self, swap: BlockSwap, block: torch.nn.Module):
        self.swap, self.block = swap, block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.swap.call(self.block, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.block, name)


def block_of(module: Any) -> Any:
    """The block itself, for a block or the `_SwappedCall` a swapped list yields in its place."""
    return module.block if isinstance(module, _SwappedCall) else module


class SwappedModuleList(torch.nn.ModuleList):
    """A ModuleList whose iteration yields `_SwappedCall`s for its swapped members. Parameters,
    state dicts and module names are untouched (they read `_modules`, not iteration)."""

    _block_swap: BlockSwap

    def __iter__(self) -> Iterator[Any]:
        swap = self._block_swap
        return iter([_SwappedCall(swap, b) if id(b) in swap.order else b for b in self._modules.values()])


def install_block_swap(model: torch.nn.Module, n_blocks: int, device: torch.device) -> BlockSwap | None:
    """Swap the last `n_blocks` repeated blocks of `model` (call after LoRA is attached, so its
    parameters are known as trainable and stay on the device). None when there is nothing to swap."""
    blocks = repeated_blocks(model)
    if n_blocks <= 0 or not blocks:
        return None
    swap = BlockSwap(device, blocks[len(blocks) - min(n_blocks, len(blocks)):])
    for _, blocks_list in repeated_block_lists(model):
        if any(id(b) in swap.order for b in blocks_list):
            blocks_list.__class__ = SwappedModuleList
            blocks_list._block_swap = swap
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the blocks' device memory is free now: give it back to the budget
    return swap


def move_unswapped(model: torch.nn.Module, swap: BlockSwap | None, device: torch.device) -> None:
    """Move every parameter and buffer except the swapped blocks' frozen weights to `device` (a base
    loaded into host memory for swapping: only what stays resident ever reaches the GPU)."""
    swapped = {id(p) for params in (swap.host.values() if swap else ()) for p in params.values()}
    for p in model.parameters():
        if id(p) not in swapped:
            p.data = p.data.to(device)
            if quantized(p):
                p.quant_state.to(device)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
