"""A run's state the user can trust: what a command changes, what it skips, what may run beside it.

In-process through click's CliRunner, on copies of conftest's built run (its caches, LoRA and export),
so no test re-encodes or retrains more than a few steps:
an up-to-date train is skipped, one of other settings refuses; command flags never change the run's
settings; a stage never rewrites a store another running stage reads; --resume never starts over;
an edited preset is named; suggested commands paste and work.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

import pipeline
from conftest import demo_config_path, once, run_beside
from stages.core.caches import lora_dir


def invoke(*args: str):
    return CliRunner().invoke(pipeline.cli, [str(a) for a in args])


def copy_run(built, name: str, **overrides):
    """A finished run beside `built`: its whole folder copied (caches, lora/, export/) and its settings
    saved as config.json, as a run made by `lorapipe run` has them."""
    from stages.core.artifacts import atomic_write_json
    from stages.core.config import load_config
    from stages.core.runspec import flatten

    cfg = load_config(None, {**flatten(built.to_dict()), "run": name, **overrides})
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    shutil.copytree(built.run_dir, cfg.run_dir, ignore=shutil.ignore_patterns(".*.lock", "events.jsonl", "*.stop"))
    atomic_write_json(cfg.run_dir / "config.json", cfg.to_dict())
    return cfg


def by_name(cfg) -> list[str]:
    return [cfg.run, "--artifacts", str(cfg.artifacts)]


def train_events(cfg, event: str) -> list[dict]:
    from stages.core.events import read_events

    return [e for e in read_events(cfg.run_dir) if e["stage"] == "train" and e["event"] == event]


def suggested(output: str) -> list[str]:
    """Every command an output suggests (`lorapipe ...` between backticks)."""
    return re.findall(r"`(lorapipe [^`]+)`", output)


def paste(command: str):
    """Run a suggested command as the user would paste it (in-process)."""
    args = shlex.split(command)
    assert args[0] == "lorapipe", command
    return invoke(*args[1:])


# ---- 1. an up-to-date train is skipped; other settings refuse; set-aside trainings are listed --------------


@once
def test_train_on_a_finished_run_is_up_to_date_and_other_settings_refuse(built_run):
    cfg = copy_run(built_run, "finished")
    lora = lora_dir(cfg)
    before = sorted(p.name for p in lora.iterdir())
    result = invoke("train", *by_name(cfg))
    assert result.exit_code == 0, result.output
    assert "train: up to date (step 8 of 8" in result.output
    assert sorted(p.name for p in lora.iterdir()) == before and not train_events(cfg, "step")

    changed = invoke("train", *by_name(cfg), "--set", "train.learning_rate=0.001")
    assert changed.exit_code == 2, changed.output
    assert "train.learning_rate: 0.002 -> 0.001" in changed.output and "--restart" in changed.output
    assert sorted(p.name for p in lora.iterdir()) == before and not train_events(cfg, "step")

    # the command's own --set applies to it only: the suggestion saves it first, so that what the restart trains is
    # what the run's later plain commands (`run`, `status`) expect
    restart = suggested(changed.output)
    assert restart == [f"lorapipe config finished --artifacts {cfg.artifacts} --set train.learning_rate=0.001",
                       f"lorapipe train finished --artifacts {cfg.artifacts} --restart"], changed.output
    assert paste(restart[0]).exit_code == 0
    restarted = paste(restart[1])
    assert restarted.exit_code == 0 and train_events(cfg, "done"), restarted.output
    assert re.search(r"train +up to date", invoke("status", *by_name(cfg)).output)
    aside = [p for p in lora.iterdir() if p.name.startswith(".restarted-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == before
    status = invoke("status", *by_name(cfg))
    removal = [c for c in re.findall(r"`(rm [^`]+)`", status.output)]
    assert "1 earlier training(s) set aside" in status.output and len(removal) == 1, status.output
    subprocess.run(shlex.split(removal[0]), check=True)
    assert not aside[0].exists() and (lora / "final").is_dir()


@once
def test_a_changed_model_is_named_by_its_path_not_its_hash(built_run, tmp_path):
    cfg = copy_run(built_run, "model-moved")
    gone = invoke("status", *by_name(cfg), "--model", str(tmp_path / "nope")).output
    assert f"model: '{tmp_path / 'nope'}' does not exist" in gone and "local:" not in gone, gone
    edited = tmp_path / "edited"
    shutil.copytree(cfg.model, edited)
    vae = json.loads((edited / "vae" / "config.json").read_text())
    (edited / "vae" / "config.json").write_text(json.dumps({**vae, "scaling_factor": 0.5}))
    changed = invoke("status", *by_name(cfg), "--model", str(edited)).output
    assert f"model: the files of '{edited}' are not the ones it was built from" in changed and "local:" not in changed


@once
def test_an_up_to_date_export_says_so_and_keeps_the_files_of_its_adapter(built_run):
    """A plain export after a `--format kohya` one (and with --verify, or of a checkpoint) is up to date: it
    says so, rewrites nothing and keeps the kohya file, which `status` and `config` count. Once the adapter is another,
    the export removes the old kohya file by name, with the command that writes this adapter's."""
    cfg = copy_run(built_run, "exported")
    export = cfg.run_dir / "export"
    kohya = export / "lora_kohya.safetensors"
    for args in ([], ["--checkpoint", "8"], ["--checkpoint", "8"]):
        result = invoke("export-lora", *by_name(cfg), *args)
        assert result.exit_code == 0, result.output
    where = "export/checkpoint-8/ holds lora/checkpoint-8 (step 8)"
    assert f"export-lora up to date: {where} in every format asked for, with these settings; skipped" in result.output
    assert suggested(result.output) == [f"lorapipe export-lora exported --artifacts {cfg.artifacts} --checkpoint 8 --force"]

    asks = ("config", *by_name(cfg), "--set", "export.format=kohya", "--dry-run")
    assert "makes stale: export-lora" in invoke(*asks).output  # config's diff names it as status will
    # an export that lacks only a format keeps its fingerprint: what reads it (sample) is not made stale by it
    lines = {line.split()[0]: line for line in invoke("status", *by_name(cfg), "--set", "export.format=kohya")
             .output.splitlines() if line.strip()}
    assert "no kohya file in export" in lines["export-lora"] and "export will change" not in lines["sample"], lines
    assert invoke("export-lora", *by_name(cfg), "--format", "kohya").exit_code == 0 and kohya.is_file()
    assert "makes no stage stale" in invoke(*asks).output
    made = (kohya.stat().st_mtime_ns, json.loads((export / "manifest.json").read_text()))
    for args in ([], ["--verify"]):
        again = invoke("export-lora", *by_name(cfg), *args)
        assert again.exit_code == 0, again.output
        assert ("export-lora up to date: export/ holds lora/final (step 8) in every format asked for, with these "
                "settings (and lora_kohya.safetensors, of the same adapter); skipped") in again.output, again.output
        assert (kohya.stat().st_mtime_ns, json.loads((export / "manifest.json").read_text())) == made
    assert re.search(r"export-lora\s+up to date", invoke("status", *by_name(cfg)).output)
    assert paste(suggested(again.output)[0]).exit_code == 0 and kohya.is_file()  # --force: the same adapter's, kept

    manifest = json.loads((export / "manifest.json").read_text())  # as an export of an earlier training left it
    manifest["fingerprint"], manifest["fingerprint_parts"]["lora_step"] = "0" * 16, 4
    (export / "manifest.json").write_text(json.dumps(manifest))
    replaced = invoke("export-lora", *by_name(cfg))
    assert replaced.exit_code == 0 and not kohya.exists(), replaced.output
    assert "warning: removed export/lora_kohya.safetensors, the kohya file of the adapter this export replaces" \
        in replaced.output, replaced.output
    assert paste(suggested(replaced.output)[0]).exit_code == 0 and kohya.is_file()


