"""The GPU budget a stage plans for, the caching allocator's settings under a cap, and host memory.

`gpu.vram_budget_gb`: "auto" is the free memory when the stage starts (`torch.cuda.mem_get_info`) less
AUTO_MARGIN_GB; a number is the whole process as nvidia-smi shows it (so a big card can act as a small one):
plans fit under it less their stage's CUDA context (`stage_context_gb`, which torch's allocator does not count),
and the allocator is capped with `torch.cuda.set_per_process_memory_fraction` at it less the larger of that
and the context this process measured. On CPU there is no budget and nothing changes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.errors import ResourceError
from stages.core.lazy import lazy_module
from stages.core.memory import calibration as cal

torch = lazy_module("torch")  # imported at first use: `status` and a no-op `run` need no torch


@dataclass
class Budget:
    gb: float | None
    """What torch's caching allocator may reserve: plans fit their peak x FRAGMENTATION under it (None: CPU)."""
    source: str
    """"auto" (the free memory), "cap" (a number of GB), "cpu"."""
    context_gb: float = 0.0
    """The process's GPU memory outside the allocator that plans count (`stage_context_gb` on a GPU, 0 in a
    budget made directly, as tests do): a cap's `gb` is the figure given less it."""
    measured_context_gb: float | None = None
    """The context this process measured when the stage started (`measure_context`); None where not measured."""
    given_gb: float | None = None
    """A cap's number as given (`cap_budget`), where the context leaves the allocator less than nothing."""

    @property
    def vram_gb(self) -> float | None:
        """The budget as given: a cap counts the whole process, CUDA context included."""
        if self.gb is None or self.source != "cap":
            return self.gb
        return self.given_gb if self.given_gb is not None else round(self.gb + self.context_gb, 3)

    def total_gb(self, peak_gb: float) -> float:
        """A plan's predicted peak as nvidia-smi would show the process: reserved (x FRAGMENTATION) plus the context."""
        return round(peak_gb * cal.FRAGMENTATION + self.context_gb, 3)


def cap_budget(vram_gb: float, context_gb: float) -> Budget:
    """A number of GB (the whole process) as the allocator's budget: `vram_gb` less `context_gb`."""
    return Budget(max(vram_gb - context_gb, 0.0), "cap", context_gb, given_gb=vram_gb)


def stage_context_gb(stage: str | None) -> float:
    """The CUDA context `stage`'s plans count: calibration.STAGE_CONTEXT_GB for the cache stages, else
    calibration.CUDA_CONTEXT_GB (the denoiser stages, and a budget made for no stage in particular)."""
    return cal.STAGE_CONTEXT_GB.get(stage or "", cal.CUDA_CONTEXT_GB)


def planned_context_gb(stage: str | None = None) -> float:
    """The context `stage`'s plan counts: `stage_context_gb` where this process has a CUDA GPU (the stage and the
    fingerprints it checks plan alike: a constant, never a measurement), else 0 (a GPU simulated on CPU, as
    tests do with tiny models under sub-GB budgets)."""
    return stage_context_gb(stage) if torch.cuda.is_available() else 0.0


def for_stage(budget: Budget, stage: str) -> Budget:
    """`budget` as `stage` plans it: one that counts a CUDA context counts that stage's (`stage_context_gb`); a
    cap's allocator share is the number given less it. A budget that counts none (CPU, tests) is as it was."""
    if not budget.context_gb or budget.gb is None:
        return budget
    context = stage_context_gb(stage)
    if budget.source != "cap":
        return dataclasses.replace(budget, context_gb=context)
    given = budget.vram_gb
    return dataclasses.replace(budget, gb=max(given - context, 0.0), context_gb=context, given_gb=given)


def parse_budget(value: Any) -> float | str:
    """`--vram` / gpu.vram_budget_gb: "auto" or a positive number of GB."""
    if value in (None, "auto"):
        return "auto"
    try:
        gb = float(value)
    except (TypeError, ValueError):
        raise ResourceError(f"gpu.vram_budget_gb = {value!r} must be 'auto' or a number of GB, e.g. --vram 12") from None
    if gb <= 0:
        raise ResourceError(f"gpu.vram_budget_gb = {value!r} must be > 0 GB")
    return gb


