"""The GPU busy share of the cache stages' summary (stages/core/gpu_busy.py): the mean of the utilization samples
taken while the block ran, none off CUDA, and the summary line that shows it."""

from __future__ import annotations

import itertools
import time

from stages.core import gpu_busy
from stages.core.events import _summary_parts
from stages.core.gpu_busy import GpuBusy


def test_the_share_is_the_mean_of_the_samples_taken_while_the_block_ran(monkeypatch):
    monkeypatch.setattr(gpu_busy, "PERIOD_S", 0.005)
    readings = itertools.chain([90.0, None, 50.0, 10.0], itertools.repeat(None))  # None: no reading, left out
    with GpuBusy("cuda", sample=lambda: next(readings)) as busy:
        time.sleep(0.2)
    assert busy.share == 0.5
    calls = itertools.count()
    with GpuBusy("cuda", sample=lambda: (next(calls), None)[1]) as stopped:
        time.sleep(0.05)
    taken = next(calls)
    time.sleep(0.05)
    assert next(calls) == taken + 1, "sampling stops with the block"
    assert stopped.share is None


def test_off_cuda_there_is_no_sampler_and_no_share():
    assert gpu_busy.nvml_sampler("cpu") is None
    with GpuBusy("cpu") as busy:
        time.sleep(0.01)
    assert busy.share is None


def test_the_summary_line_shows_it_where_it_was_measured(tmp_path):
    done = {"total": 10, "encoded": 10, "images_per_second": 12.5, "encoder_busy": 0.9}
    assert _summary_parts(done, 0, tmp_path)[0] == "10 of 10 encoded this run (12.5 images/s, encoder busy 90%)"
    assert _summary_parts({**done, "gpu_busy": 0.934}, 0, tmp_path)[0] == \
        "10 of 10 encoded this run (12.5 images/s, encoder busy 90%, GPU busy 93%)"
