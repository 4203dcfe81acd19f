"""The edges a new user meets first: file modes on a shared machine, a model folder of another family,
every bad input named at once, orphan captions, flag values and keys blamed on the flag, a stopped
cache stage, a closed pipe, one loss summary, --version."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from click.testing import CliRunner

import pipeline
from badinput import write_good_images, write_image_cases
from conftest import FAMILIES, ROOT, demo_config_path, make_cfg, once, run_beside, tiny_model
from stages.core.caches import lora_dir


def invoke(*args):
    return CliRunner().invoke(pipeline.cli, [str(a) for a in args])


def preset_line(assets, data, root, family="flux"):
    return ["--config", demo_config_path(family), "--model", tiny_model(assets, FAMILIES[family]),
            "--set", f"data.path={data}", "--set", f"artifacts={root}", "--set", "device=cpu"]


# ---- 7. files follow the user's umask ---------------------------------------------------------------


@once
def test_adapters_checkpoints_and_exports_follow_the_umask(built_run):
    """safetensors' save_file makes 0600 files: teammates could not read the LoRA."""
    from stages import export_lora, train

    cfg = run_beside(built_run, "modes", **{"train.steps": 2, "runtime.checkpoint_every": 1, "runtime.keep_checkpoints": 0})
    old = os.umask(0o022)
    try:
        train.run(cfg)
        export_lora.run(cfg)
    finally:
        os.umask(old)
    written = [p for folder in ("lora", "export") for p in (cfg.run_dir / folder).rglob("*")]
    modes = {p.relative_to(cfg.run_dir).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in written}
    assert "lora/final/adapter_model.safetensors" in modes and "export/pytorch_lora_weights.safetensors" in modes
    wrong = {name: oct(m) for name, m in modes.items() if m != (0o755 if (cfg.run_dir / name).is_dir() else 0o644)}
    assert wrong == {}


def test_save_safetensors_is_atomic_and_follows_the_umask(tmp_path):
    import torch
    from safetensors.torch import load_file

    from stages.core.artifacts import save_safetensors

    old = os.umask(0o027)
    try:
        save_safetensors(tmp_path / "x.safetensors", {"w": torch.ones(2)}, {"rank": "4"})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.safetensors").stat().st_mode) == 0o640
    assert load_file(str(tmp_path / "x.safetensors"))["w"].tolist() == [1.0, 1.0]
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


# ---- 8. a model folder of another family --------------------------------------------------------------


def test_a_model_folder_of_another_family_fails_in_one_line(assets, demo_data, tmp_path):
    result = invoke("encode-captions", *preset_line(assets, demo_data, tmp_path), "--set", "family=sdxl",
                    "--set", "captions.max_sequence_length=77")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert "holds a FluxPipeline" in lines[0] and "family = 'sdxl' trains a StableDiffusionXLPipeline" in lines[0]
    assert "set family = 'flux'" in lines[0]


# ---- 9. bad inputs together, orphan captions ----------------------------------------------------------


def test_every_missing_caption_is_named_at_once(tmp_path):
    from stages.core.dataset import DatasetError, scan

    names = write_good_images(tmp_path, 25)
    for name in names:
        (tmp_path / name).with_suffix(".txt").unlink()
    with pytest.raises(DatasetError) as e:
        scan(tmp_path)
    message = str(e.value)
    assert message.startswith("25 images or captions need fixing") and message.endswith("... and 5 more")
    assert sum(f"has no caption file '{n.rsplit('.', 1)[0]}.txt'" in message for n in names) == 20


def test_every_bad_image_is_named_at_once_and_the_good_rows_are_kept(assets, tmp_path):
    import shutil

    from stages import cache_latents
    from stages.core.image_io import BadImage
    from stages.core.rowstore import RowStore

    data, corpus = tmp_path / "data", tmp_path / "corpus"
    write_good_images(data, 3)
    write_image_cases(corpus)
    for name in ("truncated.jpg", "zero_byte.png", "not_an_image.png"):
        shutil.copy(corpus / name, data / name)
        shutil.copy((corpus / name).with_suffix(".txt"), (data / name).with_suffix(".txt"))
    other = bytearray((corpus / "truncated.jpg").read_bytes())
    other[-10] ^= 0xFF  # other bytes (not a duplicate), the same cut-off picture data
    (data / "truncated2.jpg").write_bytes(bytes(other))
    (data / "truncated2.txt").write_text("a cut-off picture")
    cfg = make_cfg("flux", assets, data, tmp_path / "artifacts", **{"data.cache_variants": 1})
    with pytest.raises(BadImage) as headers:  # found from the headers: nothing encoded yet
        cache_latents.run(cfg)
    assert str(headers.value).startswith("2 images need fixing")
    assert "zero_byte.png" in str(headers.value) and "not_an_image.png" in str(headers.value)
    for name in ("zero_byte.png", "not_an_image.png"):
        (data / name).unlink()
    with pytest.raises(BadImage) as loaded:  # found while encoding: every other image is encoded first
        cache_latents.run(cfg)
    assert str(loaded.value).startswith("2 images need fixing")
    assert "truncated.jpg" in str(loaded.value) and "truncated2.jpg" in str(loaded.value)
    stores = [g for g in (cfg.run_dir / "latents.zarr").iterdir() if (g / "zarr.json").exists() and g.name[0].isdigit()]
    assert sum(int(RowStore.open(g).written_mask().sum()) for g in stores) == 3


