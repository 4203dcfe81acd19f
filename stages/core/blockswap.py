"""Block swap: the frozen base's repeated blocks live in (pinned) host memory and visit the GPU one
at a time, for forward, for the recompute of gradient checkpointing, and for backward.

    swap = install_block_swap(model, n_blocks=28, device=torch.device("cuda"))   # before training
    swap.summary()   # {"swapped_blocks": 28, "host_gb": ..., "prefetch": ...}

How it works (same math as the unswapped model, only placement changes):
- The blocks are the members of the model's ModuleLists whose class is in diffusers'
  `_repeated_blocks` (FLUX: FluxTransformerBlock + FluxSingleTransformerBlock, 19 + 38; Qwen-Image:
  60 QwenImageTransformerBlock; Z-Image: 30 ZImageTransformerBlock; SDXL: its 70 BasicTransformerBlock
  inside the attention layers), in the order the model lists them, which is the order the DiT families
  run them in (SDXL's UNet lists down, up, mid and runs down, mid, up). Which `n_blocks` of them are
  swapped is `swapped_positions`' choice: the last ones (runtime.block_swap_layout = "last", the
  default), or spread evenly among them ("spread"; refused for SDXL, whose next block in the list is
  not always the next one run).
- A swapped block's frozen parameters are packed into one buffer in host memory (pinned on CUDA;
  blocks share power-of-two chunks, `host_chunks`, as the pinned allocator rounds every allocation up
  to one); each parameter becomes a view of it. Trainable parameters (LoRA A/B) stay on the GPU and stay the
  block's own, so the optimizer state stays there too.
- The GPU holds two slots, each the size of the largest swapped block. Block k runs from slot k % 2:
  one copy of its packed buffer (one host-to-device transfer per block), made on a side stream while
  the block before it computes (forward), or the block after it (the recompute of checkpointing in
  backward, which walks the blocks down). A prefetch waits for the compute stream to finish what it
  had queued, which includes the last use of the slot it writes. Nothing is allocated per call: the
  slot views the block runs with are made once, so the caching allocator never sees the traffic.
- The model's loops iterate those ModuleLists; the swapped lists yield a `SwappedCall` in place of
  the block, which runs the block with the slot views substituted for its parameters
  (`torch.nn.utils.stateless._reparametrize_module`).
- Slots are reused two blocks later, so they serve only calls that keep no weights for backward:
  under gradient checkpointing (its forward saves nothing; the recompute fetches the block again and
  that block's backward runs before the block below is recomputed) or without gradients. The planner
  checkpoints every block whenever it swaps; a swapped block run with gradients but not checkpointed
  gets copies of its own (correct, allocated per call).
- Regional compile (`compile_repeated_blocks`) compiles the block's own `__call__`; the copying
  happens outside it, and the substituted weights are ordinary inputs to the compiled graph (dynamo
  treats module parameters as inputs; the same view objects every call, so its guards hold).
- CUDA graphs (fastpath.GraphedDenoiser) capture the copies too: host-to-device copies from the pinned
  buffers into the slots on the side stream, forked from and joined back to the capture stream by
  the events above, so a replay copies each swapped block again and the weights stay in host
  memory. The graph's pool holds activations only; the slots are allocated outside it. Under
  runtime.cuda_graphs = "auto" a swap plan captures only where the budget has room for it
  (fastpath.SWAP_GRAPHS, CaptureRoom: capturing needed memory the plan had not got at 4 and 6 GB),
  else runs eager; on full-width Qwen-Image blocks (8, 6 swapped, nf4, 1024 px; bench/swap_probe.py)
  the swapped step took 1.05x the unswapped one compiled without graphs (20 steps) and 1.09x under
  graphs.
- nf4 (bitsandbytes Params4bit): a block's quant_state (absmax and code tables, a few percent of its
  bytes with double quantization) stays on the GPU; only the 4-bit codes travel, and each slot view
  is a Params4bit carrying its block's quant_state. A plan that swaps an nf4 base loads it quantized
  block by block (stages/core/nf4_blocks.py), so the swapped blocks never reach the GPU whole.
"""

from __future__ import annotations

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


SWAP_LAYOUTS = ("last", "spread")


