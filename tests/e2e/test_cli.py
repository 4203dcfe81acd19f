"""The command surface (`pipeline.py`): shared options, the torchrun child command line, read-only
folders and OS errors as messages, child stages that die with their parent, make's RUN.

In-process through click's CliRunner where possible; one small subprocess for the orphan test.
"""

from __future__ import annotations

import builtins
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import pipeline
from conftest import ROOT, make_cfg
from stages.core.runspec import RunSpec

NAMES_A_RUN = {name for name, c in pipeline.cli.commands.items()
               if name not in ("keys", "demo") and not isinstance(c, click.Group)}  # `lora`: a group of file tools


def invoke(*args: str):
    return CliRunner().invoke(pipeline.cli, list(args))


# ---- one command surface ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", sorted(pipeline.cli.commands))
def test_every_command_help_has_examples_and_the_shared_options(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert "Examples:" in result.output and f"lorapipe {command}" in result.output
    if command in NAMES_A_RUN:
        for shared in ("[RUN]", "--config", "--artifacts", "--set", "--verbose"):
            assert shared in result.output, f"{command} --help lacks {shared}"


@pytest.mark.parametrize("command", ["encode-captions", "cache-latents", "train", "export-lora", "sample"])
def test_every_stage_that_redoes_work_takes_force(command):
    assert "--force" in invoke(command, "--help").output


def test_torchrun_passes_the_child_options_on_untouched():
    """`run --gpus 2 --run NAME` crashed in torchrun ("ambiguous option: --run could match --run-path"):
    torchrun's own parser must hand every child option to pipeline.py, and click must read them back."""
    from torch.distributed.run import get_args_parser

    spec = RunSpec("my-run", "configs/flux-dev.toml", "/data/runs", "/models/flux", ("train.steps=3", "run=x"))
    args = [*spec.child_args(), "--resume"]
    command = pipeline.stage_command("train", args, gpus=2)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    parsed = get_args_parser().parse_args(command[3:])
    assert parsed.training_script == str(ROOT / "pipeline.py") and parsed.training_script_args == ["train", *args]
    params = pipeline.cli.commands["train"].make_context("train", list(args)).params
    assert (params["run_name"], params["config"], params["artifacts"], params["model"], params["sets"], params["resume"]) == \
        ("my-run", "configs/flux-dev.toml", "/data/runs", "/models/flux", ("train.steps=3", "run=x"), True)


def test_demo_family_is_a_choice_of_the_registry():
    from stages.families import FAMILIES

    result = invoke("demo", "--family", "flx")
    assert result.exit_code == 2 and "Traceback" not in result.output and "KeyError" not in result.output
    assert all(name in result.output for name in FAMILIES), result.output
    # run as `python pipeline.py` (the Makefile's way), usage lines name the command a user types
    out = subprocess.run([sys.executable, "pipeline.py", "demo", "--family", "flx"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "Usage: lorapipe demo" in out.stderr and "pipeline.py" not in out.stderr, out.stderr



def test_keys_lists_the_choices_of_enumerated_keys():
    from stages.families import FAMILIES

    lines = {line.split()[0]: line for line in invoke("keys").output.splitlines()}
    assert lines["device"].endswith("['auto' | 'cpu' | 'cuda']") and lines["data.crop"].endswith("['random' | 'center']")
    assert lines["family"].endswith(" | ".join(repr(name) for name in sorted(FAMILIES)) + "]"), "every registered family"
    assert all(len(line.split()) > 2 for line in lines.values()), "a key without a meaning"


def test_train_force_and_resume_exclude_each_other():
    result = invoke("train", "some-run", "--resume", "--force")
    assert result.exit_code == 2 and "exclude each other" in result.output


# ---- a run by name; status -------------------------------------------------------------------------


@pytest.fixture
def saved_run(assets, demo_data, tmp_path):
    """A run that exists only as its saved config.json (no stage has run), under tmp_path/runs."""
    from stages.core.artifacts import atomic_write_json

    cfg = make_cfg("flux", assets, demo_data, tmp_path / "runs", run="named-run")
    atomic_write_json(cfg.run_dir / "config.json", cfg.to_dict())
    return cfg


def test_a_run_name_reads_the_saved_config_under_artifacts(saved_run):
    cfg = RunSpec("named-run", artifacts=saved_run.artifacts, sets=("train.steps=3",)).load()
    assert (cfg.run_dir, cfg.model, cfg.train.steps) == (saved_run.run_dir, saved_run.model, 3)
    missing = invoke("status", "named-run")  # looks in ./artifacts, where this run is not
    assert missing.exit_code == 2 and "artifacts/named-run/config.json" in missing.output and "--artifacts" in missing.output


def test_run_dry_run_prints_the_plan_and_runs_nothing(saved_run):
    before = sorted(p.name for p in saved_run.run_dir.iterdir())
    result = invoke("run", "named-run", "--artifacts", saved_run.artifacts, "--dry-run", "--vram", "6")
    assert result.exit_code == 0, result.output
    for stage in ("encode-captions", "cache-latents", "train"):
        assert stage in result.output
    assert sorted(p.name for p in saved_run.run_dir.iterdir()) == before  # no cache, no events


def test_status_passes_staleness_downstream_and_lists_sample(saved_run):
    result = invoke("status", "named-run", "--artifacts", saved_run.artifacts)
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines()}
    assert "because captions and latents will change" in lines["train"]
    assert "because the LoRA will change" in lines["export-lora"]
    assert "because the export will change" in lines["sample"]


def test_status_shows_the_realised_batch_sizes(saved_run):
    from stages import train
    from stages.core.artifacts import write_manifest

    final = train.artifact_dir(saved_run)
    final.mkdir(parents=True)
    write_manifest(final, "train", kind="final", step=12, complete=True, fingerprint="f", fingerprint_parts={},
                   batch_sizes={"4": 10, "1": 2})
    output = invoke("status", "named-run", "--artifacts", saved_run.artifacts).output
    assert "10 steps at batch 4, 2 steps at batch 1" in output


# ---- read-only artifacts and OS errors -------------------------------------------------------------


def _writing(mode: str | int) -> bool:
    if isinstance(mode, int):
        return bool(mode & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    return any(c in mode for c in "wax+")


@pytest.fixture
def read_only(monkeypatch):
    """Make a folder read-only for this process: root ignores chmod, so writes under it fail as on a
    read-only mount (EROFS), at the OS calls every write goes through."""
    def make(root: Path) -> None:
        root = str(root.resolve())

        def refuse(path: object) -> None:
            if str(Path(os.fsdecode(path)).resolve()).startswith(root):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

        real_open, real_os_open, real_mkdir = builtins.open, os.open, Path.mkdir

        def fake_open(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, bytes, os.PathLike)) and _writing(mode):
                refuse(file)
            return real_open(file, mode, *args, **kwargs)

        def fake_os_open(path, flags, *args, **kwargs):
            if _writing(flags):
                refuse(path)
            return real_os_open(path, flags, *args, **kwargs)

        def fake_mkdir(self, *args, **kwargs):
            refuse(self)
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(os, "open", fake_os_open)
        monkeypatch.setattr(Path, "mkdir", fake_mkdir)
    return make


def test_a_read_only_artifacts_folder_allows_status_and_refuses_train_in_one_line(saved_run, read_only):
    for stage in ("train", "cache-latents"):  # status probes the locks: it must not open them for writing
        (saved_run.run_dir / f".{stage}.lock").write_text("pid 1")
    read_only(Path(saved_run.artifacts))
    status = invoke("status", "named-run", "--artifacts", saved_run.artifacts)
    assert status.exit_code == 0 and "encode-captions" in status.output, status.output
    train = invoke("train", "named-run", "--artifacts", saved_run.artifacts)
    assert train.exit_code == 2, train.output
    assert train.stderr.count("\n") == 1 and "not writable" in train.stderr and str(Path(saved_run.artifacts).resolve()) in train.stderr


def test_os_errors_reaching_the_cli_are_one_line_naming_the_path(capsys):
    with pytest.raises(SystemExit) as exit_:
        pipeline._fail(PermissionError(errno.EACCES, "Permission denied", "/runs/x/config.json"))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "Permission denied: '/runs/x/config.json'; make it writable, or pass --artifacts" in err


def test_long_item_names_get_a_file_name_that_fits():
    from stages.core.fsaccess import NAME_MAX, short_name

    long_name = short_name("x" * 245 + "-v0", "-mean.png")
    assert len(long_name.encode()) <= NAME_MAX and long_name.endswith("-mean.png")
    assert short_name("x" * 245 + "-v1", "-mean.png") != long_name and short_name("cat-v0", ".png") == "cat-v0.png"


def test_decoded_sizes_are_printed_width_by_height():
    info = {"size": [96, 64], "bucket": "96x64", "original_size": [80, 120], "crop_top_left": [3, 5], "flip": True,
            "latent_shape": [16, 8, 12], "sampled": False}
    text = pipeline.describe_decoded(info)
    assert "96×64 px (W×H), bucket 96×64, original 120×80, crop at x=5 y=3, flipped" in text


# ---- child stages die with their parent; make ------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has exited, waiting to be reaped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_run_parent_takes_its_child_stage_with_it(tmp_path):
    """SIGKILL `run`'s process (it cannot pass anything on) -> its child stage exits within seconds."""
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                               f"from stages.core.proc import call_child; call_child([sys.executable, '-c', {child!r}])"])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child_pid = int(pid_file.read_text())
    assert os.getpgid(child_pid) == child_pid  # its own process group: `stop` can reach all of it
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(child_pid)
    if alive:
        os.kill(child_pid, signal.SIGKILL)
    assert not alive, "the child stage outlived its killed parent"


