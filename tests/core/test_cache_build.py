"""The cache stages' encode loop (stages/core/cache_build.py encode_units): a unit's finish (its row copied to
the host and written) runs only once the next unit's encode is queued, every unit is finished exactly once, in
order, also when an encode, a finish or a stop fails mid-run, and before the rows are flushed; and the host
copies around it (stages/core/host_copies.py) pin memory on a CUDA GPU only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stages.core.cache_build import encode_units
from stages.core.distributed import Dist


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def emit(self, event: str, **fields) -> None:
        self.events.append((event, fields))


def loop(units, calls: list[str], *, returns_none=(), fails_encode=None, fails_finish=None,
         finish_error: BaseException = RuntimeError("finish failed"), prepare=None):
    """encode_units over `units` with callables that record their calls in `calls`: `encode u` when u's
    encode runs, `finish u` when its finish does, `flush` when rows are flushed."""
    def encode(unit, *prepared):
        calls.append(f"encode {unit}" + (f" {prepared[0]}" if prepared else ""))
        if unit == fails_encode:
            raise ValueError(f"encode {unit} failed")
        if unit in returns_none:
            return None

        def finish():
            calls.append(f"finish {unit}")
            if unit == fails_finish:
                raise finish_error
        return finish

    ctx = SimpleNamespace(dist=Dist(), log=Log())
    stats = encode_units(ctx, "test", "items", units, encode, size=lambda u: 1, needs_store=lambda u: False,
                         reopen=lambda: None, done_before=0, total=len(units), prepare=prepare,
                         flush=lambda: calls.append("flush"))
    return stats, ctx.log.events


def test_a_unit_is_finished_after_the_next_units_encode_is_queued():
    calls: list[str] = []
    stats, events = loop([0, 1, 2, 3, 4], calls, returns_none={2})  # 2 is finished at once (as encode-captions)
    assert calls == ["encode 0", "encode 1", "finish 0", "encode 2", "finish 1", "encode 3", "encode 4", "finish 3",
                     "finish 4", "flush"]
    assert stats["units"] == 5 and 0 < stats["encode_seconds"] <= stats["seconds"]
    assert [f["encoded"] for e, f in events if e == "preparing"][-1] == 5  # counted as finished, all of them


def test_prepared_values_reach_their_own_unit():
    calls: list[str] = []
    loop([1, 2, 3], calls, prepare=lambda u: u * 10)
    assert calls == ["encode 1 10", "encode 2 20", "finish 1", "encode 3 30", "finish 2", "finish 3", "flush"]


@pytest.mark.parametrize("failure, error", [
    (dict(fails_encode=3), ValueError),
    (dict(fails_finish=1), RuntimeError),  # its row's write failed (a full disk, say)
    (dict(fails_finish=1, finish_error=KeyboardInterrupt()), KeyboardInterrupt),  # SIGTERM after its row
])
def test_a_failure_mid_run_still_finishes_what_was_encoded_before_flushing(failure, error):
    """encode 3 fails: 2, encoded before it, keeps its row. finish 1 fails or is stopped: 2, already queued, is
    still written. Nothing after the failure is encoded; the error is raised after the flush."""
    calls: list[str] = []
    with pytest.raises(error):
        loop([0, 1, 2, 3, 4], calls, **failure)
    if "fails_encode" in failure:
        assert calls == ["encode 0", "encode 1", "finish 0", "encode 2", "finish 1", "encode 3", "finish 2", "flush"]
    else:
        assert calls == ["encode 0", "encode 1", "finish 0", "encode 2", "finish 1", "finish 2", "flush"]


def test_host_copies_off_cuda_leave_tensors_as_they_are():
    import torch

    from stages.core.host_copies import pinned, to_host

    cpu = torch.device("cpu")
    x = torch.randn(2, 3, 8, 8)
    assert pinned(x, cpu) is x and not x.is_pinned()
    tensors = {"mean": x}
    assert to_host(tensors, cpu)() is tensors


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_on_cuda_pixels_are_pinned_and_rows_arrive_in_pinned_memory_with_the_gpus_bytes():
    import torch

    from stages.core.host_copies import pinned, to_host

    gpu = torch.device("cuda")
    x = torch.randn(4, 3, 256, 256)
    p = pinned(x, gpu)
    assert p.is_pinned() and torch.equal(p, x)
    on_gpu = p.to(gpu, non_blocking=True)
    mean = (on_gpu.bfloat16() @ on_gpu.bfloat16().transpose(-1, -2)).float()  # work still queued when copied
    arrived = to_host({"mean": mean}, gpu)
    host = arrived()["mean"]
    assert host.device.type == "cpu" and host.is_pinned() and torch.equal(host, mean.cpu())