def swapped_positions(n_blocks: int, swapped: int, layout: str = "last") -> list[int]:
    """Which of `n_blocks` repeated blocks (in execution order) a plan that swaps `swapped` of them keeps
    in host memory; the planner, the nf4 load and `install_block_swap` all ask here. "last": the last
    ones. "spread": evenly among all blocks, the last block among them (so the recompute still starts
    with the forward's last two swapped blocks in the slots). A copy runs on the side stream while the
    blocks before its own compute: with "last" only the swapped blocks, whose compute at small images
    is shorter than a copy (512 px, Qwen-Image nf4: ~3.2 ms a copy, ~0.8 ms a block pass), so the
    resident blocks' compute and the copies add up; "spread" puts resident blocks between swapped ones
    for the copies to overlap. Same math either way (only placement changes)."""
    if layout not in SWAP_LAYOUTS:
        raise ValueError(f"block swap layout {layout!r} is not one of {', '.join(SWAP_LAYOUTS)}")
    k = max(0, min(swapped, n_blocks))
    if layout == "last" or k == 0:
        return list(range(n_blocks - k, n_blocks))
    return [(j + 1) * n_blocks // k - 1 for j in range(k)]


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [b for _, blocks in repeated_block_lists(model) for b in blocks]


def quantized(p: torch.Tensor) -> bool:
    """A bitsandbytes Params4bit that holds quantized weights (its quant_state travels with it)."""
    return getattr(p, "quant_state", None) is not None


def frozen_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)


ALIGN = 256  # byte alignment of each tensor inside a block's packed buffer (as cudaMalloc's)
SLOTS = 2  # device buffers a swapped block is copied into: the block running and the next one


