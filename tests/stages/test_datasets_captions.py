"""Several datasets in one run, caption dropout and caption variants.

The sampler's repeats and weights and the caption draws are checked over many epochs and steps on
their own (no model); one three-dataset run of the tiny FLUX pipeline shows that a shared image is
cached once, that each dataset's resolution gives its own buckets, that the empty caption and every
variant are cached rows, and that a stopped and resumed run ends bit-identical with all controls on.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

from conftest import demo_config_path, make_cfg
from stages.core.errors import ConfigError
from stages.core.caches import lora_dir

STEPS, STOP_AT = 6, 3


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text('model = "m"\n' + text)
    return path


# ---- config ------------------------------------------------------------------------------------


def test_invalid_dataset_settings_are_config_errors_naming_each_key(tmp_path):
    from stages.core.config import load_config

    path = _toml(tmp_path, """
[data]
caption_dropout = 1.5
keep_tokens = 2
[[datasets]]
path = "a"
repeats = 2
weight = 0.5
reslution = 32
[[datasets]]
resolution = 8
bucket_merge = true
keep_tokens = -1
caption_variants = 0
caption_ext = "txt"
""")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    for part in ("'data.caption_dropout' = 1.5 must be in [0, 1]",
                 "'data.keep_tokens' = 2 keeps tags in place while shuffling, but 'data.shuffle_tags' is false",
                 "'datasets[0].repeats' = 2 and 'datasets[0].weight' = 0.5 are both set",
                 "unknown key 'datasets[0].reslution' (did you mean 'datasets[0].resolution'?)",
                 "'datasets[1]' has no 'path'",
                 "'datasets[1].bucket_merge' applies to the whole run: set 'data.bucket_merge' in [data]",
                 "'datasets[1].resolution' = 8 must be >= 16", "'datasets[1].keep_tokens' = -1 must be >= 0",
                 "'datasets[1].caption_variants' = 0 must be >= 1",
                 "'datasets[1].caption_ext' = 'txt' must be a file extension starting with a dot: did you mean '.txt'?"):
        assert part in msg, (part, msg)
    _toml(tmp_path, "datasets = 3\n")
    with pytest.raises(ConfigError, match="'datasets' must be a list of tables"):
        load_config(tmp_path / "c.toml")


def test_dataset_tables_fall_back_to_data_and_resolve_paths(tmp_path):
    from stages.core.config import describe_keys, load_config

    cfg = load_config(_toml(tmp_path, """