@pytest.mark.parametrize("target", ["status", "train", "run", "inspect", "report", "stop"])
def test_make_targets_honour_run_and_artifacts(target):
    out = subprocess.run(["make", "-n", target, "RUN=my-lora", "ARTIFACTS=/data/runs"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    commands = [line for line in out.splitlines() if "pipeline.py" in line]
    assert commands and all(" my-lora " in c and "--artifacts /data/runs" in c and "configs/demo.toml" not in c
                            for c in commands), out


# ---- hints that work when pasted -------------------------------------------------------------------


def test_kohya_verify_failure_names_the_failed_check_and_a_readme_section_that_exists(monkeypatch):
    """diffusers' kohya converters fail with a bare `assert`: the message said "AssertionError: no
    message" and pointed at a README section that did not exist."""
    from stages.core import verify

    namespace: dict = {}  # compiled here: pytest would give an assert in this file a message
    exec(compile("def converter(state):\n    assert len(state) == 3\n", "lora_conversion_utils.py", "exec"), namespace)
    with pytest.raises(AssertionError) as bare:
        namespace["converter"]({})
    assert str(bare.value) == ""

    def conversion_fails(pipeline_cls, file):
        raise bare.value

    monkeypatch.setattr(verify, "pipeline_state_dict", conversion_fails)
    with pytest.raises(verify.VerifyError) as failed:
        verify.load_into(None, type("FluxPipeline", (), {}), Path("lora_kohya.safetensors"), "transformer", "check")
    message = str(failed.value)
    assert "AssertionError in converter (lora_conversion_utils.py:2)" in message and "no message" not in message
    section = message.split("(README, '")[1].split("'")[0]
    assert f"## {section}" in (ROOT / "README.md").read_text().splitlines()


def test_the_offline_hint_names_a_command_the_venv_has():
    from stages.core.model_source import _offline_hint

    hint = _offline_hint("black-forest-labs/FLUX.1-dev", OSError("no network"))
    assert "`hf download black-forest-labs/FLUX.1-dev`" in hint and "huggingface-cli" not in hint
    assert (Path(sys.executable).parent / "hf").exists()


def test_stop_reaches_a_running_cache_stage(tmp_path):
    """`stop` handled only train; a cache stage (here: a process holding cache-latents' lock, as the
    stage does while it encodes) now gets SIGTERM and ends."""
    run_dir = tmp_path / "runs" / "caching"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from stages.core.artifacts import "
         "stage_lock\nwith stage_lock(Path(sys.argv[1]), 'cache-latents'):\n print('locked', flush=True); "
         "time.sleep(120)", str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = invoke("stop", "caching", "--artifacts", str(tmp_path / "runs"))
        assert result.exit_code == 0 and f"SIGTERM to cache-latents (pid {holder.pid})" in result.output
        assert holder.wait(timeout=10) == -signal.SIGTERM
    finally:
        holder.kill()


def test_a_run_folder_path_names_the_run_and_its_root():
    """RUN as a path (`inspect artifacts/my-lora`): the run is its last part, the root the rest; --artifacts, or a
    plain name, leave it as given."""
    assert RunSpec("artifacts/my-lora").from_path() == RunSpec("my-lora", artifacts="artifacts")
    assert RunSpec("/data/runs/x/").from_path() == RunSpec("x", artifacts="/data/runs")
    assert RunSpec("./x").from_path().run_dir() == Path("x")
    assert RunSpec("my-lora").from_path() == RunSpec("my-lora")
    assert RunSpec("a/b", artifacts="/r").from_path() == RunSpec("a/b", artifacts="/r")
    assert RunSpec(None, "configs/flux-dev.toml").from_path() == RunSpec(None, "configs/flux-dev.toml")


def test_a_mistyped_family_gets_the_closest_name(saved_run):
    result = invoke("status", "named-run", "--artifacts", str(saved_run.artifacts), "--set", "family=flux2klein")
    assert result.exit_code == 2 and "did you mean 'flux2-klein'?" in result.output, result.output
    # a family's limit that the saved settings break is put on the flag that named the family
    other = invoke("status", "named-run", "--artifacts", str(saved_run.artifacts), "--set", "family=sdxl")
    assert other.exit_code == 2 and other.output.startswith("error: --set family=sdxl: 'captions.max_sequence_length'"), \
        other.output
