"""inspect (offline report, --json, --decode), the sample stage (base vs LoRA grid), report (loss/LR
plot), and single-file model sources; on the tiny real-architecture runs of conftest.built_run."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

import pipeline
from conftest import ROOT, demo_config_path, once, tiny_model
from stages import inspect as inspect_stage
from stages import report, sample
from stages.core.artifacts import RowStore, atomic_write_json, read_json, read_manifest
from stages.core.config import SampleConfig
from stages.core.schema import Bucket
from stages.core.dataset import scan
from stages.core.events import read_events, terminal_line, validate_event
from stages.core.caches import export_dir, lora_dir
from stages.families import get_family


@pytest.fixture
def run_copy(built_run, tmp_path):
    """The built run copied, so these tests may damage or add to it freely."""
    shutil.copytree(built_run.run_dir, tmp_path / built_run.run, ignore=shutil.ignore_patterns(".*.lock"))
    cfg = dataclasses.replace(built_run, artifacts=str(tmp_path))
    atomic_write_json(cfg.run_dir / "config.json", cfg.to_dict())  # as every pipeline.py stage command leaves it
    return cfg


def cli_sets(cfg) -> list[str]:
    """--set flags that rebuild `cfg` from the family's demo preset (as conftest.make_cfg does)."""
    sets = {"model": cfg.model, "data.path": cfg.data.path, "artifacts": cfg.artifacts, "device": cfg.device,
            "train.steps": cfg.train.steps}
    return ["--config", str(demo_config_path(cfg.family)), *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]


# ---- inspect ---------------------------------------------------------------------------------------


def test_inspect_reports_every_artifact(built_run):
    rep = inspect_stage.inspect_run(built_run.run_dir, built_run)
    assert json.loads(inspect_stage.to_json(rep))["run"] == built_run.run
    items = scan(built_run.data.path)

    cap = rep["captions"]
    assert cap["rows"] == cap["written"] == len({it.caption_id for it in items})
    assert {c["text"] for c in cap["captions"]} == {it.caption for it in items}
    assert sorted(k for c in cap["captions"] for k in c["items"]) == sorted(it.key for it in items)
    assert cap["orphaned_rows"] == cap["missing_rows"] == []
    assert all(f["nan"] == f["inf"] == 0 for f in cap["fields"].values())

    lat, manifest = rep["latents"], read_manifest(built_run.run_dir / "latents.zarr")
    assert lat["images"] == sum(b["rows"] for b in lat["buckets"].values()) == len({it.image_id for it in items})
    channels = {b["shape"][1] for b in lat["buckets"].values()}
    assert {b["shape"][0] for b in lat["buckets"].values()} == {built_run.data.cache_variants} and len(channels) == 1
    stats = lat["channel_stats"]
    assert len(stats["mean"]) == len(stats["normalized_std"]) == channels.pop()
    assert np.isfinite(stats["normalized_mean"]).all() and lat["normalization"] == manifest["normalization"]
    assert all(b["mean"] == {"nan": 0, "inf": 0} and not b["orphaned_rows"] for b in lat["buckets"].values())

    assert {k for k, s in rep["stages"].items() if s["up_to_date"]} == {"encode-captions", "cache-latents", "train",
                                                                         "export-lora"}
    assert rep["stages"]["sample"]["reasons"] == ["never built: no manifest yet"]
    expert = built_run.train.expert  # a two-expert family's report holds each expert's adapter and export
    lora, export = (rep[k][expert] if expert else rep[k] for k in ("lora", "export"))
    final = lora["final"]
    assert final["step"] == built_run.train.steps and final["lora_config"]["r"] == built_run.train.rank
    assert final["hyper_parameters"]["learning_rate"] == built_run.train.learning_rate
    assert export["files"]["pytorch_lora_weights.safetensors"] > 0
    if expert:  # the other expert, untrained in this run, is named with nothing in it
        assert [e for e, section in rep["lora"].items() if section["final"] is None] == [
            e for e in get_family(built_run.family).experts if e != expert]


