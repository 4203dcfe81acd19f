"""Dataset rules: reads stay inside the dataset folder unless
data.follow_symlinks_outside; unreadable files are messages (an image follows data.on_bad_image);
files left out or merged are warned about once per kind, naming them; a caption's BOM is stripped
and NUL bytes refused; buckets that cannot fill a batch are warned about with the numbers, and
data.bucket_merge moves their images to the nearest bucket that can.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import shutil
from pathlib import Path

import pytest

from badinput import (BOM_CAPTION, METADATA_CASES, OUTSIDE_TEXT, SYMLINK_CASES, png_bytes, quadrant_image,
                      write_caption_case, write_dropped_cases, write_good_images, write_path_case)
from conftest import make_cfg

# ---- paths that leave the dataset folder -------------------------------------------------------


@pytest.mark.parametrize("case", SYMLINK_CASES)
def test_symlink_outside_is_refused_unless_allowed(tmp_path, case):
    from stages.core.dataset import DatasetError, scan

    data = tmp_path / "data"
    link = write_path_case(data, case)
    with pytest.raises(DatasetError) as e:
        scan(data)
    assert f"'{link}' resolves to '{link.resolve()}', outside the dataset folder '{data}'" in str(e.value)
    assert "data.follow_symlinks_outside = true" in str(e.value)
    items = {it.key: it for it in scan(data, follow_symlinks_outside=True)}
    assert sorted(items) == ["good_00.png", "x.png"]
    if case == "caption_symlink":
        assert items["x.png"].caption == OUTSIDE_TEXT


@pytest.mark.parametrize("case", METADATA_CASES)
def test_metadata_names_outside_the_folder_are_refused(tmp_path, case):
    from stages.core.dataset import DatasetError, scan

    data = tmp_path / "data"
    meta = write_path_case(data, case)
    for follow in (False, True):  # the key allows symlinks, never a name that climbs out
        with pytest.raises(DatasetError) as e:
            scan(data, follow_symlinks_outside=follow)
        assert f"{meta}:2: file_name '" in str(e.value) and f"is not inside the dataset folder '{data}'" in str(e.value)


def test_the_config_key_reaches_the_scan(assets, tmp_path):
    from stages import encode_captions
    from stages.core.dataset import DatasetError

    data = tmp_path / "data"
    write_path_case(data, "caption_symlink")
    with pytest.raises(DatasetError, match="outside the dataset folder"):
        encode_captions.fingerprint_parts(make_cfg("flux", assets, data, tmp_path / "a"))
    allowed = make_cfg("flux", assets, data, tmp_path / "a", **{"data.follow_symlinks_outside": True})
    assert len(encode_captions.fingerprint_parts(allowed)["captions"]) == 2


# ---- unreadable files ----------------------------------------------------------------------------


@pytest.fixture
def deny(monkeypatch):
    """deny(path): opening `path` raises PermissionError, as for a file of another user (chmod does
    not stop root, so the fault is injected)."""
    denied: set[str] = set()
    real = builtins.open

    def guarded(file, *args, **kwargs):
        if str(file) in denied:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    monkeypatch.setattr(io, "open", guarded)  # pathlib's read_bytes opens through io.open
    return lambda path: denied.add(str(path))


def test_unreadable_caption_is_named(tmp_path, deny):
    from stages.core.dataset import DatasetError, scan

    write_good_images(tmp_path, 2)
    deny(tmp_path / "good_01.txt")
    with pytest.raises(DatasetError, match=f"caption '{tmp_path / 'good_01.txt'}' cannot be read "
                                           r"\(Permission denied\): fix its permissions"):
        scan(tmp_path)


def test_unreadable_image_follows_on_bad_image(assets, tmp_path, deny):
    from stages import cache_latents
    from stages.core.dataset import scan
    from stages.core.image_io import BadImage

    data = tmp_path / "data"
    write_good_images(data, 2)
    deny(data / "good_01.png")
    assert [it.key for it in scan(data)] == ["good_00.png", "good_01.png"]  # the scan itself does not fail
    reason = f"image '{data / 'good_01.png'}' cannot be read (Permission denied): fix its permissions"
    with pytest.raises(BadImage, match=reason.replace("(", r"\(").replace(")", r"\)")):
        cache_latents.run(make_cfg("flux", assets, data, tmp_path / "a", **{"data.cache_variants": 1}))
    skip = make_cfg("flux", assets, data, tmp_path / "b", **{"data.cache_variants": 1, "data.on_bad_image": "skip"})
    manifest = cache_latents.run(skip)
    assert [s["item"] for s in manifest["skipped"]] == ["good_01.png"] and reason in manifest["skipped"][0]["reason"]
    assert len(manifest["index"]) == 1


# ---- files left out or merged, captions with a BOM or NUL --------------------------------------


def test_files_left_out_or_merged_are_warned_once_per_kind(tmp_path):
    from stages.core.dataset import scan

    cases = write_dropped_cases(tmp_path)
    warnings: list[tuple[str, str | None]] = []
    items = scan(tmp_path, warn=lambda message, item: warnings.append((message, item)))
    assert [it.key for it in items] == ["good_00.png", "good_01.png", "twin.jpg", "twin.png"]
    assert len(warnings) == len(cases)  # one per kind
    for kind, names in cases.items():
        message, = [m for m, _ in warnings if all(f"'{n}'" in m for n in names)]
        assert {"special": "not readable files", "format": "format that is not read (.gif, .heic)",
                "shared": "'twin.jpg' and 'twin.png' ('twin.txt')"}[kind] in message
    special = next(m for m, _ in warnings if "fifo.png" in m)
    assert "'fifo.png' (not a regular file" in special and "'broken.png' (a broken symlink" in special
    # a warning naming several files has no single item; the twins are one case, named by its first image
    assert sorted(item or "" for _, item in warnings) == ["", "", "twin.jpg"]


def test_stage_warnings_reach_the_event_log(assets, tmp_path):
    from stages import encode_captions
    from stages.core.events import read_events

    data = tmp_path / "data"
    write_good_images(data, 1)
    (data / "solo.gif").write_bytes(b"GIF89a")
    (data / "solo.txt").write_text("an animation")
    cfg = make_cfg("flux", assets, data, tmp_path / "a")
    encode_captions.run(cfg)
    warning, = [e for e in read_events(cfg.run_dir) if e["event"] == "warning"]
    assert warning["item"] == "solo.gif" and "convert them to PNG, JPEG or WebP" in warning["message"]


def test_caption_bom_is_stripped_and_nul_refused(tmp_path):
    from stages.core.dataset import DatasetError, caption_id, scan

    bom = tmp_path / "bom"
    write_caption_case(bom, "bom")
    item = next(it for it in scan(bom) if it.key == "bom.png")
    assert item.caption == BOM_CAPTION and item.caption_id == caption_id(BOM_CAPTION)
    nul = tmp_path / "nul"
    write_caption_case(nul, "nul")
    with pytest.raises(DatasetError, match=f"caption '{nul / 'nul.txt'}' contains NUL bytes at offset 10"):
        scan(nul)
    meta = tmp_path / "meta"
    write_good_images(meta, 1)
    (meta / "metadata.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"file_name": "good_00.png", "text": "x"}).encode())
    assert [it.caption for it in scan(meta)] == ["x"]


# ---- buckets that cannot fill a batch -----------------------------------------------------------

BUCKETS = [(48, 80), (64, 64), (80, 48)]  # make_buckets(64, 16, 3.0), the demo's


def test_bucket_merge_moves_images_to_the_nearest_full_bucket():
    from stages.core.aspect_buckets import assign_bucket, bucket_plan, kept_fraction, merge_buckets

    sizes = {f"sq{i}": (64, 64 + i) for i in range(5)} | {"wide": (96, 64), "wider": (128, 48), "tall": (64, 96)}
    assert merge_buckets(sizes, BUCKETS, 0) == {i: assign_bucket(s, BUCKETS) for i, s in sizes.items()}
    merged = merge_buckets(sizes, BUCKETS, 4)
    assert set(merged.values()) == {(64, 64)}  # the only bucket holding 4
    assert merge_buckets(sizes, BUCKETS, 4) == merged  # a pure function of the sizes
    assert merge_buckets(sizes, BUCKETS, 2) == {i: assign_bucket(s, BUCKETS) if i != "tall" else (64, 64)
                                                for i, s in sizes.items()}  # two wide ones fill 80x48
    assert kept_fraction((96, 64), (64, 64)) < kept_fraction((96, 64), (80, 48))  # cropped more
    # no bucket holds 3: the emptiest (tall, 1) folds into its nearest occupied neighbour, 64x64, which
    # then holds 3; the wide ones (2) move there too
    few = {"a": (64, 64), "b": (64, 66), "c": (96, 64), "d": (100, 64), "e": (64, 96)}
    assert set(merge_buckets(few, BUCKETS, 3).values()) == {(64, 64)}
    assert set(merge_buckets({"a": (64, 64), "c": (96, 64), "d": (100, 64)}, BUCKETS, 3).values()) == {(80, 48)}
    assert merge_buckets(few, BUCKETS, 6) == merge_buckets(few, BUCKETS, 0)  # 5 images cannot fill 6
    _, notes = bucket_plan({i: (f"{i}.png", s) for i, s in sizes.items()}, BUCKETS, 4, 3.0)
    moved = [n for key, n in notes if key is None][0]
    assert "data.bucket_merge moved 3 images into buckets holding at least 4" in moved
    assert "'wide.png' 96x64 to 64x64 (keeps 67%)" in moved


def test_merged_buckets_fill_every_batch():
    from stages.core.aspect_buckets import bucket_name, merge_buckets
    from stages.core.train_data import BucketSampler

    sizes = {f"sq{i}": (64, 64) for i in range(6)} | {"w1": (96, 64), "t1": (64, 96)}
    for fill, want in ((0, [1, 1, 2, 4]), (4, [4, 4])):
        members: dict[str, list[int]] = {}
        for n, (_, bucket) in enumerate(sorted(merge_buckets(sizes, BUCKETS, fill).items())):
            members.setdefault(bucket_name(bucket), []).append(n)
        sampler = BucketSampler(members, 4, seed=0)
        assert sorted(len(b) for _, b in sampler.epoch_batches(0)) == want
        assert (sampler.fill_warning(False) is None) == (fill == 4)


def test_fill_warning_gives_the_numbers():
    from stages.core.train_data import BucketSampler

    buckets = {"80x48": [0], "48x80": [1, 2], "64x64": list(range(3, 12))}
    note = BucketSampler(buckets, 4, seed=0).fill_warning(bucket_merge=False)
    assert ("batches of 4 cannot be filled: a batch comes from one aspect bucket, and 2 of the 3 buckets hold "
            "fewer than 4 images (48x80: 2, 64x64: 9, 80x48: 1); a step trains 2.40 images on average") in note
    assert "Set data.bucket_merge = true" in note
    assert "The dataset has only 3 trainable images: lower train.batch_size to 3" in \
        BucketSampler({"64x64": [0, 1], "80x48": [2]}, 4, seed=0).fill_warning(bucket_merge=True)
    assert "a batch over several processes is larger" in BucketSampler(buckets, 8, 0).fill_warning(bucket_merge=True)
    assert BucketSampler({"64x64": list(range(5))}, 4, seed=0).fill_warning(False) is None  # a short last batch only


def _mixed_dataset(folder: Path) -> Path:
    """8 images, in buckets 64x64: 5, 80x48: 2 (good_05.png is 84x64), 48x80: 1: batches of 4 fill
    only the square bucket."""
    write_good_images(folder, 6)
    for name, (w, h) in {"wide.png": (96, 64), "tall.png": (64, 96)}.items():
        (folder / name).write_bytes(png_bytes(quadrant_image(w, h)))
        (folder / name).with_suffix(".txt").write_text(f"a {name[:-4]} test card")
    return folder


def test_train_warns_and_bucket_merge_fills_the_batches(assets, tmp_path):
    from stages import cache_latents, encode_captions, train
    from stages.core.events import read_events

    data = _mixed_dataset(tmp_path / "data")
    small = {"data.cache_variants": 1, "data.bucket_step": 16}  # the buckets of BUCKETS
    plain = make_cfg("flux", assets, data, tmp_path / "a", **small, **{"train.steps": 1})
    encode_captions.run(plain)
    assert cache_latents.run(plain)["buckets"] == {"48x80": 1, "64x64": 5, "80x48": 2}
    train.run(plain)
    warning, = [e["message"] for e in read_events(plain.run_dir) if e["event"] == "warning" and e["stage"] == "train"]
    assert "2 of the 3 buckets hold fewer than 4 images (48x80: 1, 64x64: 5, 80x48: 2)" in warning

    merged = make_cfg("flux", assets, data, tmp_path / "b", **small, **{"data.bucket_merge": True, "train.steps": 2})
    assert cache_latents.fingerprint_parts(merged)["bucket_merge"] == 4
    assert cache_latents.fingerprint_parts(plain)["bucket_merge"] is None
    shutil.copytree(plain.run_dir / "captions.zarr", merged.run_dir / "captions.zarr")
    manifest = cache_latents.run(merged)
    assert manifest["buckets"] == {"64x64": 8} and {v["bucket"] for v in manifest["index"].values()} == {"64x64"}
    train.run(merged)
    assert not [e for e in read_events(merged.run_dir) if e["event"] == "warning" and e["stage"] == "train"]
    assert [e["batch_size"] for e in read_events(merged.run_dir) if e["event"] == "step"] == [4, 4]
