"""The bench runner on a machine that lost an earlier call's work (a verify row there finds no export to check
unless the runner makes one):

- a verify item whose train and export an earlier call measured (--skip-done) moves behind this call's
  first train (of its run, else of another: here the 1024 px run's) and checks that adapter's export (no
  rerun of its own train: a whole train item at full size), its row saying so;
- with no train of its run in the call, it reruns its own train and export first, recorded as reruns
  (its run's latents are there: the tiny runs encode the same 64 px images at either size, so the
  1024 px run's are copied in; the caches' own reruns are the first call's encode and latents rows).

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/bench/test_bench_runner.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench.bench import Runner, run_args
from conftest import FAMILIES, tiny_model

FAMILY = "sdxl"


def _run(tmp_path: Path, models: Path, prior: Path, only: list[str], out: Path) -> list[dict]:
    runner = Runner(run_args(work=str(tmp_path / "w"), out=str(out), tiny=True, models=str(models), keep=True,
                             skip_done=[str(prior)], only=only))
    runner.run_family(FAMILY)
    return json.loads(out.read_text())["items"]


def test_a_verify_item_checks_this_calls_adapter_or_rebuilds_its_own(tmp_path: Path, assets: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / FAMILY).symlink_to(tiny_model(assets, FAMILIES[FAMILY]))  # the bench's own tiny build (same seed)
    prior = tmp_path / "prior.json"
    done = [f"{FAMILY}/{kind}/nf4-512-b1" for kind in ("encode", "latents", "train", "export")]
    prior.write_text(json.dumps({"meta": {}, "items": [{"id": i, "status": "ok"} for i in done]}))

    rows = _run(tmp_path, models, prior, [f"{FAMILY}/verify/*", f"{FAMILY}/train/bf16-1024-b1"], tmp_path / "a.json")

    assert [(r["id"], r["status"], r["res"]) for r in rows] == [
        (f"{FAMILY}/encode/bf16#rerun", "ok", 1024), (f"{FAMILY}/latents/1024#rerun", "ok", 1024),
        (f"{FAMILY}/train/bf16-1024-b1", "ok", 1024), (f"{FAMILY}/export/nf4-512-b1#rerun", "ok", 1024),
        (f"{FAMILY}/verify/nf4-512-b1", "ok", 1024)]  # moved behind the train; nf4-512-b1's own train not rerun
    assert all(f"the adapter of {FAMILY}/train/bf16-1024-b1" in r["note"] for r in rows[3:])
    assert f"bench-{FAMILY}-1024" in rows[3]["cmd"]
    verified = rows[-1]["summary"]
    assert verified["missing"] == [] and verified["unexpected"] == []
    assert verified["lora_tensors_loaded"] == verified["tensors_in_file"] > 0

    # the 512 px run's latents without a child process of their own (~8 s of imports on CI): at --tiny both
    # runs encode the same 64 px images, so the 1024 px run's files are the 512 px run's (the manifests match
    # but for their times); its captions are left to the runner, which copies them from the 1024 px run
    artifacts = tmp_path / "w" / "artifacts"
    shutil.copytree(artifacts / f"bench-{FAMILY}-1024" / "latents.zarr", artifacts / f"bench-{FAMILY}-512" / "latents.zarr")

    rows = _run(tmp_path, models, prior, [f"{FAMILY}/verify/*"], tmp_path / "b.json")  # no train in the call

    assert [(r["id"], r["status"]) for r in rows] == [  # no cache rerun: captions from the 1024 px run (not the size's)
        (f"{FAMILY}/train/nf4-512-b1#rerun", "ok"), (f"{FAMILY}/export/nf4-512-b1#rerun", "ok"),
        (f"{FAMILY}/verify/nf4-512-b1", "ok")]
    captions = [(artifacts / f"bench-{FAMILY}-{res}" / "captions.zarr" / "manifest.json").read_text() for res in (1024, 512)]
    assert captions[0] == captions[1]
    assert "note" not in rows[-1] and rows[-1]["summary"]["missing"] == [] and rows[-1]["summary"]["unexpected"] == []


def test_a_child_killed_from_outside_is_not_read_as_cut_off_by_the_budget(tmp_path: Path) -> None:
    """FLUX.2 dev's export was SIGKILLed by the host's OOM killer 30 s in and its rows said "cut off
    (budget)" with minutes of budget left; only the budget's own timeout reads so."""
    import sys

    from bench.bench import _failed

    runner = Runner(run_args(work=str(tmp_path / "w"), out=str(tmp_path / "o.json"), tiny=True, budget_s=600))
    kill = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    rc, _, _ = runner.call(kill, {}, "killed")
    assert _failed(rc).startswith("killed (SIGKILL before the budget's deadline")
    assert _failed(-9) == "cut off (budget)"  # what call() returns when its timeout (the budget's) kills the child


def test_a_video_familys_rows_train_whole_clips_of_every_frame_count_they_ask(tmp_path: Path) -> None:
    """The bench's data for a video family is clips only (no stills, which would train 1-frame steps), each long
    enough for the longest row's data.frames at its own rate, so a row of 81 frames trains 81 frames a step."""
    from stages.core import video

    runner = Runner(run_args(work=str(tmp_path / "w"), out=str(tmp_path / "o.json"), tiny=True))
    sets = runner.base_sets("wan2.2-5b", 640)
    data = Path(sets["data.path"])
    assert sets["data.fps"] == 0
    clips = sorted(p for p in data.iterdir() if p.is_dir())
    assert clips and all((p.parent / f"{p.name}.txt").exists() for p in clips)
    assert not [p for p in data.iterdir() if p.is_file() and p.suffix != ".txt"], "no stills among the clips"
    for clip in clips:
        info = video.probe(clip)
        assert video.too_short(clip, info, 81, sets["data.fps"]) is None
        first, last = (video.read_frames(clip, [i])[0] for i in (0, info.frames - 1))
        assert first.tobytes() != last.tobytes(), "the frames move"
    assert "data.fps" not in runner.base_sets("flux", 1024)