def test_inspect_finds_nan_orphaned_missing_and_stale(run_copy):
    run_dir = run_copy.run_dir
    lat_manifest = read_json(run_dir / "latents.zarr" / "manifest.json")
    bucket = sorted(lat_manifest["buckets"])[0]
    store = RowStore.open(run_dir / "latents.zarr" / bucket, mode="a")
    mean = store.read("mean", 0).copy()
    mean.reshape(-1)[:3] = np.nan  # three values of the first variant (images and clips alike)
    store.write_row(0, {"mean": mean})
    dropped = store.ids[-1]
    del lat_manifest["index"][dropped]  # a row no manifest points at: orphaned
    atomic_write_json(run_dir / "latents.zarr" / "manifest.json", lat_manifest)
    cap_manifest = read_json(run_dir / "captions.zarr" / "manifest.json")
    caption_id, row = next(iter(cap_manifest["rows"].items()))
    RowStore.open(run_dir / "captions.zarr", mode="a").group["written"][row] = 0  # referenced, never written

    changed = dataclasses.replace(run_copy, train=dataclasses.replace(run_copy.train, learning_rate=0.123))
    rep = inspect_stage.inspect_run(run_dir, changed)
    b = rep["latents"]["buckets"][bucket]
    assert b["mean"]["nan"] == 3 and b["orphaned_rows"] == [dropped]
    assert rep["captions"]["missing_rows"] == [caption_id]
    assert not rep["stages"]["train"]["up_to_date"] and "0.123" in " ".join(rep["stages"]["train"]["reasons"])


def test_inspect_cli_json_and_tables(run_copy):
    result = CliRunner().invoke(pipeline.cli, ["inspect", run_copy.run, "--json", "--artifacts", run_copy.artifacts])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["latents"]["variants"] == run_copy.data.cache_variants
    tables = CliRunner().invoke(pipeline.cli, ["inspect", run_copy.run, "--artifacts", run_copy.artifacts])
    assert tables.exit_code == 0 and "per-channel latent statistics" in tables.output and "captions.zarr" in tables.output
    missing = CliRunner().invoke(pipeline.cli, ["inspect", "no-such-run", "--artifacts", run_copy.artifacts])
    assert missing.exit_code == 2 and run_copy.run in missing.output  # names the runs that exist
    # the run folder's path as RUN (what `ls` shows): the same report
    by_path = CliRunner().invoke(pipeline.cli, ["inspect", str(run_copy.run_dir) + "/", "--json"])
    assert by_path.exit_code == 0, by_path.output
    assert json.loads(by_path.output)["path"] == str(run_copy.run_dir)


def test_decode_cached_variant_with_the_vae(run_copy, tmp_path):
    manifest = read_manifest(run_copy.run_dir / "latents.zarr")
    key = sorted(manifest["items"])[0]
    bucket = manifest["index"][manifest["items"][key]]["bucket"]
    width, height, frames = Bucket.parse(bucket)
    out, info = inspect_stage.decode(run_copy, key, 1, tmp_path / "mean.png")  # a clip: its frames side by side
    assert Image.open(out).size == (width * frames, height) and info["variant"] == 1 and info["bucket"] == bucket
    again, _ = inspect_stage.decode(run_copy, key, 1, tmp_path / "mean2.png")
    pixels = [np.asarray(Image.open(p)) for p in (out, again)]
    assert np.array_equal(*pixels)  # the mean decodes deterministically
    draws = [np.asarray(Image.open(inspect_stage.decode(run_copy, key, 1, tmp_path / f"s{s}.png", True, s)[0]))
             for s in (0, 1)]
    assert not np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[0], pixels[0])
    with pytest.raises(inspect_stage.InspectError, match="variants 0.."):
        inspect_stage.decode(run_copy, key, run_copy.data.cache_variants, tmp_path / "x.png")
    with pytest.raises(inspect_stage.InspectError, match="known items"):
        inspect_stage.decode(run_copy, "nope.png", 0, tmp_path / "x.png")
    result = CliRunner().invoke(pipeline.cli, ["inspect", run_copy.run, "--artifacts", run_copy.artifacts,
                                               "--decode", key, "--variant", "2", "--sample"])
    assert result.exit_code == 0, result.output
    assert (run_copy.run_dir / "inspect" / f"{key.rsplit('.', 1)[0]}-v2-sample.png").is_file()


# ---- sample ----------------------------------------------------------------------------------------

PROMPTS, SEEDS, SIZE = ["a red circle on a white background", "a blue square"], [0, 1], 32


def sample_cfg(cfg, **extra):
    return dataclasses.replace(cfg, sample=SampleConfig(prompts=PROMPTS, seeds=SEEDS, steps=2, width=SIZE,
                                                        height=SIZE, **extra))


