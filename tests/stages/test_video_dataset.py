"""Video clips as dataset items: scan, probe, frame sampling, buckets, bad clips, and cache-latents on clips.

    .venv/bin/python -m pytest tests/stages/test_video_dataset.py -q

- a folder of mp4 clips, folders of frames and stills scans into one item each (the frames of a clip folder
  are not items), also through metadata.jsonl; a clip folder's id changes with any frame;
- frame sampling: the span at data.fps, seeded start offsets per variant, decoded frames in order; a folder's
  frames in number order (`2.png` before `10.png`);
- too-short, empty and corrupt clips get one line naming the file and what to do; "skip" skips them;
- cache-latents buckets clips by (width, height, frames) apart from the stills, stores the Wan VAE's
  5-D posterior per variant with its start frame, and a new clip is the only one encoded on a rerun.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from stages.core import dataset, video
from stages.core.errors import DatasetError
from stages.core.schema import Bucket


def _frames(n: int, size=(64, 48), seed: int = 0) -> list[Image.Image]:
    """n frames whose mean brightness counts up (frame k is k * 20 + noise), so decoded order can be read back."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray((np.full((size[1], size[0], 3), 20 * k) + rng.integers(0, 8, (size[1], size[0], 3)))
                            .clip(0, 255).astype(np.uint8)) for k in range(n)]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    assert video.write_mp4(root / "walk.mp4", _frames(12), 24)
    (root / "walk.txt").write_text("a person walking")
    (root / "wave").mkdir()
    for k, im in enumerate(_frames(10, seed=1)):
        im.save(root / "wave" / f"{k:03d}.png")
    (root / "wave.txt").write_text("a hand waving")
    _frames(1)[0].save(root / "still.png")
    (root / "still.txt").write_text("a still photo")
    return root


def test_scan_finds_clips_folders_and_stills(clips):
    items = dataset.scan(clips)
    assert [(it.key, it.is_clip) for it in items] == [("still.png", False), ("walk.mp4", True), ("wave", True)]
    assert all(it.image_id for it in items) and len({it.image_id for it in items}) == 3


def test_clip_folder_id_follows_its_frames(clips, tmp_path):
    root = tmp_path / "d"
    shutil.copytree(clips, root)
    before = {it.key: it.image_id for it in dataset.scan(root)}
    _frames(1, seed=9)[0].save(root / "wave" / "004.png")
    after = {it.key: it.image_id for it in dataset.scan(root)}
    assert after["wave"] != before["wave"] and after["walk.mp4"] == before["walk.mp4"]


def test_metadata_jsonl_names_clips(clips, tmp_path):
    root = tmp_path / "m"
    shutil.copytree(clips, root)
    (root / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"file_name": "walk.mp4", "text": "walking"}, {"file_name": "wave", "text": "waving"}]))
    assert [(it.key, it.caption) for it in dataset.scan(root)] == [("walk.mp4", "walking"), ("wave", "waving")]


def test_probe_and_frame_sampling(clips):
    info = video.probe(clips / "walk.mp4")
    assert (info.width, info.height, info.frames, info.fps) == (64, 48, 12, 24.0)
    assert video.span(info, 5, 0) == 5 and video.span(info, 5, 12) == 9  # 12 fps: every other frame
    assert video.frame_indices(info, 2, 5, 12) == [2, 4, 6, 8, 10]
    starts = video.start_frames(0, "id", info, 5, 12, 4)
    assert starts[0] == 0 and all(0 <= s <= 3 for s in starts) and starts == video.start_frames(0, "id", info, 5, 12, 4)
    frames = video.read_frames(clips / "walk.mp4", [6, 0, 3])
    brightness = [float(np.asarray(f).mean()) for f in frames]
    assert brightness[1] < brightness[2] < brightness[0], "frames come back in the order asked"
    folder = video.probe(clips / "wave")
    assert (folder.frames, folder.width) == (10, 64)