[data]
resolution = 64
caption_dropout = 0.1
repeats = 2
[[datasets]]
path = "one/cats"
[[datasets]]
path = "two/cats"
resolution = 32
weight = 0.5
"""))
    first, second = cfg.dataset_configs()
    assert (first.path, first.resolution, first.caption_dropout, first.repeats) == (str(tmp_path / "one/cats"), 64, 0.1, 2)
    # a table's weight replaces [data]'s repeats (not both set)
    assert (second.resolution, second.caption_dropout, second.repeats, second.weight) == (32, 0.1, 1, 0.5)
    assert cfg.dataset_names() == ["cats", "cats-1"]
    keys = {row[0]: row for row in describe_keys()}
    assert keys["datasets[].resolution"][1] == "data.resolution" and "default [data]'s" in keys["datasets[].resolution"][3]
    assert keys["data.caption_dropout"][2] == "in [0, 1]"
    # the resolved config saved beside a run (config.json) loads back the same
    from stages.core.config import build_config

    assert build_config(cfg.to_dict()).dataset_configs() == cfg.dataset_configs()


# ---- the sampler -------------------------------------------------------------------------------


def _drawn(sampler, batches: int) -> Counter:
    seen: Counter = Counter()
    for _ in range(batches):
        seen.update(sampler.next()[1])
    return seen


def test_repeats_and_weights_per_epoch_and_resume_of_the_order():
    from stages.core.train_data import BucketSampler

    # items 0-3: repeats 3; items 4-11: weight 0.25 (2 of 8 per epoch, a fresh choice each epoch); 12-15 once
    buckets = {"64x64": list(range(0, 16, 2)), "32x96": list(range(1, 16, 2))}
    shares = [(list(range(4)), 3.0), (list(range(4, 12)), 0.25), (list(range(12, 16)), 1.0)]
    sampler = BucketSampler(buckets, 2, seed=7, shares=shares)
    epochs = 200
    per_epoch = [sampler.epoch_batches(e) for e in range(epochs)]
    for batches in per_epoch[:5]:
        seen = Counter(i for _, b in batches for i in b)
        assert all(seen[i] == 3 for i in range(4)) and all(seen[i] == 1 for i in range(12, 16))
        assert sum(seen[i] for i in range(4, 12)) == 2 and all(seen[i] <= 1 for i in range(4, 12))
        assert all(all(i in buckets[name] for i in b) for name, b in batches)  # a batch stays in its bucket
    weighted = Counter(i for batches in per_epoch for _, b in batches for i in b if 4 <= i < 12)
    assert all(abs(weighted[i] / epochs - 0.25) < 0.1 for i in range(4, 12)), weighted  # each about a quarter
    # deterministic, and a resumed sampler continues the same order
    again = BucketSampler(buckets, 2, seed=7, shares=shares)
    first = [again.next() for _ in range(13)]
    state = again.state_dict()
    rest = [again.next() for _ in range(20)]
    resumed = BucketSampler(buckets, 2, seed=7, shares=shares)
    resumed.load_state_dict(state)
    assert [resumed.next() for _ in range(20)] == rest
    assert first == [b for batches in per_epoch for b in batches][:13]
    # shares of 1 draw nothing: the plain order is the order without shares
    assert BucketSampler(buckets, 2, 7, [(list(range(16)), 1.0)]).epoch_batches(3) == \
        BucketSampler(buckets, 2, 7).epoch_batches(3)
    with pytest.raises(ConfigError, match="weights draw no image"):
        BucketSampler({"a": [0, 1]}, 1, 0, [([0, 1], 0.1)])


# ---- caption variants in the scan -------------------------------------------------------------


def _image(path: Path, size=(64, 64), colour="red") -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


def test_caption_variants_from_files_lines_metadata_and_tag_shuffles(tmp_path):
    import json

    from stages.core import dataset
    from stages.core.config import DataConfig

    folder = tmp_path / "d"
    _image(folder / "a.png")
    (folder / "a.txt").write_text("a red square\nred box")
    (folder / "a.1.txt").write_text("scarlet square")
    _image(folder / "b.png", colour="blue")
    (folder / "b.txt").write_text("blue")
    _image(folder / "b.1.png", colour="green")  # b.1.txt is this image's caption, not a variant of b
    (folder / "b.1.txt").write_text("green")
    whole = {it.key: it.texts for it in dataset.scan(folder)}
    assert whole == {"a.png": ("a red square\nred box", "scarlet square"), "b.1.png": ("green",), "b.png": ("blue",)}
    lines = {it.key: it.texts for it in dataset.scan(folder, caption_lines="variants")}
    assert lines["a.png"] == ("a red square", "red box", "scarlet square")
    meta = tmp_path / "m"
    _image(meta / "x.png")
    (meta / "metadata.jsonl").write_text(json.dumps({"file_name": "x.png", "text": ["one", "two, three"]}) + "\n")
    assert [it.texts for it in dataset.scan(meta)] == [("one", "two, three")]

    data = DataConfig(shuffle_tags=True, keep_tokens=1, caption_variants=6)
    text = "ohwx, red, square, centred, plain"
    shuffles = dataset.caption_shuffles(text, data, 0, "id")
    assert 1 < len(shuffles) <= 6 and len(set(shuffles)) == len(shuffles)
    assert all(s.startswith("ohwx, ") and sorted(s.split(", ")) == sorted(text.split(", ")) for s in shuffles)
    assert shuffles == dataset.caption_shuffles(text, data, 0, "id") != dataset.caption_shuffles(text, data, 1, "id")
    assert dataset.caption_shuffles("a, b", data, 0, "id") == ["a, b"]  # one tag after the kept one: one order


# ---- a three-dataset run ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_run(assets, demo_data, tmp_path_factory):
    """Dataset 'shapes' (the demo data, 64 px), 'shared' (two of its images with new, multi-line tag
    captions: dropout, shuffles, repeats 3) and 'small' (two images at 48 px, 2 variants, weight 0.5)."""
    from stages import cache_latents, encode_captions

    root = tmp_path_factory.mktemp("multi")
    shared, small = root / "shared", root / "small"
    for k, name in enumerate(sorted(p.name for p in demo_data.glob("*.png"))[:2]):
        shared.mkdir(exist_ok=True)
        shutil.copy(demo_data / name, shared / name)
        (shared / name).with_suffix(".txt").write_text(f"ohwx, shape {k}, bright, centred\nohwx, a drawing {k}")
    _image(small / "s0.png", (64, 32), "red")
    _image(small / "s1.png", (32, 64), "blue")
    (small / "s0.txt").write_text("a red bar")
    (small / "s1.txt").write_text("a blue bar")
    cfg = make_cfg("flux", assets, demo_data, root / "artifacts", run="multi", **{
        "train.steps": STEPS, "runtime.checkpoint_every": 4, "train.batch_size": 2, "data.resolution": 64,
        "datasets": [{"path": str(demo_data), "name": "shapes"},
                     {"path": str(shared), "caption_dropout": 0.5, "caption_lines": "variants",
                      "shuffle_tags": True, "keep_tokens": 1, "caption_variants": 3, "repeats": 3},
                     {"path": str(small), "resolution": 48, "cache_variants": 2, "weight": 0.5}]})
    encode_captions.run(cfg)
    cache_latents.run(cfg)
    return cfg


def test_a_shared_image_is_cached_once_and_each_resolution_has_its_buckets(multi_run):
    from stages import cache_latents
    from stages.core import dataset

    cfg = multi_run
    items = {it.key: it for it in dataset.scan_run(cfg)}
    _, manifest = cache_latents.load_latents(cfg)
    shared = [k for k in items if k.startswith("shared/")]
    assert len(shared) == 2 and len(items) == 16
    for key in shared:  # same bytes and settings as in 'shapes': one row, both items point at it
        twin = "shapes/" + key.split("/", 1)[1]
        assert manifest["items"][key] == manifest["items"][twin] == items[key].image_id
    assert len(manifest["index"]) == 14  # 12 + 2 small; the shared two add no row
    small = [manifest["index"][items[k].latent_key]["bucket"] for k in ("small/s0.png", "small/s1.png")]
    big = {manifest["index"][items[k].latent_key]["bucket"] for k in items if k.startswith("shapes/")}
    w, h = map(int, small[0].split("x"))
    assert w > h and w * h <= 48 * 48 and all(int(a) * int(b) > 48 * 48 for a, b in (s.split("x") for s in big))
    assert manifest["variants"] == 4 and set(manifest["variants_of"].values()) == {2}
    assert items["small/s0.png"].latent_key != items["small/s0.png"].image_id  # its own settings: its own row


def test_empty_caption_and_variants_are_cached_rows(multi_run):
    import numpy as np

    from stages import encode_captions
    from stages.core import dataset
    from stages.inspect import captions_section

    cfg = multi_run
    store, manifest = encode_captions.load_captions(cfg)
    empty = dataset.caption_id("")
    assert manifest["empty_caption"] == empty and empty in manifest["rows"]
    row = store.read_row(manifest["rows"][empty])
    assert set(row) == set(store.fields) and all(np.isfinite(v).all() for v in row.values())
    items = {it.key: it for it in dataset.scan_run(cfg)}
    variants = manifest["variants"]
    assert set(variants) == {k for k in items if k.startswith("shared/")}
    for key, cids in variants.items():
        texts = items[key].texts
        assert 2 < len(cids) <= 6 and cids == [dataset.caption_id(t) for t in texts]
        assert all(t.startswith("ohwx, ") for t in texts) and all(c in manifest["rows"] for c in cids)
    section = captions_section(cfg.run_dir, 4, cfg)
    shown = section["variants"][sorted(variants)[0]]
    assert [v["text"] for v in shown] == list(items[sorted(variants)[0]].texts)


def test_dropout_rate_and_variants_drawn(multi_run):
    import torch

    from stages.train.trainer import build_data

    data, _ = build_data(multi_run)
    g = torch.Generator().manual_seed(0)
    shared = [i for i, p in enumerate(data.pairs) if p.key.startswith("shared/")]
    plain = [i for i, p in enumerate(data.pairs) if p.key.startswith("shapes/")]
    draws = [data.draw_captions(shared + plain, g) for _ in range(2000)]
    empty_row = data.pairs[shared[0]].empty
    for k, i in enumerate(shared):
        got = Counter(d[k] for d in draws)
        assert abs(got[empty_row] / len(draws) - 0.5) < 0.04, got[empty_row]  # caption_dropout = 0.5
        kept = {c for c in got if c != empty_row}
        assert kept == set(zip(data.pairs[i].caption_ids, data.pairs[i].caption_rows))  # every variant drawn
    for k, i in enumerate(plain, len(shared)):  # no dropout, one caption: always its own
        assert {d[k] for d in draws} == {(data.pairs[i].caption_id, data.pairs[i].caption_row)}
    small = [i for i, p in enumerate(data.pairs) if p.key.startswith("small/")]
    picks = Counter(v for _ in range(500) for v in data.draw_variants(small + plain[:1], g)[:2])
    assert set(picks) == {0, 1}  # the 48 px dataset caches 2 variants: only those are drawn
    batch = data.load(shared[:1], [0], [empty_row])  # the swapped-in row is what the step trains on
    want = data.captions.read_row(empty_row[1])
    assert batch.caption_ids == [empty_row[0]]
    assert all((batch.cond[name][0].numpy() == want[name]).all() for name in data.caption_fields)


def _adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _copy_run(cfg, name: str):
    import dataclasses

    new = dataclasses.replace(cfg, run=name)
    shutil.rmtree(new.run_dir, ignore_errors=True)
    for cache in ("captions.zarr", "latents.zarr"):
        shutil.copytree(cfg.run_dir / cache, new.run_dir / cache)
    return new


def test_stop_and_resume_is_bit_identical_with_every_control_on(multi_run, monkeypatch):
    import torch

    from stages import train
    from stages.core import faults

    whole = _copy_run(multi_run, "multi-whole")
    train.run(whole)
    cut = _copy_run(multi_run, "multi-cut")
    monkeypatch.setenv(faults.ENV, f"train:{STOP_AT}:TERM")
    assert train.run(cut)["step"] == STOP_AT
    monkeypatch.delenv(faults.ENV)
    assert train.run(cut, resume=True)["step"] == STEPS
    want, got = _adapter(lora_dir(whole) / "final"), _adapter(lora_dir(cut) / "final")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_plain_data_path_is_unchanged(assets, demo_data, tmp_path):
    """A config without [[datasets]]: the same items, ids and cache layout as before this change."""
    from stages import cache_latents, train
    from stages.core import dataset

    cfg = make_cfg("flux", assets, demo_data, tmp_path)
    assert cfg.datasets == [] and cfg.dataset_names() == [""]
    items = dataset.scan_run(cfg)
    assert items == dataset.scan(demo_data)
    assert all(it.captions == () and it.latent_key == it.image_id and it.dataset == 0 for it in items)
    assert cache_latents.layout_parts(cfg)["datasets"] == []
    assert train.fingerprint_parts(cfg)["sampling"] == [{"repeats": 1, "weight": 0.0, "caption_dropout": 0.0}]
    assert demo_config_path("flux").read_text().count("[[datasets]]") == 0


def test_sdxl_caches_the_empty_captions_pooled_output_too(assets, tmp_path):
    """The dropout row is a normal caption row: for SDXL both encoders' states and the pooled output."""
    import numpy as np

    from stages import encode_captions
    from stages.core import dataset

    data = tmp_path / "d"
    _image(data / "a.png")
    (data / "a.txt").write_text("a red square")
    cfg = make_cfg("sdxl", assets, data, tmp_path / "artifacts", **{"data.caption_dropout": 0.1})
    manifest = encode_captions.run(cfg)
    store, _ = encode_captions.load_captions(cfg)
    empty = store.read_row(manifest["rows"][dataset.caption_id("")])
    caption = store.read_row(manifest["rows"][dataset.caption_id("a red square")])
    assert set(empty) == set(caption) and "pooled" in empty
    assert np.abs(empty["pooled"]).sum() > 0 and not np.array_equal(empty["pooled"], caption["pooled"])