def grid_cell(grid: Image.Image, column: int, row: int, scale: int) -> np.ndarray:
    """One image of the grid at its rendered size (the grid upscales by an integer, NEAREST)."""
    cell = SIZE * scale
    x, y = 200 + column * (cell + 4), 28 + row * (cell + 4)
    return np.asarray(grid.crop((x, y, x + cell, y + cell)))[::scale, ::scale]


def test_sample_grid_base_checkpoints_and_lora(run_copy):
    """Columns base | checkpoints | LoRA (edit families: control | base | ...); the base column is
    exactly what the family's pipeline renders for the same prompt, seed (and control images). A video
    family's animated grid plays at the rate its model generates (the demos' data.fps = 0: the clips' own),
    and the summary counts clips."""
    import contextlib

    import diffusers
    import torch

    from stages.core import image_io
    from stages import registry
    from stages.core.stage import staleness
    from stages.families import get_family

    cfg = sample_cfg(run_copy, every_n_checkpoints=1)
    manifest = sample.run(cfg)
    edits = sample.edit_rows(cfg)  # None for text-to-image families
    prompts, lead = ([p for p, _ in edits], ["control"]) if edits else (PROMPTS, [])
    kept = sorted(p.name for p in (lora_dir(cfg)).glob("checkpoint-*")
                  if int(p.name.split("-")[1]) != cfg.train.steps)
    assert manifest["columns"] == [*lead, "base", *kept, f"LoRA (step {cfg.train.steps})"]
    scale = -(-sample.MIN_CELL // SIZE)
    grid = Image.open(cfg.run_dir / "samples" / sample.GRID)
    cols, rows = len(manifest["columns"]), len(prompts) * len(SEEDS)
    assert grid.size == (200 + cols * (SIZE * scale + 4), 28 + rows * (SIZE * scale + 4)) == tuple(manifest["grid_size"])

    family = get_family(cfg.family)
    pipe = getattr(diffusers, read_manifest(export_dir(cfg))["pipeline_class"]).from_pretrained(cfg.model)
    pipe.set_progress_bar_config(disable=True)
    extra = family.sample_image_kwargs([image_io.load_image(c) for c in edits[0][1]], (SIZE, SIZE)) if edits else {}
    context = family.sample_context((SIZE, SIZE)) if hasattr(family, "sample_context") else contextlib.nullcontext()
    extra |= family.sample_kwargs(pipe, [prompts[0]], cfg.sample.guidance_scale, 2) or {}  # Ideogram 4's guidance schedule
    with context:
        clip = {"num_frames": sample.sample_frames(cfg)} if family.trains_video else {}
        out = pipe(prompt=prompts[0], height=SIZE, width=SIZE, num_inference_steps=2, output_type="pil",
                   generator=torch.Generator("cpu").manual_seed(SEEDS[1]), **extra, **clip)
        direct = out.frames[0][len(out.frames[0]) // 2] if clip else out.images[0]  # grid.png: a clip's middle frame
    base_col = len(lead)
    assert np.array_equal(grid_cell(grid, base_col, 1, scale), np.asarray(direct.convert("RGB")))  # the base column is the base model (Qwen-Image 2.1 returns RGBA)
    base, lora = grid_cell(grid, base_col, 0, scale), grid_cell(grid, cols - 1, 0, scale)
    assert np.abs(base.astype(int) - lora.astype(int)).max() > 0  # the LoRA changes the image
    if family.trains_video:  # Wan 2.2's sample_fps (TI2V-5B 24, T2V-A14B 16), LTX2Pipeline's frame_rate
        from stages.core import video

        rate = {"wan2.2-5b": 24, "wan2.2-14b": 16, "ltx2": 24}[cfg.family]
        with Image.open(cfg.run_dir / "samples" / sample.CLIP_GRID) as animated:
            animated.load()  # WebP reads a frame's duration with the frame
            assert animated.n_frames == sample.sample_frames(cfg) and animated.info["duration"] == round(1000 / rate)
        if sample.CLIP_VIDEO in manifest["files"]:
            assert video.probe(cfg.run_dir / "samples" / sample.CLIP_VIDEO).fps == rate
    from stages.demo import shown_grid  # the demo's last line names the grid to open: the animated one for clips

    assert shown_grid(cfg.run_dir / "samples").name == (sample.CLIP_GRID if family.trains_video else sample.GRID)

    events = [e for e in read_events(cfg.run_dir) if e["stage"] == "sample"]
    assert [e["event"] for e in events if e["event"] in ("sample", "done")] == ["sample", "done"]
    assert all(validate_event(e) == [] for e in events)
    done = next(e for e in events if e["event"] == "done")  # its summary line counts clips for a video family
    assert f": {done['images']} {'clip' if family.trains_video else 'image'}s;" in terminal_line(done, 0, cfg.run_dir)[0]
    assert staleness(registry.get("sample"), cfg)[0]
    ok, reasons = staleness(registry.get("sample"), dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample, seeds=[7])))
    assert not ok and "seeds" in reasons[0]


