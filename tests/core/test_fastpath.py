"""The CUDA-graph wrapper (`stages.core.fastpath`), on CPU with a stand-in for the capture: when it
captures, what it replays, where it falls back to eager, and when the plan turns graphs on.

    .venv/bin/python -m pytest -q tests/core/test_fastpath.py
"""

from __future__ import annotations

import pytest
import torch

from stages.core import fastpath


class _Log:
    def __init__(self):
        self.events = []

    def emit(self, event, **fields):
        self.events.append((event, fields))


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.lin.weight.requires_grad_(False)
        self.lora = torch.nn.Parameter(torch.randn(4, 4))
        self.calls = 0

    @property
    def dtype(self):
        return self.lin.weight.dtype

    def forward(self, x, scale=1.0, extra=None, return_dict=True):
        self.calls += 1
        y = (self.lin(x) + x @ self.lora) * scale
        if extra is not None:
            y = y + sum(e.sum() for e in extra)
        return (y,)


class _Half:
    def __rmul__(self, y):
        return y * 0.5


def _fake_capture(record):
    def capture(fn, sample_args, pool):
        record.append([tuple(a.shape) for a in sample_args])
        return fn  # "replay" runs the function itself: checks the argument plumbing, not CUDA
    return capture


def test_graphed_denoiser_captures_at_second_call_per_shape():
    model, log, record = _Model(), _Log(), []
    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=_fake_capture(record))
    x = torch.randn(2, 4)
    assert g.dtype == model.lin.weight.dtype  # attributes come from the model
    out1 = g(x, scale=2.0, return_dict=False)[0]
    assert record == [] and g.summary()["graphs"] == 0  # first sight of a shape: eager
    out2 = g(x, scale=2.0, return_dict=False)[0]
    assert record == [[(2, 4), (4, 4)]]  # inputs, then the LoRA parameter
    assert torch.equal(out1, out2)
    g(x, scale=2.0, return_dict=False)
    assert len(record) == 1 and g.summary() == {"graphs": 1, "failed": 0, "replays": 2}
    g(x, scale=3.0, return_dict=False)  # another non-tensor value is another signature: eager first
    assert g.summary()["graphs"] == 1
    g(torch.randn(3, 4), scale=2.0, return_dict=False)
    assert g.summary()["graphs"] == 1


def test_graphed_denoiser_gradients_reach_parameters():
    model, log = _Model(), _Log()
    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=_fake_capture([]))
    x = torch.randn(2, 4)
    grads = []
    for _ in range(3):
        model.lora.grad = None
        g(x, extra=[torch.ones(1)], return_dict=False)[0].square().sum().backward()
        grads.append(model.lora.grad.clone())
    assert g.summary()["replays"] == 2
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[1], grads[2])


def test_graphed_denoiser_capture_failure_runs_eager_with_warning():
    model, log = _Model(), _Log()

    def broken(fn, sample_args, pool):  # the text CUDA gave a Qwen-Image 2.1 capture on the H200
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nSearch for "
                           "`cudaErrorStreamCaptureInvalidated' in https://docs.nvidia.com/cuda/...\nCUDA kernel "
                           "errors might be asynchronously reported at some other API call")

    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=broken)
    x = torch.randn(2, 4)
    for _ in range(4):
        g(x, return_dict=False)
    assert g.summary() == {"graphs": 0, "failed": 1, "replays": 0}
    assert model.calls == 4
    (event, fields), = log.events
    assert event == "warning" and "CUDA graph capture failed" in fields["message"] and "eager" in fields["message"]
    assert fields["message"].endswith("RuntimeError: CUDA error: operation failed due to a previous error during capture")


def test_a_failed_capture_frees_its_tensors_before_the_cache_is_released(monkeypatch):
    """What the failed capture allocated (held by the exception's frames while it is being handled) is
    gone when `_release_graph_memory` empties the CUDA cache, so the eager steps get that memory."""
    import weakref

    model, log, refs, alive = _Model(), _Log(), [], []

    def broken(fn, sample_args, pool):
        out = fn(*sample_args)  # the capture's forward ran: its output lives in this frame
        refs.append(weakref.ref(out[0]))
        raise RuntimeError("CUDA out of memory inside the capture")

    monkeypatch.setattr(fastpath, "_release_graph_memory", lambda: alive.append([r() is not None for r in refs]))
    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=broken)
    for _ in range(2):
        g(torch.randn(2, 4), return_dict=False)
    assert refs and alive == [[False]]
    assert "CUDA out of memory inside the capture" in log.events[0][1]["message"]