def test_bad_clips_are_named_with_what_to_do(clips, tmp_path):
    info = video.probe(clips / "walk.mp4")
    message = video.too_short(clips / "walk.mp4", info, 33, 0)
    assert "walk.mp4" in message and "12 frames" in message and "data.frames = 33" in message
    assert "data.on_bad_image" in message and "\n" not in message
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "junk.mp4").write_bytes(b"not a video at all" * 20)
    for name, words in (("empty.mp4", "empty"), ("junk.mp4", "cannot be opened")):
        with pytest.raises(video.BadClip, match=words) as e:
            video.probe(tmp_path / name)
        assert name in str(e.value) and "data.on_bad_image" in str(e.value)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(video.BadClip, match="holds no frames"):
        video.probe(tmp_path / "nothing")


def test_a_clip_folder_with_a_missing_frame_is_named(clips, tmp_path):
    root = tmp_path / "gap"
    shutil.copytree(clips / "wave", root)
    assert video.probe(root).frames == 10
    (root / "004.png").unlink()
    with pytest.raises(video.BadClip, match="missing frame 004.png") as e:
        video.probe(root)
    assert str(root) in str(e.value) and "data.on_bad_image" in str(e.value) and "\n" not in str(e.value)
    (root / "003.png").rename(root / "004.png")  # renumbered by hand: 000-002, then 004-009: still a gap
    with pytest.raises(video.BadClip, match="missing frame 003.png"):
        video.probe(root)
    named = tmp_path / "named"
    named.mkdir()
    for name in ("first.png", "second.png", "third.png"):  # not numbered: read in name order, no gap to find
        _frames(1)[0].save(named / name)
    assert video.probe(named).frames == 3


def test_unpadded_frame_numbers_play_in_number_order(tmp_path):
    """1.png ... 12.png read as 1, 2, ..., 10, 11, 12 (by name: 1, 10, 11, 12, 2, ...); a gap is still named."""
    root = tmp_path / "unpadded"
    root.mkdir()
    for k, im in enumerate(_frames(12), start=1):
        im.save(root / f"{k}.png")
    assert [p.stem for p in video.frame_files(root)] == [str(k) for k in range(1, 13)]
    brightness = [float(np.asarray(f).mean()) for f in video.read_frames(root, list(range(12)))]
    assert brightness == sorted(brightness), "frame k + 1 is brighter than frame k"
    (root / "7.png").unlink()
    with pytest.raises(video.BadClip, match="missing frame 7.png"):
        video.probe(root)


def test_bucket_names_carry_frames():
    assert str(Bucket(832, 480, 33)) == "832x480x33f" and str(Bucket(512, 512)) == "512x512"
    assert Bucket.parse("832x480x33f") == (832, 480, 33) and Bucket.parse("64x64") == Bucket(64, 64, 1)
    with pytest.raises(ValueError, match="WxHxFf"):
        Bucket.parse("64x64x0f")


@pytest.fixture(scope="module")
def cached(clips, assets, tmp_path_factory):
    """cache-latents of the clips (5 frames each: the walk's 12 and the wave's 10 both give it) and the still."""
    from conftest import make_cfg
    from stages import cache_latents

    root = tmp_path_factory.mktemp("runs")
    cfg = make_cfg("wan2.2-5b", assets, clips, root, **{"data.frames": 5, "data.resolution": 48,
                                                         "data.cache_variants": 2})
    return cfg, cache_latents.run(cfg)


