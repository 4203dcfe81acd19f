"""The stage registry (stages/registry.py) is where the stage graph is declared; what reads the graph
agrees with it: the stage modules (every declared callable exists), the CLI, `plan` and the Makefile.

    .venv/bin/python -m pytest -q tests/core/test_registry.py
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

from stages import registry

ROOT = Path(__file__).resolve().parents[2]


def test_every_declared_callable_exists():
    """A hook is declared by name; a stage module that lost it would fail only when the hook is called."""
    missing = []
    for stage in registry.ALL:
        module = importlib.import_module(stage.module)
        for f in dataclasses.fields(stage):
            value = getattr(stage, f.name)
            if callable(value) and value.__qualname__.startswith(stage.module + "."):
                attr = value.__qualname__[len(stage.module) + 1:]
                if not callable(getattr(module, attr, None)):
                    missing.append(f"{stage.name}: {stage.module}.{attr}")
    assert not missing, missing


def test_the_graph_is_closed_and_ordered():
    """Every stage reads only stages declared before it, so `run`'s order is the registry's."""
    seen: set[str] = set()
    for stage in registry.ALL:
        assert set(stage.reads) <= seen and set(stage.upstream) <= seen, stage.name
        assert importlib.import_module(stage.module).NAME == stage.name
        seen.add(stage.name)


def test_every_stage_is_a_command():
    import pipeline

    assert set(registry.NAMES) <= set(pipeline.cli.commands)


def test_conflicts_are_the_stages_that_read_or_write_what_a_stage_touches():
    assert registry.conflicts("train") == (
        ("encode-captions", "writes captions.zarr, which train reads"),
        ("cache-latents", "writes latents.zarr, which train reads"),
        ("export-lora", "reads lora/, which train writes"),
        ("sample", "reads lora/, which train writes"))
    assert registry.conflicts("encode-captions") == (("train", "reads captions.zarr, which encode-captions writes"),)


def _make_rules() -> dict[str, set[str]]:
    """target -> prerequisites, from the Makefile's rule lines (`a b: c d`; recipes and variables skipped)."""
    rules: dict[str, set[str]] = {}
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_. -]+?)\s*:(?!=)\s*(.*)$", line)
        if not match or line.startswith("\t"):
            continue
        for target in match.group(1).split():
            rules.setdefault(target, set()).update(match.group(2).split())
    return rules


def test_the_makefile_stage_targets_follow_the_registry():
    """`make <stage>` first makes the stages the registry says it follows; a stage that follows none
    needs only the venv. Each one runs `pipeline.py run --only <stage>`, which skips it when up to date."""
    rules = _make_rules()
    text = (ROOT / "Makefile").read_text()
    for stage in registry.ALL:
        assert stage.name in rules, f"the Makefile has no target {stage.name}"
        assert rules[stage.name] == (set(stage.upstream) or {"venv"}), stage.name
    recipes = re.findall(r"^([a-z -]+):.*\n\t(.*)$", text, flags=re.M)
    for targets, recipe in recipes:
        if set(targets.split()) & set(registry.NAMES):
            assert recipe == "$(PY) pipeline.py run $(RUN_ARGS) --only $@ $(ARGS)", targets
    phony = {t for line in text.splitlines() if line.startswith(".PHONY:") for t in line.split()[1:]}
    assert set(registry.NAMES) <= phony


def test_every_stage_writes_a_manifest_kind_of_the_schema():
    from stages.core.schema import MANIFEST_SCHEMA, manifest_kind

    for stage in registry.ALL:
        fields = {"kind": "final"} if stage.name == "train" else {}
        assert manifest_kind(stage.name, fields) in MANIFEST_SCHEMA, stage.name


def test_each_planned_stage_names_the_planner_its_module_declares():
    """The registry names each planned stage's planner module; that module's PLANNER plans that stage, and
    the planner table the memory package runs holds exactly those planners."""
    import importlib

    from stages.core import memory

    declared = {s.name: importlib.import_module(s.planner).PLANNER for s in registry.ALL if s.planned}
    assert {name: p.stage for name, p in declared.items()} == {name: name for name in declared}
    assert memory.PLANNERS == declared
    assert set(registry.PLANNED) == set(declared)