# ---- the fill warning counts what an epoch draws -------------------------------------------------


def test_fill_warning_counts_each_buckets_draws_per_epoch_with_repeats_and_weights():
    from stages.core.train_data import FILL_EPOCHS, BucketSampler

    def measured(sampler, epochs):
        sizes = [len(b) for e in range(epochs) for _, b in sampler.epoch_batches(e)]
        return sum(sizes) / len(sizes)

    # two images at repeats 3 fill batches of 4 (6 draws per epoch), although the bucket holds 2 images
    assert BucketSampler({"64x64": [0, 1], "80x48": list(range(2, 6))}, 4, 0, [([0, 1], 3.0)]).fill_warning(False) is None
    assert BucketSampler({"64x64": [0, 1], "80x48": list(range(2, 6))}, 4, 0).fill_warning(False) is not None
    # weight 0.5 of six images in one bucket: 3 draws every epoch, never a batch of 4
    sampler = BucketSampler({"64x64": [0, 1], "80x48": list(range(2, 8))}, 4, 0, [([0, 1], 3.0), (list(range(2, 8)), 0.5)])
    note = sampler.fill_warning(bucket_merge=False)
    assert ("1 of the 2 buckets draw fewer than 4 images per epoch with the datasets' repeats and weights "
            "(64x64: 6, 80x48: 3); a step trains 3.00 images on average.") in note, note
    assert measured(sampler, 5) == 3.0  # batches 4 + 2 + 3 in every epoch
    assert "but a weight below 1 draws only some of them per epoch" in sampler.fill_warning(bucket_merge=True)
    # the weighted images split over two buckets: each draws 0-3 of the 3 extras, a fresh split each epoch
    split = {"64x64": [0, 1, 2], "80x48": [3, 4, 5]}
    sampler = BucketSampler(split, 4, 1, [(list(range(6)), 0.5)])
    note = sampler.fill_warning(bucket_merge=False)
    assert "2 of the 2 buckets draw fewer than 4 images per epoch" in note and "(64x64: 0-3, 80x48: 0-3)" in note
    seen = [sampler.draws(e)["64x64"] for e in range(200)]
    assert min(seen) == 0 and max(seen) == 3 and all(sum(sampler.draws(e).values()) == 3 for e in range(20))
    assert seen == [sum(1 for _, b in sampler.epoch_batches(e) for i in b if i < 3) for e in range(200)]
    assert f"a step trains {measured(sampler, FILL_EPOCHS):.2f} images on average over the first {FILL_EPOCHS} epochs" in note
    # an epoch that draws fewer images than a batch names the number it draws
    assert ("An epoch draws only 2 images (1 image with the datasets' repeats and weights): lower train.batch_size "
            "to 2") in BucketSampler({"64x64": [0]}, 4, 0, [([0], 2.0)]).fill_warning(False)