def test_after_a_capture_runs_out_of_memory_no_other_shape_is_captured():
    """A capture that ran out of memory stops capturing altogether (another shape would need as much
    room; FLUX.2 klein's capped rows crashed after one), where another failure stops only its shape; the
    graphs captured before keep replaying."""
    model, log, record = _Model(), _Log(), []
    ok = _fake_capture(record)
    tiny, small, big, other = (torch.randn(n, 4) for n in (1, 2, 3, 5))

    def capture(fn, sample_args, pool):
        if sample_args[0].shape[0] == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 486.00 MiB")
        if sample_args[0].shape[0] == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return ok(fn, sample_args, pool)

    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=capture)
    for x in (tiny, tiny, small, small, small):  # tiny's capture fails (not memory), small's is captured
        g(x, return_dict=False)
    assert g.summary() == {"graphs": 1, "failed": 1, "replays": 2}  # the capturing call replays too
    for x in (big, big, other, other, other, small):  # big's runs out of memory: other is never captured
        assert torch.equal(g(x, return_dict=False)[0], model(x, return_dict=False)[0])
    assert len(record) == 1 and g.summary() == {"graphs": 1, "failed": 2, "replays": 3,
                                                "stopped": "a capture ran out of memory"}
    messages = [f["message"] for e, f in log.events if e == "warning"]
    assert len(messages) == 2 and "no other shape" not in messages[0]
    assert "no other shape is captured either" in messages[1] and "486.00 MiB" in messages[1]


def test_graphed_denoiser_skips_no_grad_and_odd_arguments():
    model, log, record = _Model(), _Log(), []
    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=_fake_capture(record))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            g(x, return_dict=False)
    for _ in range(3):
        g(x, scale=_Half(), return_dict=False)  # not a tensor nor a plain value: cannot be part of a key
    assert record == []


def test_graphed_denoiser_respects_max_graphs():
    model, log, record = _Model(), _Log(), []
    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=_fake_capture(record), max_graphs=1)
    for n in (2, 3, 5, 6):
        x = torch.randn(n, 4)
        for _ in range(3):
            g(x, return_dict=False)
    assert len(record) == 1
    # the shapes seen again past the limit run eager: one warning naming the first, not one per step or per
    # shape (every caption length is a shape where captions are cut to the batch's longest); the summary counts them
    warnings = [f["message"] for e, f in log.events if e == "warning"]
    assert len(warnings) == 1 and "(3, 4)" in warnings[0] and "without a CUDA graph" in warnings[0]
    assert "caption length" in warnings[0] and g.summary()["past_limit"] == 3


def test_graphs_plan(monkeypatch):
    from types import SimpleNamespace

    cpu, gpu = SimpleNamespace(is_cuda=False), SimpleNamespace(is_cuda=True)
    assert fastpath.graphs_plan(cpu, 0.0, "auto")[0] is False
    assert fastpath.graphs_plan(gpu, 0.0, "auto")[0] is True
    on, reason = fastpath.graphs_plan(gpu, 0.1, "on")  # even when asked for
    assert on is False and "train.dropout = 0.1" in reason
    assert fastpath.graphs_plan(gpu, 0.0, "off")[0] is False
    # a swap plan: "auto" captures where it has room (checked at the capture: CaptureRoom), "on" captures
    assert fastpath.graphs_plan(gpu, 0.0, "auto", swapped=3) == (True, fastpath.SWAP_GRAPHS)
    assert fastpath.graphs_plan(gpu, 0.0, "on", swapped=3)[0] is True
    monkeypatch.setenv(fastpath.ENV, "sometimes")
    with pytest.raises(ValueError, match=fastpath.ENV):
        fastpath.graphs_mode()