def test_sample_refuses_without_export_or_settings(run_copy):
    from stages.core.stage import UserError

    with pytest.raises(UserError, match="sample.seeds"):
        sample.run(dataclasses.replace(run_copy, sample=SampleConfig(seeds=[])))
    shutil.rmtree(export_dir(run_copy))
    with pytest.raises(Exception, match="export-lora"):
        sample.run(sample_cfg(run_copy))


def test_sample_refuses_one_step_where_the_scheduler_stretches_to_a_terminal(assets, demo_data, tmp_path):
    """Qwen-Image's scheduler (shift_terminal 0.02) divides by zero at one step: NaN images. The stage
    says so before loading anything; a scheduler without shift_terminal (FLUX.1) samples at one step."""
    from conftest import make_cfg
    from stages.core.stage import UserError

    qwen = make_cfg("qwen-image", assets, demo_data, tmp_path, **{"sample.steps": 1})
    with pytest.raises(UserError, match=r"'sample.steps' = 1: the model's scheduler stretches its sigmas to "
                                        r"shift_terminal = 0.02 \(scheduler/scheduler_config.json\)"):
        sample.check_settings(qwen, ["a prompt"])
    sample.check_settings(dataclasses.replace(qwen, sample=SampleConfig(steps=2)), ["a prompt"])
    sample.check_settings(make_cfg("flux", assets, demo_data, tmp_path, **{"sample.steps": 1}), ["a prompt"])


@pytest.mark.slow
@once
def test_run_renders_samples_after_train(run_copy):
    """`run` with sample.after_train: the four stages are up to date, sample runs in its own process."""
    sets = ["--set", "sample.after_train=true", "--set", "sample.steps=2", "--set", f"sample.width={SIZE}",
            "--set", f"sample.height={SIZE}", "--set", "sample.seeds=[0]"]
    args = [sys.executable, str(ROOT / "pipeline.py"), "run", *cli_sets(run_copy), *sets]
    first = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.count("up to date, skipped") == 4 and "sample: running" in first.stdout
    assert Image.open(run_copy.run_dir / "samples" / sample.GRID).size[0] > 200
    again = CliRunner().invoke(pipeline.cli, args[2:])  # nothing to run: no child process starts
    assert again.exit_code == 0 and again.output.count("up to date, skipped") == 5, again.output
    # the sample command itself skips up-to-date samples too, and names the command that renders again
    grid = run_copy.run_dir / "samples" / sample.GRID
    before = grid.stat().st_mtime_ns
    direct = CliRunner().invoke(pipeline.cli, ["sample", *args[3:]])
    assert direct.exit_code == 0 and "sample up to date: the samples are rendered with these settings" in direct.output, \
        direct.output
    assert grid.stat().st_mtime_ns == before and "--force" in re.findall(r"`(lorapipe sample [^`]+)`", direct.output)[0]
    # asking the export for one more format makes it stale, not the samples: the LoRA they render is the same
    asks = CliRunner().invoke(pipeline.cli, ["config", run_copy.run, "--artifacts", str(run_copy.artifacts),
                                             "--set", "export.format=kohya", "--dry-run"])
    assert asks.exit_code == 0 and "makes stale: export-lora\n" in asks.output + "\n", asks.output


# ---- report ----------------------------------------------------------------------------------------


def test_report_plot_and_summary(built_run, tmp_path):
    png, summary = report.run(built_run.run_dir, tmp_path / "loss.png")
    assert Image.open(png).size == (report.WIDTH, 3 * report.PANEL_H + 50)
    steps = [e for e in read_events(built_run.run_dir) if e["event"] == "step"]
    assert summary["steps"] == summary["last_step"] == built_run.train.steps
    assert summary["loss_first"] == pytest.approx(steps[0]["loss"])  # 8 steps: the first 10% is one step
    assert summary["lr_max"] == pytest.approx(max(e["lr"] for e in steps)) and summary["errors"] == []
    result = CliRunner().invoke(pipeline.cli, ["report", built_run.run, "--artifacts", built_run.artifacts, "--json",
                                               "--out", str(tmp_path / "cli.png")])
    assert result.exit_code == 0 and json.loads(result.output)["steps"] == built_run.train.steps
    assert (tmp_path / "cli.png").is_file()