# Under a cap the caching allocator runs with expandable segments unless the user configured it: with torch's
# fixed segments FLUX.2 klein's planned fp8 run (22 of 25 blocks, 5.12 GB predicted, 5.31 measured uncapped) ran
# out of memory in its first step under the diffusers script's 5.74 GB reserved peak, with and without CUDA graphs,
# at 5.41 GB reserved: holes in segments it could not hand back (bench/results/peers-klein-1024-b1-fitreserved-fp8-why.json);
# with expandable segments the same run trained, 5.13 GB allocated and 5.72 reserved
# (peers-klein-1024-b1-fitreserved-fp8-expandable.json), and uncapped it captured CUDA graphs and ran as fast
# (0.203 s a step against 0.2055) at 5.98 GB reserved against 6.45 (peers-klein-1024-b1-fp8blocks22-expandable.json).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch's names for it (the second, newer)
CAP_ALLOC_CONF = "expandable_segments:True"


def allocator_setting(env: Any = None) -> str | None:
    """The caching allocator's setting in the environment (`NAME=value`, os.environ's unless `env`), else None."""
    import os

    env = os.environ if env is None else env
    return next((f"{v}={env[v]}" for v in ALLOC_CONF_VARS if env.get(v)), None)


def allocator_for_cap(setting: Any, env: Any = None) -> str | None:
    """Under a cap (`setting` a number of GB), expandable segments for the caching allocator: set in `env`
    (os.environ) before CUDA starts, which is when torch reads it. The setting made, else None: no cap,
    the user's own allocator settings (they win), no CUDA, or CUDA already started in this process (too late)."""
    import os

    env = os.environ if env is None else env
    if (setting in (None, "auto") or allocator_setting(env) or not torch.cuda.is_available()
            or torch.cuda.is_initialized()):
        return None
    env[ALLOC_CONF_VARS[0]] = CAP_ALLOC_CONF
    return CAP_ALLOC_CONF


def allocator_summary(device: torch.device | None = None) -> str:
    """What the caching allocator runs with, for the runtime summary: the environment's setting (or torch's
    default) and, once CUDA holds memory, whether its segments are expandable."""
    conf = allocator_setting() or "torch's default"
    if device is None or device.type != "cuda" or not torch.cuda.is_initialized():
        return conf
    segments = torch.cuda.memory_snapshot()
    if not segments:
        return conf
    return f"{conf} ({'expandable' if any(s.get('is_expandable') for s in segments) else 'fixed'} segments)"


def retries_note(retries: int, steps: int, budget: Budget) -> str | None:
    """A warning where the caching allocator hit the budget's cap more often than once a step on average over
    the `steps` this process ran: each time it frees its cache and retries, and the steps run slower (FLUX.2
    klein's 22 fp8 blocks at a 5.74 GB cap: 230 retries in 15 eager steps, 0.29 s a step against 0.20 captured,
    bench/results/peers-klein-1024-b1-fitreserved-fp8-expandable.json); else None."""
    if budget.source != "cap" or steps <= 0 or retries <= steps:
        return None
    return (f"the GPU allocator reached the {allocator_cap_gb(budget):g} GB cap and flushed its cache {retries} times in "
            f"{steps} steps, "
            f"which slows them (runtime.cuda_alloc_retries in the train manifest): a larger --vram "
            f"(gpu.vram_budget_gb) lets the plan keep more memory to spare")