def test_cache_latents_buckets_clips_by_frames(cached):
    from stages.core.rowstore import RowStore

    cfg, manifest = cached
    buckets = {str(Bucket.parse(b)) for b in manifest["buckets"]}
    assert any(b.endswith("x5f") for b in buckets) and any("f" not in b for b in buckets)
    walk = manifest["index"][manifest["items"]["walk.mp4"]]
    assert walk["clip"] == [12, 24.0] and walk["bucket"].endswith("x5f")
    store = RowStore.open(cfg.run_dir / "latents.zarr" / walk["bucket"])
    row = store.read_row(walk["row"])
    assert row["mean"].shape[:3] == (2, 48, 2), "2 variants of 48 channels x (5 - 1) / 4 + 1 latent frames"
    assert row["start_frame"][0] == 0 and 0 <= row["start_frame"][1] <= 12 - 5
    still = manifest["index"][manifest["items"]["still.png"]]
    assert RowStore.open(cfg.run_dir / "latents.zarr" / still["bucket"]).read_row(still["row"])["mean"].shape[2] == 1


def test_cache_latents_summary_counts_clips_not_images(cached, clips, assets, tmp_path):
    """The done line's pace names what it encoded: clips, or items for clips and stills together; inspect counts
    clips as clips."""
    from rich.console import Console

    from conftest import make_cfg
    from stages import cache_latents
    from stages import inspect as inspect_stage
    from stages.core.events import read_events, terminal_line

    def summary(cfg) -> str:
        done = next(e for e in read_events(cfg.run_dir) if e["stage"] == "cache-latents" and e["event"] == "done")
        return terminal_line(done, 0, cfg.run_dir)[0]

    mixed, _ = cached
    assert " items/s" in summary(mixed) and "images" not in summary(mixed)
    root = tmp_path / "only-clips"
    shutil.copytree(clips, root, ignore=shutil.ignore_patterns("still.*"))
    cfg = make_cfg("wan2.2-5b", assets, root, tmp_path / "runs", **{"data.frames": 5, "data.resolution": 48})
    cache_latents.run(cfg)
    assert " clips/s" in summary(cfg) and "images" not in summary(cfg)
    console = Console(record=True, width=200)
    inspect_stage._render_latents(inspect_stage.latents_section(cfg.run_dir, 0), console)
    assert "latents.zarr: 2 clips, 2 items," in console.export_text()


def test_a_new_clip_alone_is_encoded_and_short_ones_follow_on_bad_image(cached, clips, tmp_path):
    import dataclasses

    from stages import cache_latents

    cfg, _ = cached
    root = tmp_path / "more"
    shutil.copytree(clips, root)
    assert video.write_mp4(root / "run.mp4", _frames(6, seed=3), 24)
    (root / "run.txt").write_text("running")
    assert video.write_mp4(root / "blink.mp4", _frames(3, seed=4), 24)  # 3 frames: too short for 5
    (root / "blink.txt").write_text("blinking")
    cfg2 = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(root)))
    with pytest.raises(DatasetError, match="blink.mp4' has 3 frames but data.frames = 5"):
        cache_latents.run(cfg2)
    cfg2 = dataclasses.replace(cfg2, data=dataclasses.replace(cfg2.data, on_bad_image="skip"))
    manifest = cache_latents.run(cfg2)
    assert manifest["encoded_this_run"] == 1, "the three cached items are kept; run.mp4 is the one new row"
    assert [s["item"] for s in manifest["skipped"]] == ["blink.mp4"]


def test_an_image_family_refuses_clips(clips, assets, tmp_path):
    from conftest import make_cfg
    from stages import cache_latents

    cfg = make_cfg("chroma", assets, clips, tmp_path)
    with pytest.raises(DatasetError, match="chroma trains on images, not clips"):
        cache_latents.run(cfg)