def _step(step: int, loss: float) -> dict:
    return {"stage": "train", "event": "step", "step": step, "loss": loss, "lr": 1e-4, "samples_per_second": None,
            "peak_vram_gb": 0.0}


def test_train_curve_follows_resumes_and_restarts():
    start = {"stage": "train", "event": "start"}
    first = [start] + [_step(s, 1.0) for s in range(1, 11)]
    resumed = [start] + [_step(s, 2.0) for s in range(7, 13)]  # resumed from checkpoint-6
    curve = report.train_curve(first + resumed)
    assert curve.steps == list(range(1, 13)) and curve.loss == [1.0] * 6 + [2.0] * 6
    restarted = report.train_curve(first + resumed + [start] + [_step(s, 3.0) for s in (1, 2)])
    assert restarted.steps == [1, 2] and restarted.loss == [3.0, 3.0]
    checkpoint = {"stage": "train", "event": "checkpoint", "step": 2}
    history = first + [checkpoint] + resumed + [start, _step(1, 3.0), checkpoint]
    assert report.current_history(history) == [start, _step(1, 3.0), checkpoint]  # the restart replaced the rest
    assert report.current_history(first + resumed) == first + resumed
    assert report.smooth([2.0] * 5, 0.9) == pytest.approx([2.0] * 5)  # bias-corrected: no pull toward 0
    assert report.nice_ticks(0.0, 1.0) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])


def test_report_says_what_is_missing(tmp_path):
    from stages.core.stage import UserError

    with pytest.raises(UserError, match="events.jsonl"):
        report.run(tmp_path)
    (tmp_path / "events.jsonl").write_text(json.dumps({"stage": "encode-captions", "event": "start"}) + "\n")
    with pytest.raises(UserError, match="no training steps"):
        report.run(tmp_path)


# ---- single-file model sources ----------------------------------------------------------------------


def test_single_file_denoiser_loads_with_base_components(assets, tmp_path):
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from safetensors.torch import load_file, save_file

    from stages.core.model_source import ModelError, ModelSource

    base = tiny_model(assets, "flux-dev")
    weights = load_file(str(base / "transformer" / "diffusion_pytorch_model.safetensors"))
    tuned = {k: v * 1.5 if v.dim() == 2 else v for k, v in weights.items()}  # a "fine-tune"
    save_file(tuned, str(tmp_path / "tuned.safetensors"))
    src = ModelSource(str(tmp_path / "tuned.safetensors"), base=str(base))
    model = src.load(FluxTransformer2DModel, "transformer", torch_dtype=torch.float32)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in tuned.items())
    pipe = src.load_pipeline(FluxPipeline, torch_dtype=torch.float32)
    assert torch.equal(pipe.transformer.x_embedder.weight, tuned["x_embedder.weight"])
    assert src.component_config("vae") == ModelSource(str(base)).component_config("vae")
    ident = src.identity(("transformer", "vae"))
    assert ident.startswith("file:") and ident.endswith(ModelSource(str(base)).identity(("vae",)))
    save_file({k: v * 2 for k, v in tuned.items()}, str(tmp_path / "tuned.safetensors"))
    assert src.identity(("transformer",)).split("+")[0] != ident.split("+")[0]
    with pytest.raises(ModelError, match="does not exist"):
        ModelSource(str(tmp_path / "missing.safetensors"), base=str(base)).check(("transformer",))


def test_single_file_offline_without_cached_base_says_how_to_get_it(tmp_path, monkeypatch):
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    from stages.core.model_source import ModelError, ModelSource

    # The keys diffusers reads to recognise a FLUX.1-dev checkpoint in Black Forest Labs' layout.
    save_file({"double_blocks.0.img_attn.norm.key_norm.scale": torch.ones(4), "guidance_in.in_layer.bias": torch.ones(4),
               "img_in.weight": torch.ones(8, 64)}, str(tmp_path / "flux1-dev-tuned.safetensors"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = ModelSource(str(tmp_path / "flux1-dev-tuned.safetensors"))
    assert src.base_source().ref == "black-forest-labs/FLUX.1-dev"
    with pytest.raises(ModelError, match="`hf download black-forest-labs/FLUX.1-dev`"):
        src.load(FluxTransformer2DModel, "transformer")
    with pytest.raises(ModelError, match="not in the Hugging Face cache"):
        src.component_config("vae")