def _packed_layout(params: dict[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """Byte offset of each tensor in one flat buffer (ALIGN-aligned), and the buffer's size."""
    offsets, size = {}, 0
    for name, p in params.items():
        offsets[name] = size
        size += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
    return offsets, size


def host_chunks(sizes: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Where each block's packed buffer goes in host memory: (chunk sizes, (chunk, offset) per block).
    torch's pinned allocator rounds every allocation up to a power of two (a 162 MB Qwen-Image nf4
    block would pin 256 MB), so blocks share chunks of a power-of-two size (1 GiB, or the power of two
    at least 4x the largest block), filled in order; the last chunk is cut to what it holds."""
    if not sizes:
        return [], []
    chunk = max(2**30, 1 << (4 * max(sizes) - 1).bit_length())
    chunks, where = [], []
    for size in sizes:
        if not chunks or chunks[-1] + size > chunk:
            chunks.append(0)
        where.append((len(chunks) - 1, chunks[-1]))
        chunks[-1] += size
    return chunks, where


def _view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    n = like.numel() * like.element_size()
    return flat[offset:offset + n].view(like.dtype).view(like.shape)


def _alias(p: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """What a swapped block runs with in place of its frozen parameter `p`: a tensor over `data` (a
    Params4bit keeps its quant_state, as bitsandbytes' own `Params4bit.to` builds one)."""
    if not quantized(p):
        return data
    return type(p)(data, requires_grad=False, quant_state=p.quant_state, blocksize=p.blocksize,
                   compress_statistics=p.compress_statistics, quant_type=p.quant_type,
                   quant_storage=p.quant_storage, bnb_quantized=True)


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
        self._ahead: tuple[int, Any] | None = None  # (position, event of its copy) of the block copied ahead
        self._flat: list[torch.Tensor] = []  # per position: the block's frozen weights, packed (pinned on CUDA)
        for k, block in enumerate(self.blocks):
            self.order[id(block)] = k
            self.host[id(block)] = {n: p for n, p in block.named_parameters() if not p.requires_grad}
        offsets, sizes = zip(*(_packed_layout(self.host[id(b)]) for b in self.blocks))
        chunk_sizes, where = host_chunks(list(sizes))
        pinned = self.stream is not None
        self._chunks = [torch.empty(n, dtype=torch.uint8, pin_memory=pinned) for n in chunk_sizes]
        for k, block in enumerate(self.blocks):
            c, at = where[k]
            self._flat.append(self._to_host(self.host[id(block)], offsets[k], self._chunks[c][at:at + sizes[k]]))
        slot_bytes = max(flat.numel() for flat in self._flat)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)
                      for _ in range(min(SLOTS, len(self.blocks)))]
        # per position: the tensors the block runs with, views of its slot (made once: no allocation per call)
        self._views = [{name: _alias(p, _view(self.slots[k % len(self.slots)], offsets[k][name], p))
                        for name, p in self.host[id(block)].items()} for k, block in enumerate(self.blocks)]
        self._in_slot: list[int | None] = [None] * len(self.slots)  # the position each slot holds (as enqueued)
        self._captured = False  # a CUDA graph captured copies: its replays write the slots behind Python's back
        self.still_in_slot = 0  # fetches that found their block still in its slot and copied nothing

    def _to_host(self, params: dict[str, torch.nn.Parameter], offsets: dict[str, int], flat: torch.Tensor) -> torch.Tensor:
        """Pack the block's frozen weights into `flat`, its share of a host chunk (pinned on CUDA, so
        copies are asynchronous); each parameter becomes a view of it. A Params4bit's quant_state
        (absmax and code tables, a few percent of its bytes) stays on the device: only the 4-bit
        codes travel."""
        for name, p in params.items():
            view = _view(flat, offsets[name], p)
            view.copy_(p.data)
            p.data = view
            if quantized(p):
                p.quant_state.to(self.device)
        return flat

    def _copy_into_slot(self, position: int) -> None:
        self.copies += 1
        flat, slot = self._flat[position], position % len(self.slots)
        self.slots[slot][:flat.numel()].copy_(flat, non_blocking=True)
        self._in_slot[slot] = position

    def _still_in_slot(self, position: int) -> bool:
        """Whether block `position`'s slot holds it already (counted in `still_in_slot`)."""
        if self._captured or self._in_slot[position % len(self.slots)] != position:
            return False
        self.still_in_slot += 1
        return True

    def _start_prefetch(self, position: int) -> None:
        """Copy block `position` into its slot ahead of use: on CUDA on the side stream, once the
        compute stream has finished what it queued so far (the last use of that slot); on CPU now.
        Nothing to copy when the slot still holds it (the compute stream has waited for every copy
        before the fetch that starts this one)."""
        if not 0 <= position < len(self.blocks):
            return
        done = None  # the event the fetch waits for (None: nothing copied, or copied already on CPU)
        if not self._still_in_slot(position):
            if self.stream is None:
                self._copy_into_slot(position)
            else:
                queued = torch.cuda.Event()
                queued.record(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(queued)
                    self._copy_into_slot(position)
                    done = torch.cuda.Event()
                    done.record(self.stream)
        self._ahead = (position, done)

    def fetch(self, block: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The block's frozen weights on the device, in its slot; starts copying the next block (the
        one after it going forward, the one before it going backward) into the other slot. A block
        not copied ahead is copied now, unless its slot still holds it (the recompute's first two
        blocks are the forward's last two: two copies a step saved, and with one or two blocks
        swapped nothing is copied after the first step); once a CUDA graph has captured copies, its
        replays refill the slots where Python does not see it, and every such fetch copies."""
        position = self.order[id(block)]
        self._captured |= self.stream is not None and torch.cuda.is_current_stream_capturing()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[1] is not None:  # its copy (this block's, or one still writing a slot)
            torch.cuda.current_stream(self.device).wait_event(ahead[1])
        if ahead is not None and ahead[0] == position:
            self.prefetch_hits += 1
        elif not self._still_in_slot(position):  # e.g. the recompute's first block is the forward's last
            self._copy_into_slot(position)  # on the compute stream: after the slot's last use there
        backward = torch._C._current_graph_task_id() != -1  # a recompute inside backward walks the blocks down
        self._start_prefetch(position + (-1 if backward else 1))
        return self._views[position]

    def forget(self) -> None:
        """After a failed CUDA graph capture: the copy it left pending was recorded inside the capture
        (its event cannot be waited on outside it) and what the slots hold is unknown, so the next
        fetch copies its block on the compute stream."""
        self._ahead = None
        self._in_slot = [None] * len(self.slots)

    def release_slots(self) -> None:
        """Give the slots' device memory back while another model has the GPU (sample's offloaded pipeline: a
        text encoder or the VAE runs between the denoiser's calls). The views stay, over storage of size 0, and
        every copy still in flight finishes first; `restore_slots` before the next call."""
        if self.stream is not None:
            self.stream.synchronize()  # no copy may write a slot's memory once the allocator hands it out again
        self.forget()
        for slot in self.slots:
            slot.untyped_storage().resize_(0)

    def restore_slots(self) -> None:
        """The slots' device memory again after `release_slots` (what they held is gone: each block is copied
        anew at its first fetch)."""
        for slot in self.slots:
            storage = slot.untyped_storage()
            if storage.nbytes() < slot.numel():  # uint8: one byte an element
                storage.resize_(slot.numel())

    def fresh_copies(self, block: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Copies of the block's weights of its own (not a slot's), for a call whose autograd graph
        keeps them until backward: a swapped block run with gradients but without checkpointing."""
        self.copies += 1
        return {name: _alias(p, p.detach().to(self.device, non_blocking=True, copy=True))
                for name, p in self.host[id(block)].items()}

    def call(self, block: torch.nn.Module, *args: Any, checkpointed: bool = False, **kwargs: Any) -> Any:
        """Run the block with its weights on the device. The slots are reused two blocks later, so
        they serve a call that saves nothing for backward: under checkpointing (the recompute in
        backward fetches the block again, and its backward runs before the block below is
        recomputed) or without gradients. Any other call gets copies of its own."""
        slots_safe = checkpointed or not torch.is_grad_enabled()
        with _reparametrize_module(block, self.fetch(block) if slots_safe else self.fresh_copies(block)):
            return block(*args, **kwargs)

    def summary(self) -> dict[str, Any]:
        return {"swapped_blocks": len(self.blocks), "host_gb": round(sum(map(frozen_bytes, self.blocks)) / 2**30, 3),
                "host_chunks_gb": round(sum(c.numel() for c in self._chunks) / 2**30, 3),
                "slot_gb": round(sum(s.numel() for s in self.slots) / 2**30, 3),
                "copies": self.copies, "prefetch_hits": self.prefetch_hits, "still_in_slot": self.still_in_slot}


class SwappedCall:
    """What a swapped ModuleList yields instead of a block: calling it runs the block with its
    weights fetched. The model code only calls its blocks (directly or through the checkpoint
    function, which calls `__call__`)."""

    def __init__(self, swap: BlockSwap, block: torch.nn.Module):
        self.swap, self.block = swap, block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.swap.call(self.block, *args, **kwargs)

    def checkpointed(self, *args: Any, **kwargs: Any) -> Any:
        """The call gradient checkpointing makes (stages/core/fastpath.py): forward and recompute."""
        return self.swap.call(self.block, *args, checkpointed=True, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.block, name)


def block_of(module: Any) -> Any:
    """The block itself, for a block or the `SwappedCall` a swapped list yields in its place."""
    return module.block if isinstance(module, SwappedCall) else module


class SwappedModuleList(torch.nn.ModuleList):
    """A ModuleList whose iteration yields `SwappedCall`s for its swapped members. Parameters,
    state dicts and module names are untouched (they read `_modules`, not iteration)."""

    _block_swap: BlockSwap

    def __iter__(self) -> Iterator[Any]:
        swap = self._block_swap
        return iter([SwappedCall(swap, b) if id(b) in swap.order else b for b in self._modules.values()])


def installed_swap(model: torch.nn.Module) -> BlockSwap | None:
    """The swap `install_block_swap` installed in `model`, if any."""
    return next((m._block_swap for m in model.modules() if isinstance(m, SwappedModuleList)), None)


def forget_slots(model: torch.nn.Module) -> None:
    """`BlockSwap.forget` for the swap installed in `model`, if any."""
    if (swap := installed_swap(model)) is not None:
        swap.forget()


def install_block_swap(model: torch.nn.Module, n_blocks: int, device: torch.device,
                       layout: str = "last") -> BlockSwap | None:
    """Swap `n_blocks` repeated blocks of `model`, those `swapped_positions` picks for `layout` (call
    after LoRA is attached, so its parameters are known as trainable and stay on the device). None when
    there is nothing to swap."""
    blocks = repeated_blocks(model)
    if n_blocks <= 0 or not blocks:
        return None
    swap = BlockSwap(device, [blocks[i] for i in swapped_positions(len(blocks), n_blocks, layout)])
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
