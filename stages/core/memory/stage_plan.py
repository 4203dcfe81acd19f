"""A stage's plan (the settings chosen within a budget, and the candidates tried) and what planners share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from stages.core.memory import calibration as cal
from stages.core.memory.budget import Budget


@dataclass
class StagePlan:
    stage: str
    budget: Budget
    settings: dict[str, Any]
    predicted_peak_gb: float
    fits: bool
    note: str = ""
    tried: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """budget_gb: the budget as given (a cap counts the whole process); allocator_gb: what the plan fits its
        reserved peak under; predicted_total_gb: the peak as nvidia-smi would show the process (reserved, i.e.
        the predicted peak x FRAGMENTATION, plus the context_gb counted outside the allocator)."""
        return {"stage": self.stage, "budget_gb": self.budget.vram_gb, "budget_source": self.budget.source,
                "allocator_gb": self.budget.gb, "context_gb": self.budget.context_gb,
                "settings": self.settings, "predicted_peak_gb": round(self.predicted_peak_gb, 3),
                "predicted_total_gb": self.budget.total_gb(self.predicted_peak_gb), "fits": self.fits, "note": self.note}


@dataclass(frozen=True)
class Planner:
    """A stage's memory planner, declared once beside its `plan` (captions.py, latents.py, train.py,
    sample.py); the stage registry names it, and planning.py runs it."""

    stage: str
    """The stage it plans (its plans and events carry the name)."""
    plan: Callable[[Any, Any, Any, Budget], StagePlan]
    """(cfg, family, model source, budget) -> the first settings that fit, from meta-device sizes."""
    configured: Callable[[Any], dict[str, Any]]
    """The settings as configured, for a stage with no GPU budget to plan for (CPU)."""
    apply: Callable[[Any, dict[str, Any]], Any]
    """(cfg, settings) -> the config the stage runs with: the plan's settings in its section."""
    to_change: str
    """The settings an out-of-memory error tells the user to lower."""
    under_train_peak: bool = False
    """Under an "auto" budget, plan for the train stage's predicted peak (a cheap stage never sets the
    run's memory), unless only the free memory would force its settings (`forced_only`)."""
    forced_only: Callable[[Any, StagePlan], bool] = lambda cfg, plan: False
    """Whether `plan` stores other numbers than the stage's own planner gives with memory to spare."""
    keys: dict[str, str] = field(default_factory=dict)
    """Each setting of its plans that a config key sets (setting -> key), for the out-of-memory advice;
    the others (swapped or checkpointed blocks, an offload share) only a budget sets."""
    oom_also: str = ""
    """A cause of running out of memory the plan does not size, said after the advice ("" for none)."""
    last_resort: Callable[[Any, Any], str] = lambda cfg, family: ""
    """(cfg, family) -> what lowers the stage's memory below its smallest plan, naming only the settings that can
    still change, with their values (`changeable`), for the out-of-memory advice ("": none is left)."""


def changeable(*settings: tuple[str, Any, bool]) -> str:
    """"lower train.batch_size (now 4) or data.resolution (now 1024)": each (key, value, whether a lower value is
    allowed and lowers the memory), the ones that can still change; "" when none can."""
    named = [f"{key} (now {value})" for key, value, lowers in settings if lowers]
    return f"lower {' or '.join(named)}" if named else ""


def nf4_instead(key: str, value: str) -> str:
    """"set KEY = 'nf4'" where a precision other than nf4 is set ("auto" tries nf4 already), else ""."""
    return "" if value in ("auto", "nf4") else f"set {key} = 'nf4'"


def either(*ways: str) -> str:
    """The ways that lower a stage's memory as one "a, or b" phrase, the empty ones left out ("" when none is)."""
    return ", or ".join(w for w in ways if w)


def data_settings(cfg: Any, family: Any) -> list[tuple[str, Any, bool]]:
    """The data settings that lower every stage's memory, as `changeable` takes them: data.resolution, and a video
    family's data.frames."""
    data = cfg.dataset_configs()
    side, frames = max(d.resolution for d in data), max(d.frames for d in data)
    step = max(1, family.frames_per_latent)
    return [("data.resolution", side, side > 256), ("data.frames", frames, family.trains_video and frames > step + 1)]


def data_sides(cfg: Any, family: Any) -> str:
    """`changeable` of the data settings alone (`data_settings`)."""
    return changeable(*data_settings(cfg, family))


def fitting(budget: Budget, candidates: list[tuple[dict[str, Any], float]], stage: str, need: str) -> StagePlan:
    """The first candidate (settings, peak GB) that fits, else the smallest one, marked as not fitting, with a note
    of the --vram that fits it, and `need` (what else lowers the memory; "" for nothing)."""
    tried = [{**s, "predicted_peak_gb": p} for s, p in candidates]
    for settings, peak in candidates:
        if budget.gb is None or peak * cal.FRAGMENTATION <= budget.gb:
            return StagePlan(stage, budget, settings, peak, True, tried=tried)
    settings, peak = min(candidates, key=lambda c: c[1])
    cap = budget.source == "cap"  # a cap counts the process's context too; "auto" measured the free memory beside it
    need_gb = budget.total_gb(peak) if cap else peak * cal.FRAGMENTATION
    context = f" with the {budget.context_gb:.2f} GB CUDA context" if cap and budget.context_gb else ""
    note = (f"even the smallest {stage} plan needs {need_gb:.1f} GB{context}, more than the {budget.vram_gb:.1f} GB "
            f"budget: give it --vram {math.ceil(budget.total_gb(peak))} or more{', or ' + need if need else ''}")
    return StagePlan(stage, budget, settings, peak, False, note, tried)


def halvings(n: int) -> list[int]:
    out = [n]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def planned_controls(cfg: Any, family: Any) -> int:
    """Control images per item the sequence carries: the most an item of this run's data has, within the
    family's range (FLUX.2's optional references, Qwen-Image-Edit's 1 to 3 inputs); a family that takes a fixed
    number (FLUX.1 Kontext's one, none for text-to-image) plans that number without reading the data, and one
    that needs controls plans its most where the data's folder does not exist yet (`lorapipe plan` before the
    images are in place)."""
    low, high = family.control_range
    if low == high:
        return high
    from stages.core import dataset

    if low and not all(Path(data.path).is_dir() for data in cfg.dataset_configs()):
        return high
    return max(low, min(high, dataset.most_controls(cfg)))  # file names only: no image is read or hashed here