def test_decode_of_a_clip_plays_at_its_rate_and_refuses_unwritable_out(cached, tmp_path):
    from PIL import Image

    from stages import inspect as inspect_stage
    from stages.core.errors import UserError

    cfg, _ = cached
    path, info = inspect_stage.decode(cfg, "walk.mp4", 1, tmp_path / "walk.gif")
    assert info["frames"] == 5 and info["fps"] == 24.0, "data.fps = 0: the clip's own 24 fps"
    assert 0 <= info["start_frame"] <= 12 - 5
    with Image.open(path) as im:
        assert im.n_frames == 5 and abs(im.info["duration"] - 1000 / 24) <= 2, "GIF keeps centiseconds"
    path, info = inspect_stage.decode(cfg, "still.png", 0, tmp_path / "still.mp4")  # a still as a 1-frame clip
    assert video.probe(path).frames == 1 and "fps" not in info
    with pytest.raises(UserError, match=r"--out .*walk.txt.*\.png.*\.mp4"):
        inspect_stage.decode(cfg, "walk.mp4", 0, tmp_path / "walk.txt")
    assert not (tmp_path / "walk.txt").exists()


def test_status_names_a_changed_clip_key_with_its_default(cached, tmp_path):
    import dataclasses

    from stages import cache_latents, registry
    from stages.core.stage import staleness

    cfg, _ = cached
    cfg = dataclasses.replace(cfg, artifacts=str(tmp_path))  # a run of its own: other tests rerun the fixture's
    cache_latents.run(cfg)
    stage = registry.get("cache-latents")
    assert staleness(stage, cfg) == (True, [])
    for key, value, said in (("fps", 12.0, "data.fps: 0 -> 12"), ("frames", 9, "data.frames: 5 -> 9")):
        ok, reasons = staleness(stage, dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **{key: value})))
        assert not ok and reasons == [said], reasons


def test_a_cached_clip_too_short_for_new_frames_is_named_and_the_cache_kept(cached, tmp_path):
    import dataclasses

    from stages import cache_latents
    from stages.core.artifacts import read_manifest

    cfg, _ = cached
    shutil.copytree(cfg.run_dir, tmp_path / cfg.run)
    cfg = dataclasses.replace(cfg, artifacts=str(tmp_path))
    before = (cfg.run_dir / "latents.zarr" / "manifest.json").read_bytes()
    longer = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, frames=13))  # walk has 12, wave 10
    with pytest.raises(DatasetError) as e:
        cache_latents.run(longer)
    assert "walk.mp4' has 12 frames but data.frames = 13 needs 13: lower data.frames, or" in str(e.value)
    assert "wave' has 10 frames" in str(e.value) and str(e.value).startswith("2 clips need fixing")
    assert (cfg.run_dir / "latents.zarr" / "manifest.json").read_bytes() == before, "the 5-frame cache is kept"
    manifest = cache_latents.run(dataclasses.replace(longer, data=dataclasses.replace(longer.data, on_bad_image="skip")))
    assert sorted(s["item"] for s in manifest["skipped"]) == ["walk.mp4", "wave"]
    assert not any(b.endswith("x13f") for b in manifest["buckets"]), "no clip is cached past its last frame"
    assert read_manifest(cfg.run_dir / "latents.zarr")["items"].keys() == {"still.png"}


def test_a_clip_slower_than_data_fps_is_warned_as_slow_motion(cached, tmp_path):
    import dataclasses

    from stages import cache_latents

    cfg, _ = cached
    cfg = dataclasses.replace(cfg, artifacts=str(tmp_path))

    def warnings_of(fps: float) -> dict[str, str]:
        run = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, fps=fps))
        cache_latents.run(run)
        events = [json.loads(line) for line in (run.run_dir / "events.jsonl").read_text().splitlines()]
        start = max(k for k, e in enumerate(events) if e["event"] == "start")
        return {e["item"]: e["message"] for e in events[start:] if e["event"] == "warning"}

    assert warnings_of(24) == {}, "clips at 24 fps sampled at 24: nothing repeats"
    slow = warnings_of(48)
    assert sorted(slow) == ["walk.mp4", "wave"]
    assert "walk.mp4' runs at 24 fps, below data.fps = 48: its frames repeat" in slow["walk.mp4"]
    assert "set data.fps = 24 or lower" in slow["walk.mp4"] and "a folder of frames" in slow["wave"]
