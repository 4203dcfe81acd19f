"""`pipeline.py plan`: each stage's memory plan for a config and a GPU budget, without loading weights.

    lorapipe plan --config configs/flux-dev.toml --vram 8          # a table
    lorapipe plan --config configs/qwen-image.toml --vram 8 --json  # for scripts

`lorapipe plan` also writes the plans to `<run>/plan.json` ("planned") where the run's folder exists,
beside the plan each stage ran with ("ran", written by the stage); `run --dry-run` writes nothing.

Sizes come from the meta device (each component built from its config.json) and the activation
estimates in stages/core/memory/. `--vram auto` (or none) plans for the free memory of this
machine's GPU; where the stages run on the CPU (device = "cpu", or "auto" without a CUDA GPU) there is
no budget and each stage runs its settings as configured, which the table shows; a `--vram` number plans
for a GPU of that size on any machine.
"""

from __future__ import annotations

import json
from typing import Any

from stages.core.events import table_console
from stages.core.runspec import command_for
from stages.registry import PLANNED as PLANNED_STAGES, each_expert, run_stages  # sample's plan: the whole pipeline, to render
SCHEMA_VERSION = 2  # the JSON's layout: each stage has `in_run`; `fits`, `peak_gb` and `total_gb` are of the stages a plain `run` runs


def _budget(value: Any, device: str) -> Any:
    """A number: that GPU budget, wherever this runs; "auto": this machine's free GPU memory where the stages run
    on CUDA, else no budget (the CPU)."""
    import torch

    from stages.core import memory
    from stages.core.runtime import pick_device

    parsed = memory.parse_budget(value)
    if parsed != "auto":  # a GPU stage counts its CUDA context in the number, here too (even planned on a CPU)
        return memory.cap_budget(float(parsed), memory.CUDA_CONTEXT_GB)
    if pick_device(device).type != "cuda":
        return memory.Budget(None, "cpu")
    return memory.resolve_budget("auto", torch.device("cuda"), enforce=False)


def plans(cfg: Any, budget_gb: Any, record: bool = False) -> dict[str, Any]:
    """The JSON-able plan of every GPU stage (schema: tests/planner/test_memory.py::test_plan_json_schema)."""
    from stages.core import memory
    from stages.core.model_source import model_source
    from stages.families import get_family

    family, src, budget = get_family(cfg.family), model_source(cfg), _budget(budget_gb, cfg.device)
    src.check(family.text_components + family.vae_components + family.denoiser_components[:1], family)  # a clear error first
    stages = [memory.plan_for(cfg, family, src, budget, name) if budget.gb is not None else
              memory.unplanned(cfg, name, budget) for name in PLANNED_STAGES]
    experts = [unit.train.expert for unit in each_expert(cfg)]
    for p in stages if len(experts) > 1 else ():  # train.expert = "both": one expert in memory at a time
        if p.stage == "train":
            p.note = "; ".join(filter(None, [f"runs {len(experts)} times, once per expert ({', '.join(experts)}), each "
                                             f"holding one expert with this plan", p.note]))
    if record:
        memory.record_plans(cfg.run_dir, stages, "planned")
    in_run = set(run_stages(cfg))
    ran = [p for p in stages if p.stage in in_run]  # the run's figures: of the stages a plain `run` runs
    # each stage counts its own CUDA context (memory.stage_context_gb): the run's are the largest context and the
    # smallest allocator share among them
    allocators = [p.budget.gb for p in ran if p.budget.gb is not None]
    return {"schema": SCHEMA_VERSION, "run": cfg.run, "family": cfg.family, "budget_gb": budget.vram_gb,
            "budget_source": budget.source, "allocator_gb": min(allocators) if allocators else None,
            "context_gb": max(p.budget.context_gb for p in ran),
            "fits": all(p.fits for p in ran), "peak_gb": round(max(p.predicted_peak_gb for p in ran), 3),
            "total_gb": round(max(p.budget.total_gb(p.predicted_peak_gb) for p in ran), 3),
            "stages": [{**p.to_dict(), "in_run": p.stage in in_run} for p in stages]}