# ---- latent cache keys: only the settings the datasets use ---------------------------------------

# Recorded on main before the cache keys were read from the datasets (commit 809486f): a plain
# data.path run's latent layout, without the model identity (a hash of the tiny model's files).
PLAIN_LAYOUT = {"background": "white", "bucket_step": 0, "cache_variants": 4, "crop": "random", "crop_zoom": 0.1,
                "dtype": "float32", "family": "flux", "max_aspect": 3.0, "random_flip": True, "resolution": 64,
                "seed": 0, "vae_precision": "fp32", "vae_tiled": False, "bucket_merge": None, "datasets": []}
PLAIN_CHANGED = {"data.cache_variants": 2, "data.crop": "center", "data.resolution": 48, "data.bucket_merge": True,
                 "train.batch_size": 2, "data.random_flip": False, "data.crop_zoom": 0.0}


def test_a_plain_data_path_runs_latent_layout_is_its_data_keys(assets, demo_data, tmp_path):
    """The latents' fingerprint of a plain data.path run holds [data]'s keys and the VAE's settings, and
    changes with each of them."""
    from stages import cache_latents
    from stages.core import dataset

    changed = {**PLAIN_LAYOUT, "bucket_merge": 2, "cache_variants": 2, "crop": "center", "crop_zoom": 0.0,
               "random_flip": False, "resolution": 48}
    for overrides, want in (({}, PLAIN_LAYOUT), (PLAIN_CHANGED, changed)):
        cfg = make_cfg("flux", assets, demo_data, tmp_path, **overrides)
        layout = cache_latents.layout_parts(cfg)
        parts = cache_latents.fingerprint_parts(cfg)
        assert {k: v for k, v in layout.items() if k != "model"} == want
        assert parts == {**layout, "images": sorted(it.image_id for it in dataset.scan(demo_data))}


