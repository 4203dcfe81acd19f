"""Several processes, one per GPU, through torch.distributed; started by torchrun or accelerate.

    torchrun --standalone --nproc-per-node 2 pipeline.py train --config configs/flux-dev.toml
    lorapipe run --config configs/flux-dev.toml --gpus 2     (each stage through torchrun)

The launcher sets RANK, WORLD_SIZE and LOCAL_RANK (torchrun and `accelerate launch` both do); a
process started without them is the usual single process and nothing here does any work. The
backend is NCCL when the stage runs on CUDA, gloo on CPU (the tests use 2 CPU processes).

Who does what: every rank computes the same plan from the same inputs; rank 0 alone holds the stage
lock and writes events, stores' layout and manifests; `main_first` lets rank 0 prepare shared files
before the others touch them; `shard` deals out disjoint work; `batch_slice` cuts a global training
batch into per-rank slices; `average_gradients` averages the LoRA gradients across ranks.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence, TypeVar

if TYPE_CHECKING:  # torch is imported where a process group is used: `status` and a no-op `run` import this module
    import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Dist:
    """This process's place in the job; the default is a plain single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: no process group (one process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def device(self) -> torch.device:
        """Where collectives' tensors live: NCCL needs them on this rank's GPU."""
        import torch

        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _wants_cuda(device: str) -> bool:
    import torch

    return device != "cpu" and torch.cuda.is_available()


@contextlib.contextmanager
def process_group(device: str) -> Iterator[Dist]:
    """Join the job the launcher described (env:// rendezvous) for the body, and leave it after.

    A group that already exists (made by a test, or by accelerate in-process) is used and left
    alone. On CUDA each rank takes the GPU of its LOCAL_RANK before anything allocates, so
    `torch.device("cuda")` and bitsandbytes' loader (which uses the current device) land on it.
    """
    import torch
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        yield _current(device)
        return
    if env_world_size() <= 1:
        yield Dist()
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if _wants_cuda(device) else "gloo"
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local_rank} but this host has {torch.cuda.device_count()} GPU(s): "
                               f"launch at most that many processes per node (--nproc-per-node / --gpus)")
        torch.cuda.set_device(local_rank)
    # device_id binds NCCL to this rank's GPU (barriers then need not guess it from the context)
    device_id = torch.device("cuda", local_rank) if backend == "nccl" else None
    tdist.init_process_group(backend, init_method="env://", device_id=device_id)
    try:
        yield _current(device)
    finally:
        tdist.destroy_process_group()


def _current(device: str) -> Dist:
    import torch
    import torch.distributed as tdist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = tdist.get_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    return Dist(tdist.get_rank(), tdist.get_world_size(), local_rank, backend)


def barrier(d: Dist) -> None:
    if d.is_distributed:
        import torch.distributed as tdist

        tdist.barrier()


@contextlib.contextmanager
def main_first(d: Dist) -> Iterator[None]:
    """Rank 0 runs the body first (creating or growing shared stores); the others run it after."""
    if not d.is_main:
        barrier(d)
    yield
    if d.is_main:
        barrier(d)


def shard(items: Sequence[T], d: Dist, first: int = 0) -> list[T]:
    """This rank's disjoint share of a list every rank computed identically: dealt round robin
    (a sorted list gives every rank a similar mix), the first item to rank `first` (to continue a
    deal after rank 0 took some items alone)."""
    return list(items[(d.rank - first) % d.world_size::d.world_size])


def batch_slice(n: int, d: Dist) -> slice:
    """This rank's contiguous part of a global batch of n items; sizes differ by at most one.

    A short last batch of a bucket (n < world size) leaves some ranks empty: they run one item with
    weight 0 so that every rank joins the gradient all-reduce (see `loss_weight`).
    """
    base, extra = divmod(n, d.world_size)
    start = d.rank * base + min(d.rank, extra)
    return slice(start, start + base + (1 if d.rank < extra else 0))


def loss_weight(n_global: int, d: Dist) -> float:
    """Factor on this rank's mean loss so that the gradient average over ranks equals the
    single-process mean over the global batch: averaging gives (1/W) sum_r grad(L_r), and with
    L_r = mean_r * n_r * W / n that is (1/n) sum_i grad(l_i). Equal slices give 1.0 (no change);
    an empty slice (running one item to keep step with the others) gives 0."""
    part = batch_slice(n_global, d)
    return (part.stop - part.start) * d.world_size / n_global


def all_gather(obj: Any, d: Dist) -> list[Any]:
    """Every rank's `obj`, in rank order (picklable objects)."""
    if not d.is_distributed:
        return [obj]
    import torch.distributed as tdist

    out: list[Any] = [None] * d.world_size
    tdist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any, d: Dist) -> Any:
    """Rank 0's `obj` on every rank."""
    if not d.is_distributed:
        return obj
    import torch.distributed as tdist

    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flags: Sequence[bool], d: Dist) -> list[bool]:
    """Element-wise OR of boolean flags over all ranks (one small all-reduce)."""
    if not d.is_distributed:
        return list(flags)
    import torch
    import torch.distributed as tdist

    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=d.device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def mean_over_ranks(value: torch.Tensor, d: Dist) -> torch.Tensor:
    """Average of a scalar over ranks (the reported loss equals the single-process batch mean)."""
    if not d.is_distributed:
        return value
    import torch.distributed as tdist

    t = value.detach().float().reshape(1).to(d.device)
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    return t[0] / d.world_size


def broadcast_params(params: Sequence[torch.nn.Parameter], d: Dist) -> None:
    """Rank 0's values of the trainable (LoRA) parameters on every rank, once before training.
    Every rank loaded the same base and drew the same LoRA init from the same seed; this makes the
    replicas identical by construction instead of by luck (CUDA init kernels, peft versions)."""
    if not d.is_distributed:
        return
    import torch.distributed as tdist

    for p in params:
        tdist.broadcast(p.data, src=0)


def average_gradients(params: Sequence[torch.nn.Parameter], d: Dist) -> None:
    """Replace each trainable parameter's gradient by its mean over ranks, as DDP's reducer does.

    Why not DistributedDataParallel itself: the trainer may replay the denoiser as CUDA graphs
    (stages/core/fastpath.py), and DDP's forward bookkeeping (prepare_for_backward) runs on the
    host, so a replayed graph would skip it. The frozen base (bf16 or nf4) has no gradients and is
    never communicated. One flat all-reduce after backward: a FLUX r16 attention LoRA is ~19 M fp32
    gradients (~75 MB), well under a millisecond over NVLink against a step of seconds, so DDP's
    overlap of communication with backward would buy nothing measurable here.
    """
    if not d.is_distributed:
        return
    import torch
    import torch.distributed as tdist

    grads = [p.grad for p in params if p.grad is not None]
    if len(grads) != len(params):
        raise RuntimeError(f"{len(params) - len(grads)} LoRA parameters got no gradient this step; every rank "
                           f"must train all of them (check train.target_modules)")
    flat = torch.cat([g.reshape(-1) for g in grads])
    tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)
    flat /= d.world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class _Silent:
    """Stand-in for events.Progress on ranks other than 0 (one progress display per job)."""

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def advance(self, n: int = 1, **info: Any) -> None:
        return None


def progress(d: Dist, label: str, total: int, unit: str = "items") -> Any:
    from stages.core.events import Progress

    return Progress(label, total, unit) if d.is_main else _Silent()
