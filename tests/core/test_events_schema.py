"""events.jsonl keeps the schema documented in stages/core/events.py (EVENT_SCHEMA) and docs/configuration.md.

Real runs are validated line by line: the four stages of a built run, then a run that is stopped,
resumed, skipped as up to date by the CLI, fails on a missing cache and skips a broken image, so
every event type the stages emit is seen (the sample stage's own event is checked in
test_inspect_sample_report.py). The built run's events are checked for every family; the
stop/resume/failure run writes its events through the same family-independent code, so it runs
on one family (`once`); stop and resume themselves are tested for every family in test_resume.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import demo_config_path, once
from stages.core.events import COMMON_FIELDS, EVENT_SCHEMA, EVENT_TYPES, describe_events, read_events, validate_event
from stages.core.caches import lora_dir


def violations(events: list[dict]) -> list[str]:
    return [f"line {i}: {p}" for i, e in enumerate(events) for p in validate_event(e)]


def test_schema_covers_every_event_type():
    assert set(EVENT_SCHEMA) == set(EVENT_TYPES)
    for spec in EVENT_SCHEMA.values():
        assert set(spec) <= {"required", "optional", "extra"} and not set(spec["required"]) & set(spec["optional"])
    assert [row[0] for row in describe_events()] == list(EVENT_SCHEMA)


def test_validator_catches_each_kind_of_violation():
    base = {"ts": 1.0, "run": "r", "stage": "train"}
    good = {**base, "event": "step", "step": 3, "loss": 0.5, "lr": 1e-4, "batch_size": 2,
            "samples_per_second": None, "peak_vram_gb": 0.0}
    assert validate_event(good) == []
    assert validate_event({**good, "event": "stepp"}) == ["unknown event 'stepp'"]
    missing = {k: v for k, v in good.items() if k != "lr"}
    assert validate_event(missing) == ["step: missing field 'lr'"]
    assert "is not integer" in validate_event({**good, "step": True})[0]  # a bool is not a JSON integer
    assert "is not number" in validate_event({**good, "loss": "nan"})[0]
    assert "undocumented field 'grad_norm'" in validate_event({**good, "grad_norm": 1.0})[0]
    assert validate_event({**base, "event": "done", "seconds": 1.0, "anything": [1]}) == []  # summaries vary
    assert validate_event({k: v for k, v in good.items() if k != "ts"}) == ["step: missing field 'ts'"]
    assert set(COMMON_FIELDS) == {"ts", "run", "stage", "event"}


def test_built_run_events_conform(built_run):
    events = read_events(built_run.run_dir)
    assert violations(events) == []
    seen = {e["event"] for e in events}
    assert {"start", "loading", "loaded", "preparing", "step", "checkpoint", "done"} <= seen, seen


@pytest.fixture
def eventful_run(built_run, tmp_path, monkeypatch):
    """A run beside the built one (copied caches) taken through stop, resume, an up-to-date CLI run,
    a failure and a skipped image; returns its config."""
    from click.testing import CliRunner

    import pipeline
    from stages import cache_latents, encode_captions, export_lora, train
    from stages.core import faults
    from stages.core.config import load_config

    sets = {"model": built_run.model, "data.path": built_run.data.path, "artifacts": str(tmp_path),
            "device": built_run.device, "run": "eventful", "train.steps": 4, "runtime.checkpoint_every": 2,
            "runtime.warmup_steps_excluded": 1, "runtime.profile_steps": 1}  # `profile`: step 2
    cfg = load_config(demo_config_path(built_run.family), sets)
    for cache in ("captions.zarr", "latents.zarr"):
        shutil.copytree(built_run.run_dir / cache, cfg.run_dir / cache)
    # A stop request after step 2: `stopped`. faults counts hits per spec string, so the spec names
    # this run (an unused point) to start from zero for each family in one pytest process.
    monkeypatch.setenv(faults.ENV, f"train:2:TERM,unused-{built_run.family}:1")
    assert train.run(cfg)["stopped"]
    monkeypatch.delenv(faults.ENV)
    train.run(cfg, resume=True)  # `info` (resumed from checkpoint-2)
    export_lora.run(cfg)
    args = ["run", "--config", str(demo_config_path(built_run.family))]
    args += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    result = CliRunner().invoke(pipeline.cli, args)  # every stage up to date: `up_to_date` x4
    assert result.exit_code == 0 and result.output.count("up to date") == 4, result.output

    shutil.rmtree(cfg.run_dir / "captions.zarr")
    with pytest.raises(Exception, match="encode-captions"):
        train.run(cfg)  # `error`: the missing cache, naming the stage to run
    data = tmp_path / "data"
    shutil.copytree(built_run.data.path, data)
    broken = sorted(data.glob("*.png"))[0]
    broken.write_bytes(b"not a png")
    bad = load_config(demo_config_path(built_run.family), {**sets, "data.path": str(data), "data.on_bad_image": "skip"})
    cache_latents.run(bad)  # `skipped`
    broken.with_suffix(".txt").write_text("a caption " * 200)
    encode_captions.run(bad)  # `warning`: that caption is truncated
    return cfg


@once
def test_stop_resume_cli_and_failure_events_conform(eventful_run):
    events = read_events(eventful_run.run_dir)
    assert violations(events) == []
    seen = {e["event"] for e in events}
    # `sample` and `validation` conform in their own tests (test_inspect_sample_report, test_masks_validation)
    others = {"sample", "validation"}
    assert seen == set(EVENT_SCHEMA) - others, f"not exercised: {set(EVENT_SCHEMA) - others - seen}"
    profile = [e for e in events if e["event"] == "profile"]
    table = json.loads(Path(profile[-1]["path"]).read_text())  # the resumed run profiled step 4 too
    assert table["steps"] == 1 and table["ms_per_step"] > 0 and table["top"][0]["calls"] >= 1
    assert len(profile) == 2 and profile[-1]["top"][0].endswith(table["top"][0]["name"][:60])
    from stages import inspect as inspect_stage

    shown = inspect_stage.lora_section(lora_dir(eventful_run))["profile"]  # `pipeline.py inspect` shows it
    assert shown["ms_per_step"] == table["ms_per_step"] and shown["top"] == table["top"][:10]
    stopped = [e for e in events if e["event"] == "stopped"]
    assert [(e["step"], e["saved"]) for e in stopped] == [(2, True)]
    errors = [e for e in events if e["event"] == "error"]
    assert errors and "encode-captions" in errors[-1]["message"] and errors[-1]["stage"] == "train"