def resolve_budget(setting: Any, device: torch.device, enforce: bool = True, stage: str | None = None) -> Budget:
    """`stage`'s budget on `device` (CUDA starts here), with the context measured before anything is
    allocated; a number is also enforced as the allocator's cap: the number less the larger of the measured
    context and the stage's planned one (the context grows as cuBLAS and kernels load)."""
    if device.type != "cuda":
        return Budget(None, "cpu")
    value = parse_budget(setting)
    free, total = torch.cuda.mem_get_info(device)
    measured = measure_context(device)
    if measured is not None:
        _START_CONTEXT_GB[:] = [measured]
    if value == "auto":
        return Budget(round(max(free / cal.GB - cal.AUTO_MARGIN_GB, 0.0), 3), "auto", stage_context_gb(stage), measured)
    budget = cap_budget(float(value), stage_context_gb(stage))
    budget.measured_context_gb = measured
    if enforce:
        if allocator_cap_gb(budget) <= 0:
            raise ResourceError(f"gpu.vram_budget_gb = {value:g} GB leaves nothing beside this process's CUDA context "
                                f"({max(budget.context_gb, measured or 0.0):.2f} GB, which a --vram number counts): "
                                f"give --vram {math.ceil(max(budget.context_gb, measured or 0.0)) + 1} or more")
        index = device.index if device.index is not None else torch.cuda.current_device()  # it refuses a bare "cuda"
        torch.cuda.set_per_process_memory_fraction(min(1.0, allocator_cap_gb(budget) * cal.GB / total), index)
    return budget


def allocator_cap_gb(budget: Budget) -> float:
    """What a cap lets torch's allocator reserve: the figure given less the larger of the planned and the
    measured context."""
    assert budget.vram_gb is not None
    return max(budget.vram_gb - max(budget.context_gb, budget.measured_context_gb or 0.0), 0.0)


def context_note(budget: Budget) -> str | None:
    """A warning where the context this process measured exceeds what the plan counts (the allocator is then
    capped below what the plan assumed), naming the --vram that would restore it; else None."""
    measured = budget.measured_context_gb
    if budget.source != "cap" or measured is None or measured <= budget.context_gb + 0.05:
        return None
    return (f"this process's CUDA context takes {measured:.2f} GB of the GPU, more than the {budget.context_gb:.2f} GB "
            f"the memory plan counts for this stage (stages/core/memory/calibration.py): the allocator is capped at "
            f"{allocator_cap_gb(budget):.2f} GB, below the {budget.gb:.2f} GB the plan fits; give --vram "
            f"{budget.vram_gb + measured - budget.context_gb:.2f} (gpu.vram_budget_gb) for the plan's own room")


def measure_context(device: torch.device) -> float | None:
    """GB of `device` this process holds outside torch's caching allocator (CUDA starts here if it has not):
    NVML's per-process figure (nvidia-ml-py, where installed) less what the allocator reserved; else the
    device's used memory less that, where it is small enough to be this process's alone (below twice
    calibration.CUDA_CONTEXT_GB: no other process holds memory there). None where neither tells."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    used = _nvml_process_bytes(device)
    if used is None:
        used = total - free
        if (used - reserved) / cal.GB >= 2 * cal.CUDA_CONTEXT_GB:
            return None  # another process's memory is in it
    return round(max(used - reserved, 0) / cal.GB, 3)


def _nvml_process_bytes(device: torch.device) -> int | None:
    """This process's memory on `device` as nvidia-smi counts it, through NVML (the `pynvml` module of
    nvidia-ml-py, which torch.cuda's own NVML queries import too); None without it, or where NVML does not
    list this process (a container's own process ids)."""
    import os

    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(index).uuid}")
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # pynvml.NVMLError and its many subclasses: NVML cannot tell here
        return None
    return next((p.usedGpuMemory for p in processes if p.pid == os.getpid() and p.usedGpuMemory is not None), None)


# The context resolve_budget measured when this process's stage started, for its summary (process_total_gb).
_START_CONTEXT_GB: list[float] = []


def process_total_gb(device: torch.device) -> tuple[float, float] | None:
    """(context GB, reserved peak + context GB) of this process on `device` at the end of a stage: the
    context measured now (it grows as libraries load kernels) or at the start, whichever is larger, else
    calibration.CUDA_CONTEXT_GB; None before CUDA started."""
    if not torch.cuda.is_initialized():
        return None
    now = measure_context(device)
    known = [c for c in (now, *_START_CONTEXT_GB) if c is not None]
    context = max(known) if known else cal.CUDA_CONTEXT_GB
    return context, round(torch.cuda.max_memory_reserved(device) / cal.GB + context, 3)


def host_available_bytes() -> int | None:
    """The host memory the kernel can give without swapping (/proc/meminfo MemAvailable); None where
    that file does not exist (not Linux): then nothing is checked."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
