"""runtime.profile_steps' profiler (stages/core/profiling.py): it covers exactly the steps after the
warm-up, writes its table once they are done, and writes nothing when the run ends or stops inside
them. The trainer's use of it (the `profile` event, profile.json) is in test_events_schema.py."""

from __future__ import annotations

import json

import torch

from stages.core.profiling import StepProfiler


def _run(profiler: StepProfiler, steps: int, work: dict[int, int]) -> list[int]:
    """`steps` steps; step i does work[i] matmuls; returns the steps after which a table came back."""
    done_at = []
    a = torch.randn(32, 32)
    for step in range(steps):
        profiler.before(step)
        for _ in range(work.get(step + 1, 1)):
            a = a @ a / 32
        if profiler.after(step + 1) is not None:
            done_at.append(step + 1)
    profiler.close()
    return done_at


def test_the_table_covers_the_steps_after_the_warmup(tmp_path):
    path = tmp_path / "profile.json"
    # steps 3 and 4 are profiled (after 2 warm-up steps): they do 5 matmuls each, the others 1
    done_at = _run(StepProfiler(2, 2, path, cuda=False), 6, {3: 5, 4: 5})
    table = json.loads(path.read_text())
    assert done_at == [4] and table["steps"] == 2 and table["device"] == "cpu"
    mm = next(r for r in table["top"] if r["name"] == "aten::mm")
    assert mm["calls"] == 5  # per profiled step: the warm-up and later steps are outside
    assert table["ms_per_step"] > 0 and abs(sum(r["pct"] for r in table["top"]) - 100) < 1.5


def test_a_run_that_ends_inside_the_profiled_steps_writes_nothing(tmp_path):
    path = tmp_path / "profile.json"
    assert _run(StepProfiler(2, 5, path, cuda=False), 4, {}) == []
    assert not path.exists()
    assert _run(StepProfiler(0, 2, path, cuda=False, enabled=False), 4, {}) == [] and not path.exists()


def test_inspect_shows_the_profile_and_names_a_damaged_one(tmp_path):
    from rich.console import Console

    from stages import inspect as inspect_stage

    path = tmp_path / "profile.json"
    _run(StepProfiler(1, 1, path, cuda=False), 3, {2: 3})
    shown = inspect_stage.profile_section(path, top=3)
    assert shown["steps"] == 1 and len(shown["top"]) == 3 and shown["top"][0] == json.loads(path.read_text())["top"][0]
    console = Console(record=True, width=200)
    inspect_stage._render_lora({"checkpoints": [], "final": None, "profile": shown}, None, console)
    text = console.export_text()
    assert "1 profiled step(s)" in text and shown["top"][0]["name"] in text
    path.write_text("{not json")
    assert "unreadable" in inspect_stage.profile_section(path)["error"]
    assert inspect_stage.profile_section(tmp_path / "none.json") is None