def test_auto_captures_only_with_room_under_the_budget_and_swap_skips_the_side_stream_warmup(monkeypatch):
    """"auto" captures only where the capture has room under the stage's budget (CaptureRoom: 2x the eager
    step's activations free under block swap, 1.45x without: a capture without room ran out of memory at
    FLUX.2 klein's 5.08 GB cap, and so did the eager steps after it); "on" captures regardless. Under
    block swap the capture skips make_graphed_callables' warmup pass (its activations would stay cached
    for a side stream the capture cannot use). No budget (CPU) or an unbounded one: no check."""
    from types import SimpleNamespace

    monkeypatch.delenv(fastpath.ENV, raising=False)
    gpu = SimpleNamespace(is_cuda=True, device=torch.device("cuda"))
    model = torch.nn.Linear(2, 2)
    made, why = {}, {}
    for mode in ("on", "auto"):
        for swapped in (0, 5):
            for budget in (8.0, None, float("inf")):
                den, why[mode, swapped, budget] = fastpath.wrap_denoiser(
                    model, list(model.parameters()), gpu, SimpleNamespace(train=SimpleNamespace(dropout=0.0), runtime=SimpleNamespace(cuda_graphs=mode)),
                    SimpleNamespace(emit=print), swapped=swapped, budget_gb=budget)
                assert isinstance(den, fastpath.GraphedDenoiser)
                made[mode, swapped, budget] = (den._capture.keywords["warmup"], den._room)
    assert fastpath.SWAP_WARMUP_ITERS == 0 and fastpath.WARMUP_ITERS == 1
    for budget in (8.0, None, float("inf")):
        assert made["on", 0, budget] == (1, None) and made["on", 5, budget] == (0, None)  # "on": regardless of room
    for budget in (None, float("inf")):
        assert made["auto", 0, budget] == (1, None) and made["auto", 5, budget] == (0, None)
    for swapped, warmup, factor in ((0, 1, fastpath.UNSWAPPED_CAPTURE_ROOM), (5, 0, fastpath.CAPTURE_ROOM)):
        got, room = made["auto", swapped, 8.0]
        assert got == warmup and isinstance(room, fastpath.CaptureRoom) and room.budget == 8 * 2**30
        assert room.factor == factor
    assert fastpath.UNSWAPPED_CAPTURE_ROOM == 1.45 and fastpath.CAPTURE_ROOM == 2.0
    assert "where 1.45x the eager step's activations are free under the 8 GB budget" in why["auto", 0, 8.0]
    assert "budget" not in why["auto", 0, None] and "budget" not in why["on", 0, 8.0]


class _Room:
    """CaptureRoom's protocol with its answers given, one per check (a capture's, then a new shape's eager step's)."""

    def __init__(self, fits: list[bool], eager: list[bool] = ()):
        self.answers, self.eager, self.first_calls, self.scales = list(fits), list(eager), 0, []

    def first_call(self) -> None:
        self.first_calls += 1

    def check(self) -> tuple[bool, str]:
        return self.answers.pop(0), "figures"

    def eager_fits(self, scale: float) -> tuple[bool, str]:
        self.scales.append(scale)
        return self.eager.pop(0), "eager figures"


def test_without_room_a_shape_runs_eager_and_is_not_asked_again():
    log = _Log()
    model = _Model()
    record: list = []
    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=_fake_capture(record), room=_Room([False, True]))
    small, big = torch.randn(2, 4), torch.randn(3, 4)
    for x in (small, small, small, small):  # no room at its capture: eager, and the room is not checked again
        assert torch.equal(g(x, return_dict=False)[0], model(x, return_dict=False)[0])
    assert record == [] and g.summary() == {"graphs": 0, "failed": 0, "replays": 0, "no_room": 1, "room": ["no room: figures"]}
    for x in (big, big, big):  # another shape, with room: captured at its second call and replayed
        g(x, return_dict=False)
    assert len(record) == 1 and g.summary()["graphs"] == 1 and g.summary()["replays"] == 2
    assert g.summary()["room"] == ["no room: figures", "figures"]
    assert g._room.answers == [] and g._room.first_calls > 0  # asked once per shape; told of the first call
    assert not [e for e, _ in log.events if e == "warning"]  # a plan, not a fault: in the summary, no warning


