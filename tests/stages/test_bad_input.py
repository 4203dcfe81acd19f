"""Bad input: every case of the generated corpus (tests/badinput.py) gets a specific
message naming the file, item or key and what to do; images follow data.on_bad_image; skips are
listed in the manifest and the events; nothing already cached is lost, not even when the disk fills
up (simulated: a write raises ENOSPC); train refuses caches made for another model or resolution
and names the stage to rerun.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from badinput import BLUE, READABLE, RED, UNREADABLE, write_caption_case, write_good_images, write_image_cases
from conftest import demo_config_path, make_cfg
from stages.core.caches import lora_dir

HINT = 'data.on_bad_image = "skip"'


# ---- images, one by one (no model) -------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    write_image_cases(folder)
    return folder


def pixel(im, x: int, y: int) -> tuple:
    return tuple(int(v) for v in np.asarray(im)[y, x])


def near(got: tuple, want: tuple, tol: int = 12) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(got, want))


def test_readable_images_become_rgb(corpus):
    from stages.core.image_io import image_size, load_image

    cmyk = load_image(corpus / "cmyk.jpg")
    assert near(pixel(cmyk, 5, 5), RED) and near(pixel(cmyk, 60, 60), BLUE)
    gray16 = load_image(corpus / "gray16.png")
    assert gray16.mode == "RGB" and pixel(gray16, 0, 0)[0] < 5 and pixel(gray16, 63, 63)[0] > 250  # full 16-bit range
    for name, transparent_at, opaque_at in (("palette.png", (5, 5), (60, 5)), ("rgba.png", (60, 60), (5, 5))):
        assert pixel(load_image(corpus / name), *transparent_at) == (255, 255, 255), name  # white background
        assert pixel(load_image(corpus / name, background="black"), *transparent_at) == (0, 0, 0), name
        assert near(pixel(load_image(corpus / name), *opaque_at), RED), name
    gray = pixel(load_image(corpus / "gray.png"), 5, 5)
    assert gray[0] == gray[1] == gray[2]
    rotated = load_image(corpus / "exif_rotated.jpg")  # stored 48x64, shown 64x48 with RED top-left
    assert rotated.size == image_size(corpus / "exif_rotated.jpg") == (64, 48)
    assert near(pixel(rotated, 5, 5), RED) and near(pixel(rotated, 60, 40), BLUE)


@pytest.mark.parametrize("name, reason", [
    ("truncated.jpg", "is truncated or corrupt"), ("corrupt.jpg", "starts like a JPEG but is corrupt"),
    ("zero_byte.png", "is an empty (zero-byte) file"), ("not_an_image.png", "is not an image")])
def test_unreadable_images_are_named(corpus, name, reason):
    from stages.core.image_io import BadImage, image_size, load_image

    with pytest.raises(BadImage) as e:
        image_size(corpus / name)
        load_image(corpus / name)  # truncated.jpg: its header reads fine, the pixels do not
    assert str(corpus / name) in str(e.value) and reason in str(e.value) and HINT in str(e.value)


def test_size_notes_for_tiny_and_extreme_images():
    from stages.core.aspect_buckets import size_notes

    tiny, = size_notes("tiny.png", (8, 8), (64, 64), 3.0)
    assert "tiny.png" in tiny and "smaller than its bucket 64x64" in tiny and "upscaled 8.0x" in tiny
    extreme, upscaled = size_notes("wide.png", (640, 16), (112, 32), 3.0)  # 16 px high: upscaled too
    assert "aspect 40.0:1 beyond data.max_aspect = 3.0" in extreme and "keeping 9% of it" in extreme
    assert "upscaled 2.0x" in upscaled
    assert size_notes("fine.png", (128, 128), (64, 64), 3.0) == size_notes("near.png", (60, 64), (64, 64), 3.0) == []


@pytest.mark.parametrize("case, message", [
    ("missing", "has no caption file 'missing.txt'; add one or move the image out"),
    ("empty", "is empty; write a caption or remove the image"),
    ("not_utf8", "is not UTF-8 text (invalid continuation byte at byte 16); re-save it as UTF-8")])
def test_caption_problems_are_named(tmp_path, case, message):
    from stages.core.dataset import DatasetError, scan

    image = write_caption_case(tmp_path, case)
    with pytest.raises(DatasetError) as e:
        scan(tmp_path)
    assert str(image.with_suffix(".txt" if case != "missing" else ".png")) in str(e.value) and message in str(e.value)


def test_config_and_model_mistakes(assets, tmp_path):
    from stages import cache_latents, encode_captions
    from stages.core.config import ConfigError, load_config
    from stages.core.model_source import ModelError

    with pytest.raises(ConfigError, match=r"unknown key 'train.learnig_rate' \(did you mean 'train.learning_rate'\?\)"):
        load_config(None, {"model": "x", "train.learnig_rate": 1e-4})
    data = tmp_path / "data"
    write_good_images(data, 2)
    missing = make_cfg("flux", assets, data, tmp_path / "a", model=str(tmp_path / "no-such-model"))
    with pytest.raises(ModelError, match=f"model '{tmp_path / 'no-such-model'}' does not exist"):
        encode_captions.run(missing)
    (tmp_path / "not-a-pipeline").mkdir()
    folder = make_cfg("flux", assets, data, tmp_path / "a", model=str(tmp_path / "not-a-pipeline"))
    with pytest.raises(ModelError, match="is not a diffusers pipeline \\(no model_index.json\\)"):
        cache_latents.run(folder)
    from stages.plan import plans  # `pipeline.py plan` reads configs only, and says the same

    with pytest.raises(ModelError, match="is not a diffusers pipeline \\(no model_index.json\\)"):
        plans(folder, 8)


# ---- a real run over the corpus -----------------------------------------------------------------


def events(cfg, stage: str, event: str) -> list[dict]:
    from stages.core.events import read_events

    return [e for e in read_events(cfg.run_dir) if e["stage"] == stage and e["event"] == event]


def rows_written(cfg) -> int:
    from stages.core.artifacts import RowStore

    return sum(int(RowStore.open(g).written_mask().sum()) for g in (cfg.run_dir / "latents.zarr").iterdir()
               if (g / "zarr.json").exists() and g.name[0].isdigit())


def test_bad_images_follow_the_policy_and_lose_nothing(assets, tmp_path):
    from stages import cache_latents, encode_captions, registry, train
    from stages.core.dataset import scan
    from stages.core.image_io import BadImage
    from stages.core.stage import staleness
    from stages.core.train_data import join_items

    data, corpus = tmp_path / "data", tmp_path / "corpus"
    write_good_images(data, 4)
    cfg = make_cfg("flux", assets, data, tmp_path / "artifacts", **{
        "data.cache_variants": 1, "captions.max_sequence_length": 32})
    encode_captions.run(cfg)
    first = cache_latents.run(cfg)
    manifest = cfg.run_dir / "latents.zarr" / "manifest.json"
    saved = manifest.read_bytes()

    cases = write_image_cases(corpus)
    for name in ("truncated.jpg", "cmyk.jpg"):  # found only when loaded, after other images were cached
        for path in (corpus / name, (corpus / name).with_suffix(".txt")):
            shutil.copy(path, data / path.name)
    with pytest.raises(BadImage, match=f"'{data / 'truncated.jpg'}' is truncated or corrupt.*{HINT}"):
        cache_latents.run(cfg)  # on_bad_image = "error" (the default)
    assert manifest.read_bytes() == saved  # the previous cache still stands, rows included
    assert events(cfg, "cache-latents", "error")[-1]["item"] == "truncated.jpg"
    kept_new = rows_written(cfg) - first["encoded_this_run"]

    for name in cases:
        for path in (corpus / name, (corpus / name).with_suffix(".txt")):
            shutil.copy(path, data / path.name)
    cfg = make_cfg("flux", assets, data, tmp_path / "artifacts", **{
        "data.cache_variants": 1, "data.on_bad_image": "skip", "captions.max_sequence_length": 32})
    captions = encode_captions.run(cfg)
    assert list(captions["truncated"]) == ["long_caption.png"] and captions["truncated"]["long_caption.png"] > 32
    assert [e["item"] for e in events(cfg, "encode-captions", "warning")] == ["long_caption.png"]
    latents = cache_latents.run(cfg)
    readable = {n for n in cases if n not in UNREADABLE and n != "duplicate.png"}  # distinct readable images
    assert latents["encoded_this_run"] == len(readable) - kept_new  # the 4 old, and rows of the failed run, kept
    assert {s["item"] for s in latents["skipped"]} == set(UNREADABLE)
    assert all(s["item"] in s["reason"] and HINT not in s["reason"] for s in latents["skipped"])  # skip is set
    assert {e["item"] for e in events(cfg, "cache-latents", "skipped")} >= set(UNREADABLE)
    assert {w["item"] for w in latents["warnings"]} == {"tiny.png", "extreme_aspect.png"}
    assert [sorted(keys) for keys in latents["duplicates"].values()] == [["original.png"]]
    duplicate_warning = [e["message"] for e in events(cfg, "cache-latents", "warning") if e["item"] == "original.png"]
    assert "same bytes as 'duplicate.png'" in duplicate_warning[-1]
    train.check_upstream(cfg)  # skips recorded: the caches count as up to date
    pairs = join_items(scan(cfg.data.path), captions, latents, cfg.run)
    assert {p.key for p in pairs} == {p.name for p in data.glob("*") if p.suffix != ".txt"} - set(UNREADABLE)
    assert set(READABLE) <= {p.key for p in pairs}

    strict = make_cfg("flux", assets, data, tmp_path / "artifacts", **{  # data.on_bad_image = "error" again
        "data.cache_variants": 1, "captions.max_sequence_length": 32})
    ok, reasons = staleness(registry.get("cache-latents"), strict)
    assert not ok and all(name in reasons[0] for name in UNREADABLE) and "data.on_bad_image=skip`" in reasons[0]
    with pytest.raises(BadImage, match=f"'{data / 'corrupt.jpg'}' starts like a JPEG but is corrupt.*{HINT}"):
        cache_latents.run(strict)  # the skipped images are errors again, named


# ---- artifacts made for something else ---------------------------------------------------------


@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
def test_train_refuses_caches_made_for_another_model_or_resolution(built_run, tmp_path):
    from stages import train
    from stages.core.artifacts import ArtifactError
    from stages.core.config import load_config
    from stages.families import FAMILIES

    def refusal(**overrides) -> str:
        cfg = load_config(None, {**_flat(built_run.to_dict()), **overrides})
        with pytest.raises(ArtifactError) as e:
            train.check_upstream(cfg)
        return str(e.value)

    message = refusal(**{"data.resolution": 128})
    assert "latents.zarr: resolution: 64 -> 128" in message and "`lorapipe cache-latents demo --artifacts" in message
    assert "encode-captions" not in message  # captions do not depend on the resolution

    other = tmp_path / "other-model"
    shutil.copytree(built_run.model, other)
    vae_config = json.loads((other / "vae" / "config.json").read_text())
    (other / "vae" / "config.json").write_text(json.dumps({**vae_config, "scaling_factor": 0.5}))
    message = refusal(model=str(other))
    assert f"latents.zarr: model: the files of '{other}' are not the ones it was built from" in message
    assert "`lorapipe cache-latents demo --artifacts" in message
    assert "encode-captions" not in message  # same text encoders

    from stages.demo import demo_data_kind

    # a text-to-image family: an edit family refuses this dataset itself (its items have no controls)
    another = next((f for f in sorted(FAMILIES) if f != built_run.family and demo_data_kind(f) == "shapes"), None)
    try:
        message = refusal(family=another)
    except (ImportError, AttributeError, TypeError):
        pytest.skip(f"family {another!r} is not importable yet")
    assert f"family: '{built_run.family}' -> '{another}'" in message
    assert "`lorapipe encode-captions demo --artifacts" in message and "`lorapipe cache-latents demo --artifacts" in message


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


# ---- a full disk (simulated) -------------------------------------------------------------------


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _fail_after(n: int, real):
    """`real`, except that every call after the first n raises ENOSPC, as a filling disk does."""
    calls = []

    def write(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs) if len(calls) <= n else _enospc()

    return write


def test_full_disk_while_caching_keeps_what_was_there(assets, tmp_path, monkeypatch):
    import zarr.storage._local as zarr_local
    from click.testing import CliRunner

    from pipeline import cli
    from stages import cache_latents, encode_captions
    from stages.core.artifacts import DiskFull, read_manifest

    data = tmp_path / "data"
    write_good_images(data, 3)
    cfg = make_cfg("flux", assets, data, tmp_path / "artifacts", **{"data.cache_variants": 1})
    cache_latents.run(cfg)
    manifest = cfg.run_dir / "latents.zarr" / "manifest.json"
    saved = manifest.read_bytes()
    write_good_images(data, 3, prefix="more")

    monkeypatch.setattr(zarr_local, "_put", _fail_after(16, zarr_local._put))  # room for a row or so
    result = CliRunner().invoke(cli, ["cache-latents", "--config", str(demo_config_path("flux")), "--model", cfg.model,
                                      "--set", f"data.path={data}", "--set", f"artifacts={cfg.artifacts}",
                                      "--set", "device=cpu", "--set", "data.cache_variants=1"])
    assert result.exit_code == 2, result.output
    assert "error: disk full while writing" in result.output and "latents.zarr" in result.output
    assert "everything written before is intact" in result.output
    assert manifest.read_bytes() == saved
    assert not list((cfg.run_dir / "latents.zarr").rglob("*.partial"))
    kept = rows_written(cfg) - 3
    monkeypatch.undo()  # space freed
    done = cache_latents.run(cfg)
    assert done["encoded_this_run"] == 3 - kept and len(done["index"]) == 6

    cap_manifest = cfg.run_dir / "captions.zarr" / "manifest.json"
    encode_captions.run(cfg)
    saved = cap_manifest.read_bytes()
    write_good_images(data, 1, prefix="last")
    monkeypatch.setattr("stages.core.artifacts.os.fsync", _enospc)  # the manifest cannot be written
    with pytest.raises(DiskFull, match=f"disk full while writing '{cap_manifest}'"):
        encode_captions.run(cfg)
    assert cap_manifest.read_bytes() == saved and not list(cap_manifest.parent.glob(".manifest.json*"))
    monkeypatch.undo()
    assert encode_captions.run(cfg)["encoded_this_run"] == 0  # its row was written before the manifest failed
    assert read_manifest(cap_manifest.parent)["fingerprint"] != json.loads(saved)["fingerprint"]


@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
def test_full_disk_while_saving_a_checkpoint(built_run, monkeypatch):
    import safetensors.torch

    from stages import train
    from stages.core.artifacts import DiskFull, read_manifest
    from stages.core.config import load_config

    cfg = load_config(None, {**_flat(built_run.to_dict()), "run": "disk-full", "train.steps": 4,
                             "runtime.checkpoint_every": 2})
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    for cache in ("captions.zarr", "latents.zarr"):
        shutil.copytree(built_run.run_dir / cache, cfg.run_dir / cache)
    monkeypatch.setattr(safetensors.torch, "save_file", _fail_after(1, safetensors.torch.save_file))
    with pytest.raises(DiskFull, match=f"disk full while writing '{cfg.run_dir / 'lora' / 'checkpoint-4'}'"):
        train.run(cfg)
    lora = lora_dir(cfg)
    assert sorted(p.name for p in lora.iterdir()) == ["checkpoint-2"]  # intact; no half-written folder
    assert read_manifest(lora / "checkpoint-2")["step"] == 2
    monkeypatch.undo()
    assert train.run(cfg, resume=True)["step"] == 4