# ---- 2. command flags and by-name overrides apply to their command only ------------------------------------


@once
def test_command_flags_never_change_the_runs_settings(built_run):
    from stages.core.runspec import RunSpec

    cfg = copy_run(built_run, "one-off")
    saved = (cfg.run_dir / "config.json").read_bytes()
    for args in (["encode-captions", "--vram", "0.001"], ["export-lora", "--verify"],
                 ["cache-latents", "--set", "data.crop_zoom=0.1"], ["status", "--set", "train.steps=3"]):
        result = invoke(args[0], *by_name(cfg), *args[1:])
        assert result.exit_code == 0, (args, result.output)
        assert (cfg.run_dir / "config.json").read_bytes() == saved, args
    after = RunSpec(cfg.run, artifacts=str(cfg.artifacts)).load()
    assert (after.gpu.vram_budget_gb, after.export.verify, after.train.steps) == ("auto", False, 8)
    plan = invoke("plan", *by_name(cfg), "--json")  # plans for the run's budget ("auto"; on CPU it asks for a number)
    assert "0.001" not in plan.output, plan.output


# ---- 3. a run-wide lock between stages that share a store ----------------------------------------------


@once
def test_a_stage_never_rewrites_what_a_running_stage_reads(built_run):
    from stages.core.artifacts import stage_lock

    cfg = copy_run(built_run, "busy")
    latents = (cfg.run_dir / "latents.zarr" / "manifest.json").read_bytes()
    with stage_lock(cfg.run_dir, "train"):  # as a running train holds it
        result = invoke("cache-latents", *by_name(cfg), "--force")
        assert result.exit_code == 2, result.output
        assert (f"stage 'train' of run 'busy' is running (pid {os.getpid()}) and reads latents.zarr, which "
                f"cache-latents writes") in result.output and "lorapipe stop busy" in result.output
        status = invoke("status", *by_name(cfg))
        assert f"running now, pid {os.getpid()}" in next(l for l in status.output.splitlines() if l.startswith("train"))
        assert invoke("encode-captions", *by_name(cfg), "--force").exit_code == 2
        assert invoke("export-lora", *by_name(cfg), "--force").exit_code == 2
    with stage_lock(cfg.run_dir, "cache-latents"):
        result = invoke("train", *by_name(cfg), "--restart")
        assert result.exit_code == 2 and "writes latents.zarr, which train reads" in result.output, result.output
    assert (cfg.run_dir / "latents.zarr" / "manifest.json").read_bytes() == latents
    assert not any(p.name.startswith(".restarted-") for p in (lora_dir(cfg)).iterdir())