def test_orphan_captions_are_warned_once(tmp_path):
    from stages.core.dataset import scan

    write_good_images(tmp_path, 2)
    (tmp_path / "lost.txt").write_text("a caption whose image was deleted")
    (tmp_path / "old.txt").write_text("another one")
    variant = sorted(tmp_path.glob("*.png"))[0].with_suffix(".1.txt")
    variant.write_text("a second caption of the first image")
    warnings: list[tuple[str, str | None]] = []
    scan(tmp_path, warn=lambda message, item: warnings.append((message, item)))
    orphans = [m for m, _ in warnings if "no image beside them" in m]
    assert len(orphans) == 1 and "'lost.txt'" in orphans[0] and "'old.txt'" in orphans[0]
    assert variant.name not in orphans[0]


# ---- 9. flag values and keys are blamed on the flag ------------------------------------------------------


def test_a_bad_flag_value_or_key_names_the_flag(assets, demo_data, tmp_path):
    line = preset_line(assets, demo_data, tmp_path)
    vram = invoke("encode-captions", *line, "--vram", "abc")
    assert vram.exit_code == 2 and "--vram abc: 'gpu.vram_budget_gb' must be 'auto' or a number, got 'abc'" in vram.output
    assert "typing" not in vram.output and "defaults" not in vram.output
    assert not (tmp_path / "demo").exists()  # nothing saved for a command that was refused
    key = invoke("encode-captions", *line, "--set", "train.stpes=3")
    assert key.exit_code == 2, key.output
    assert "--set train.stpes=3: unknown key 'train.stpes' (did you mean 'train.steps'?)" in key.output
    image = tmp_path / "some.jpg"
    image.write_bytes(b"\xff\xd8\xff")
    model = invoke("encode-captions", *line, "--model", image)
    assert model.exit_code == 2 and f"model '{image}' is a file, neither a diffusers pipeline folder" in model.output
    assert "does not exist" not in model.output


# ---- 9. a stopped cache stage; a closed pipe; one loss summary; --version --------------------------------


def test_sigterm_stops_a_cache_stage_with_an_event_and_one_line(assets, demo_data, tmp_path, monkeypatch):
    from stages.core import faults
    from stages.core.events import read_events

    monkeypatch.setenv(faults.ENV, "cache-latents:2:TERM")  # as `lorapipe stop` after two images
    result = invoke("cache-latents", *preset_line(assets, demo_data, tmp_path))
    assert result.exit_code == 130, result.output
    assert "cache-latents: stopped; what it wrote is kept, and `lorapipe cache-latents" in result.output
    assert "Aborted!" not in result.output and "failed" not in result.output
    events = [e for e in read_events(tmp_path / "demo") if e["stage"] == "cache-latents"]
    assert events[-1]["event"] == "stopped" and not [e for e in events if e["event"] == "error"]
    monkeypatch.delenv(faults.ENV)
    again = invoke("cache-latents", "demo", "--artifacts", tmp_path)
    # kept: the two rows, and the third image's, whose encode was queued before the stop (encode_units' pipeline)
    assert again.exit_code == 0 and "9 of 12 encoded this run" in again.output, again.output


def test_status_into_a_closed_pipe_says_nothing(assets, demo_data, tmp_path):
    invoke("config", *preset_line(assets, demo_data, tmp_path))
    script = "import sys; sys.argv = ['lorapipe', 'status', 'demo', '--artifacts', sys.argv[1]]; import pipeline; pipeline.cli()"
    shell = f"{sys.executable} -c {script!r} {tmp_path} | head -1"
    result = subprocess.run(["bash", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.startswith("encode-captions") and "Broken pipe" not in result.stderr, result.stderr


@once
def test_the_train_summary_and_report_give_the_same_losses(built_run):
    from stages import report
    from stages.core.artifacts import read_manifest
    from stages.core.events import read_events

    final = read_manifest(lora_dir(built_run) / "final")
    summary = report.summary(read_events(built_run.run_dir), report.train_curve(read_events(built_run.run_dir)), 0.9)
    assert (final["loss_first"], final["loss_last"]) == (summary["loss_first"], summary["loss_last"])


def test_version():
    from importlib.metadata import version

    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"lorapipe {version('lorapipe')}"
