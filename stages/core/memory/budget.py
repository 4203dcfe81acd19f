"""The GPU budget a stage plans for, the caching allocator's settings under a cap, and host memory.

`gpu.vram_budget_gb`: "auto" is the free memory when the stage starts (`torch.cuda.mem_get_info`) less
AUTO_MARGIN_GB; a number is a hard cap, enforced with `torch.cuda.set_per_process_memory_fraction` (so a big
card can act as a small one). On CPU there is no budget and nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stages.core.errors import ResourceError
from stages.core.memory import calibration as cal


@dataclass
class Budget:
    gb: float | None  # None: no GPU budget (CPU)
    source: str  # "auto" (free memory), "cap" (a number), "cpu"


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
    return (f"the GPU allocator reached the {budget.gb:g} GB cap and flushed its cache {retries} times in {steps} steps, "
            f"which slows them (runtime.cuda_alloc_retries in the train manifest): a larger --vram "
            f"(gpu.vram_budget_gb) lets the plan keep more memory to spare")


def resolve_budget(setting: Any, device: torch.device, enforce: bool = True) -> Budget:
    """The stage's budget on `device`; a number is also enforced as the allocator's cap."""
    if device.type != "cuda":
        return Budget(None, "cpu")
    value = parse_budget(setting)
    free, total = torch.cuda.mem_get_info(device)
    if value == "auto":
        return Budget(round(max(free / cal.GB - cal.AUTO_MARGIN_GB, 0.0), 3), "auto")
    if enforce:
        index = device.index if device.index is not None else torch.cuda.current_device()  # it refuses a bare "cuda"
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(value) * cal.GB / total), index)
    return Budget(float(value), "cap")


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