# ---- 4. --resume never starts over; a settings change is a diff, and status gives the true next step -------


@once
def test_resume_after_a_settings_change_refuses_and_names_the_keys(built_run, monkeypatch):
    from stages.core import faults
    from stages.core.artifacts import atomic_write_json

    cfg = run_beside(built_run, "changed", **{"train.steps": 6, "runtime.checkpoint_every": 2})
    atomic_write_json(cfg.run_dir / "config.json", cfg.to_dict())
    monkeypatch.setenv(faults.ENV, "train:3:TERM")
    stopped = invoke("train", *by_name(cfg))
    assert stopped.exit_code == 0 and "stopped at step 3" in stopped.output, stopped.output
    monkeypatch.delenv(faults.ENV)

    changed = invoke("config", *by_name(cfg), "--set", "train.steps=4")
    assert changed.exit_code == 0, changed.output
    assert "train.steps: 6 -> 4" in changed.output and "makes stale: train" in changed.output
    assert json.loads((cfg.run_dir / "config.json").read_text())["train"]["steps"] == 4

    status = invoke("status", *by_name(cfg))
    train_line = next(l for l in status.output.splitlines() if l.startswith("train"))
    assert "train.steps: 6 -> 4" in train_line and "--restart" in train_line and "--resume" not in train_line

    lora = sorted(p.name for p in (lora_dir(cfg)).iterdir())
    steps = len(train_events(cfg, "step"))
    resumed = invoke("train", *by_name(cfg), "--resume")
    assert resumed.exit_code == 2, resumed.output
    assert "train.steps: 6 -> 4" in resumed.output and "--restart" in resumed.output
    assert sorted(p.name for p in (lora_dir(cfg)).iterdir()) == lora and len(train_events(cfg, "step")) == steps
    restart = suggested(resumed.output)
    assert len(restart) == 1 and paste(restart[0]).exit_code == 0
    assert train_events(cfg, "done")[-1]["step"] == 4


# ---- 5. the preset and the run never silently disagree ------------------------------------------------------


@once
def test_an_edited_preset_is_named_by_every_command_until_taken(built_run, tmp_path):
    cfg = copy_run(built_run, "from-preset")
    preset = tmp_path / "my-lora.toml"
    text = (f'include = "{demo_config_path(built_run.family)}"\nrun = "from-preset"\nmodel = "{cfg.model}"\n'
            f'artifacts = "{cfg.artifacts}"\ndevice = "cpu"\n[data]\npath = "{cfg.data.path}"\nresolution = 64\n'
            f'[train]\nsteps = 8\n')
    preset.write_text(text)
    taken = invoke("config", "from-preset", "--config", preset)
    assert taken.exit_code == 0 and "settings that differ from the defaults" in taken.output, taken.output

    preset.write_text(text.replace("resolution = 64", "resolution = 32"))
    status = invoke("status", *by_name(cfg))
    assert status.exit_code == 0, status.output
    assert f"{preset} was edited since run 'from-preset' took it" in status.output
    assert "data.resolution: 64 -> 32" in status.output and "makes stale: cache-latents, train, export-lora" in status.output
    assert "cache-latents    up to date" in status.output  # the run keeps its settings
    take = [c for c in suggested(status.output) if " config " in c]
    assert len(take) == 1 and paste(take[0]).exit_code == 0
    again = invoke("status", *by_name(cfg))
    assert "was edited since" not in again.output and "cache-latents    stale  (resolution: 64 -> 32)" in again.output


# ---- 6. every suggested command pastes and works -----------------------------------------------------------