def test_a_data_key_every_dataset_overrides_leaves_the_latents_up_to_date(assets, demo_data, tmp_path):
    import dataclasses

    from stages import cache_latents
    from stages.core import dataset
    from stages.core.config import build_config
    from stages import registry
    from stages.core.stage import staleness

    big, small = tmp_path / "big", tmp_path / "small"
    for name in sorted(p.name for p in demo_data.glob("*.png"))[:2]:
        big.mkdir(exist_ok=True)
        shutil.copy(demo_data / name, big / name)
        shutil.copy(demo_data / Path(name).with_suffix(".txt"), big / Path(name).with_suffix(".txt"))
    _image(small / "s0.png", (64, 32), "red")
    (small / "s0.txt").write_text("a red bar")
    tables = [{"path": str(big), "resolution": 64, "cache_variants": 2},
              {"path": str(small), "resolution": 48, "cache_variants": 1}]
    cfg = make_cfg("flux", assets, demo_data, tmp_path / "artifacts", run="overridden", datasets=tables)
    items = dataset.scan_run(cfg)
    # the first dataset's settings key its rows by the bare image id; the other's get a suffix
    assert [it.latent_key == it.image_id for it in items] == [True, True, False]
    cache_latents.run(cfg)
    assert staleness(registry.get("cache-latents"), cfg) == (True, [])

    def changed(**data):
        return build_config({**cfg.to_dict(), "data": {**cfg.to_dict()["data"], **data}})

    moved = changed(resolution=96, cache_variants=3)  # every table sets both: no image reads [data]'s
    assert staleness(registry.get("cache-latents"), moved) == (True, [])
    assert dataset.scan_run(moved) == items
    assert cache_latents.run(moved)["encoded_this_run"] == 0
    up, reasons = staleness(registry.get("cache-latents"), changed(crop="center"))  # read by both datasets: stale
    assert not up and any("crop" in r for r in reasons), reasons
    own = dataclasses.replace(cfg, datasets=[tables[0], {**tables[1], "resolution": 32}])
    # a dataset's own value counts, and status names it (its rows get new keys)
    assert staleness(registry.get("cache-latents"), own) == (False, ["datasets[1].resolution: 48 -> 32", "image of small/s0.png changed"])


