"""How busy the GPU was while a stage's encode loop ran, for its summary ("GPU busy 93%"): NVML's utilization
(the share of each sample period in which a kernel ran on the device, other processes' kernels included on a
shared GPU), sampled in a thread.

    with GpuBusy(rt.device) as busy:
        ...                      # the encode loop
    busy.share                   # mean over the samples (0-1), or None off CUDA, without NVML or with no sample
"""

from __future__ import annotations

import threading
from typing import Any, Callable

PERIOD_S = 0.2  # NVML's utilization covers the last 1/6-1 s: a sample every 0.2 s sees every period


class GpuBusy:
    def __init__(self, device: Any, sample: Callable[[], float | None] | None = None) -> None:
        """`sample` reads the utilization in percent (None: no reading); by default NVML's for `device`."""
        self._sample = sample if sample is not None else nvml_sampler(device)
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GpuBusy":
        if self._sample is not None:
            self._thread = threading.Thread(target=self._loop, name="gpu-busy", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(PERIOD_S):
            value = self._sample()
            if value is not None:
                self._samples.append(value)

    @property
    def share(self) -> float | None:
        return round(sum(self._samples) / len(self._samples) / 100, 3) if self._samples else None


def nvml_sampler(device: Any) -> Callable[[], float | None] | None:
    """A reader of the CUDA `device`'s utilization through NVML (nvidia-ml-py's pynvml); None on another device
    or where NVML cannot be opened."""
    if getattr(device, "type", device) != "cuda":
        return None
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        index = device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(index).uuid}")
    except Exception:  # ImportError, pynvml.NVMLError and its subclasses: no reading here
        return None

    def sample() -> float | None:
        try:
            return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # a transient NVML failure is one missing sample
            return None

    return sample