@once
def test_suggested_commands_paste_and_work(built_run, monkeypatch):
    """A run named only by its preset line: `train` first suggests the cache stages; a damaged chunk
    suggests the stage that re-encodes it; a full disk mid-checkpoint suggests the command that continues."""
    import safetensors.torch

    from stages.core.config import load_config

    cfg = load_config(demo_config_path(built_run.family), {"model": built_run.model, "data.path": built_run.data.path,
                                                           "artifacts": built_run.artifacts, "device": "cpu",
                                                           "run": "early"})
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    line = ["--config", demo_config_path(built_run.family), "--run", "early", "--model", cfg.model,
            "--set", f"data.path={cfg.data.path}", "--set", f"artifacts={cfg.artifacts}", "--set", "device=cpu",
            "--set", "train.steps=4", "--set", "runtime.checkpoint_every=2"]
    first = invoke("train", *line)
    assert first.exit_code == 2 and "python pipeline.py" not in first.output, first.output
    commands = suggested(first.output)
    assert {c.split()[1] for c in commands} >= {"encode-captions", "cache-latents"}, first.output
    for command in commands:
        if command.split()[1] != "run":
            assert paste(command).exit_code == 0, command

    chunk = next(p for p in sorted((cfg.run_dir / "latents.zarr").rglob("c/*")) if p.is_file())
    chunk.unlink()
    status = invoke("status", *line)
    damaged = [c for c in suggested(status.output) if c.split()[1] == "cache-latents"]
    assert damaged and "python pipeline.py" not in status.output, status.output
    assert paste(damaged[0]).exit_code == 0 and "damaged" not in invoke("status", *line).output

    real = safetensors.torch.save_file
    calls: list[int] = []

    def fills_up(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", fills_up)
    full = invoke("train", *line)
    assert full.exit_code == 2 and "disk full" in full.output, full.output
    monkeypatch.undo()
    again = suggested(full.output)
    assert len(again) == 1 and again[0].endswith("--resume"), full.output
    assert paste(again[0]).exit_code == 0 and train_events(cfg, "done")


def test_no_message_spells_the_old_command():
    """Every string the product prints (not docstrings) spells commands `lorapipe ...`."""
    import ast

    root = Path(pipeline.__file__).parent
    found = []
    for path in [root / "pipeline.py", *sorted((root / "stages").rglob("*.py"))]:
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                    and "python pipeline.py" in node.value:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []


def test_a_saved_config_with_runtime_keys_under_train_is_rewritten_once_with_the_same_settings(tmp_path, capsys):
    """A run's config.json that holds how the stages run under [train] (as versions before [runtime] wrote
    it) loads with the same settings: the keys move to [runtime] in the file, once, with a line saying so."""
    import json

    from stages.core.config import build_config
    from stages.core.runspec import read_saved

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"run": "x", "model": "m", "train": {"steps": 5, "cuda_graphs": "off", "checkpoint_every": 7}}))
    data = read_saved(path)
    assert data["train"] == {"steps": 5} and data["runtime"] == {"cuda_graphs": "off", "checkpoint_every": 7}
    assert "2 keys of how the stages run moved from [train] to [runtime]" in capsys.readouterr().err
    assert json.loads(path.read_text()) == data
    cfg = build_config(data)
    assert (cfg.train.steps, cfg.runtime.cuda_graphs, cfg.runtime.checkpoint_every) == (5, "off", 7)
    assert read_saved(path) == data and capsys.readouterr().err == ""  # rewritten once


# ---- 7. status and inspect show one state; an input error blocks stages without hiding them ----------------


@once
def test_status_and_inspect_agree_and_a_missing_caption_blocks_the_stages(built_run, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(built_run.data.path, data)
    cfg = copy_run(built_run, "states", **{"data.path": str(data)})
    image = sorted(data.glob("*.png"))[0]

    def states() -> tuple[dict[str, str], dict]:
        status = invoke("status", *by_name(cfg))
        assert status.exit_code == 0, status.output
        shown = invoke("inspect", *by_name(cfg), "--json", "--rows", "1")
        assert shown.exit_code == 0, shown.output
        lines = {line.split()[0]: line for line in status.output.splitlines() if line[:1].strip()}
        return lines, json.loads(shown.output)["stages"]

    image.write_bytes(image.read_bytes()[:200])  # changed (and corrupt): the latents will change, and all below
    lines, report = states()
    assert report["train"] == {"up_to_date": False, "blocked": False, "reasons": ["because latents will change"]}
    assert lines["train"].split(None, 1)[1] == "stale  (because latents will change)"
    for name, state in report.items():
        assert ("up to date" in lines[name]) == state["up_to_date"], (name, lines[name], state)

    image.with_suffix(".txt").unlink()
    lines, report = states()
    caption = f"has no caption file '{image.with_suffix('.txt').name}'; add one or move the image out"
    assert lines["encode-captions"].split()[1] == "blocked" and caption in lines["encode-captions"]
    assert "waits on encode-captions and cache-latents, which are blocked" in lines["train"]
    assert all(state["blocked"] and not state["up_to_date"] for state in report.values())
    assert caption in report["encode-captions"]["reasons"][0]