def test_a_new_shape_whose_eager_step_may_not_fit_beside_the_graphs_releases_them():
    """Under a budget, a batch shape first seen after a capture runs eager beside the graphs' pool: where the room
    says that step may not fit (scaled by how much larger its inputs are), the graphs are released and every step
    runs eager, with a warning; where it fits they stay. Ideogram 4's fp8 plan at an 18.5 GB cap ran out of
    memory at exactly that step."""
    model, log, record = _Model(), _Log(), []
    released: list = []
    room = _Room([True], eager=[True, False])
    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=_fake_capture(record), room=room)
    a, b, c = torch.randn(2, 4), torch.randn(3, 4), torch.randn(4, 4)
    for x in (a, a, a):  # captured at its second call, replayed at its third
        g(x, return_dict=False)
    assert g.summary()["graphs"] == 1 and room.scales == []  # no graph existed at the first shape's first step
    g(b, return_dict=False)  # a new shape: room for its eager step, the graph stays
    assert g.summary()["graphs"] == 1 and room.scales == [1.5] and not [e for e, _ in log.events if e == "warning"]
    fastpath_release = fastpath._release_graph_memory
    try:
        fastpath._release_graph_memory = lambda: released.append(True)
        out = g(c, return_dict=False)[0]  # larger again: no room beside the graph, so it is released first
    finally:
        fastpath._release_graph_memory = fastpath_release
    assert torch.equal(out, model(c, return_dict=False)[0]) and released == [True] and room.scales == [1.5, 2.0]  # against the captured shape's inputs
    warnings = [m["message"] for e, m in log.events if e == "warning"]
    assert len(warnings) == 1 and warnings[0].startswith("CUDA graphs released: batch shape [(4, 4)]")
    assert "eager figures" in warnings[0] and "--vram" in warnings[0]
    for x in (a, a, c, c, c):  # every shape eager from here: nothing captured or replayed again
        g(x, return_dict=False)
    summary = g.summary()
    assert summary["graphs"] == 0 and summary["replays"] == 2 and len(record) == 1  # those of shape a, before
    assert summary["stopped"].startswith("released for a new shape's eager step") and room.answers == []


def test_capture_room_weighs_the_free_budget_against_the_eager_steps_activations(monkeypatch):
    """CaptureRoom's rule with the allocator's figures given (no GPU here): the activations are the
    allocation peak over what was allocated at the first call; free is the budget less what is reserved."""
    GB = 2**30
    figures = {"allocated": 5 * GB, "peak": 5 * GB, "reserved": 5 * GB}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: figures["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: figures["peak"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: figures["reserved"])
    room = fastpath.CaptureRoom(torch.device("cuda"), 8.0, 2.0)
    room.first_call()  # 5 GB allocated before the first step
    figures.update(allocated=5.2 * GB, peak=5.5 * GB, reserved=6.4 * GB)
    room.first_call()  # later calls do not move the base
    fits, why = room.check()
    assert fits is True  # 1.6 GB free >= 2 x 0.5 GB of activations
    assert why == "1.60 GB free under the 8.00 GB budget for a capture that wants 2x the eager step's 0.50 GB of activations"
    figures.update(peak=6 * GB)  # the eager step reached 6 GB: 1.0 GB of activations, 2.0 wanted
    fits, why = room.check()
    assert fits is False and "1.60 GB free" in why and "1.00 GB of activations" in why
    # a new shape's eager step beside the graphs: 1.15x the largest weighed activations (1.0 GB), scaled by its inputs
    fits, why = room.eager_fits(1.2)
    assert fits is True and why.endswith("may want 1.38 GB")  # 1.60 GB free
    fits, why = room.eager_fits(1.5)
    assert fits is False and "1.60 GB free" in why and why.endswith("may want 1.72 GB")
    assert room.eager_fits(0.5)[1].endswith("may want 1.15 GB")  # a smaller shape: never below the measured step