def _settings_text(settings: dict[str, Any]) -> str:
    """`key=value, ...`; the checkpointed (and fp8) blocks as k/N of the model's repeated blocks."""
    def text(k: str, v: Any) -> str:
        return (f"{k}={v}/{settings['blocks']}" if k in ("checkpointed_blocks", "fp8_blocks") and "blocks" in settings
                else f"{k}={v}")
    return ", ".join(text(k, v) for k, v in settings.items() if k not in ("blocks", "layers"))


def print_table(result: dict[str, Any]) -> None:
    from rich.table import Table

    from stages.core import memory

    if result["budget_source"] == "cpu":
        return print_cpu_table(result)
    table = Table(title=f"memory plan of run '{result['run']}' ({result['family']}), budget "
                        f"{result['budget_gb']:.2f} GB ({result['budget_source']})")
    for column in ("stage", "settings", "predicted peak GB", "with context GB", "fits"):
        table.add_column(column)
    for p in result["stages"]:
        table.add_row(p["stage"], _settings_text(p["settings"]), f"{p['predicted_peak_gb']:.2f}",
                      f"{p['predicted_total_gb']:.2f}",
                      "yes" if p["fits"] else "[red]no[/red]" if p["in_run"] else "no (not in this run)")
    console = table_console()
    console.print(table)
    for p in result["stages"]:
        if p["note"]:
            console.print(f"{p['stage']}: {p['note']}", style=None if p["fits"] or not p["in_run"] else "red")
    contexts = ", ".join(f"{p['stage']} {p['context_gb']:.2f}" for p in result["stages"])
    console.print("Peaks are predictions from meta-device sizes and estimated activations (stages/core/memory/); "
                  f"'with context' is the reserved peak (x {memory.FRAGMENTATION:g}) plus the stage's CUDA context "
                  f"({contexts} GB), as nvidia-smi counts the process.")
    if result["budget_source"] == "cap":
        console.print("A --vram number counts the whole process: each stage's plan fits torch's allocator into the "
                      "number less that stage's CUDA context.")
        console.print(allocator_line())


def print_cpu_table(result: dict[str, Any]) -> None:
    """The stages' settings where they run on the CPU: no GPU budget, nothing to plan."""
    from rich.table import Table

    table = Table(title=f"run '{result['run']}' ({result['family']}) runs on the CPU: no GPU budget, each stage "
                        f"runs its settings as configured")
    for column in ("stage", "settings"):
        table.add_column(column)
    for p in result["stages"]:  # "auto" precisions are fp32 on the CPU (stages/core/runtime.py)
        shown = {k: ("fp32" if k.endswith("precision") and v == "auto" else v) for k, v in p["settings"].items()
                 if v is not None}
        table.add_row(p["stage"], _settings_text(shown))
    console = table_console()
    console.print(table)
    console.print(f"For a GPU's plans give its memory: `{command_for(None, 'plan', '--vram', '12')}`.")


def allocator_line() -> str:
    """What a capped stage's caching allocator will run with (stages/core/memory/ `allocator_for_cap`)."""
    from stages.core import memory

    mine = memory.allocator_setting()
    return (f"Under this cap the stages keep your allocator setting ({mine})." if mine else
            f"Under this cap the stages run torch's allocator with {memory.CAP_ALLOC_CONF} (less fragmentation at the "
            f"cap; set PYTORCH_CUDA_ALLOC_CONF to choose yourself).")


def run(cfg: Any, budget_gb: Any, as_json: bool, record: bool = False) -> dict[str, Any]:
    from stages.core.runtime import quiet_libraries
    from stages.families import library_notices

    quiet_libraries(notices=library_notices())  # the planner imports the libraries a stage loads: their notices stay out, as in every stage
    result = plans(cfg, budget_gb if budget_gb is not None else cfg.gpu.vram_budget_gb, record)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return result