def test_encode_captions_with_nothing_new_is_up_to_date_and_a_moved_caption_rewrites_the_index(assets, demo_data,
                                                                                                 tmp_path):
    """A rerun with the same captions says up to date and rewrites nothing; two images that swap captions encode
    nothing (the rows are the same) but the manifest maps each image to its new caption."""
    from stages import encode_captions
    from stages.core.artifacts import read_manifest
    from stages.core.caches import captions_dir

    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    cfg = make_cfg("flux", assets, data, tmp_path / "artifacts")
    assert encode_captions.run(cfg)["encoded_this_run"] == 12
    manifest_file = captions_dir(cfg) / "manifest.json"
    written = manifest_file.stat().st_mtime_ns
    again = encode_captions.run(cfg)
    assert again.get("up_to_date") is True and again["encoded_this_run"] == 0
    assert manifest_file.stat().st_mtime_ns == written
    first, second = (data / "shape_000.txt").read_text(), (data / "shape_001.txt").read_text()
    assert first != second
    (data / "shape_000.txt").write_text(second)
    (data / "shape_001.txt").write_text(first)
    swapped = encode_captions.run(cfg)
    assert not swapped.get("up_to_date") and swapped["encoded_this_run"] == 0
    items = read_manifest(captions_dir(cfg))["items"]
    before = {k: v for k, v in again["items"].items()}
    assert items != before and sorted(items.values()) == sorted(before.values())
