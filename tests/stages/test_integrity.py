"""Damaged caches and the artifact schema.

Each damage (a deleted shard file, a truncated one, a flipped byte in one row, a truncated manifest) is detected
by `status` or by the first read, named, and repaired by the cache stage re-encoding exactly the
damaged rows; after a repair the adapter equals the undamaged run's. A manifest that does not parse
reads as missing with a warning. `--force` checks the config before it deletes anything.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from stages.core.caches import lora_dir

ON_FLUX = pytest.mark.parametrize("built_run", ["flux"], indirect=True)  # one family: the row store is shared


@pytest.fixture
def run_copy(built_run, tmp_path):
    """The built run copied, so a test may damage it freely."""
    shutil.copytree(built_run.run_dir, tmp_path / built_run.run, ignore=shutil.ignore_patterns(".*.lock"))
    return dataclasses.replace(built_run, artifacts=str(tmp_path))


def shard_file(store_dir: Path, field: str, row: int) -> Path:
    """The shard file that holds one row of one field (zarr v3's default key layout)."""
    from stages.core.rowstore import RowStore

    store = RowStore.open(store_dir)
    arr = store.group[field]
    return store_dir / field / arr.metadata.encode_chunk_key((store.shard_of(row), *(0,) * (arr.ndim - 1)))


def row_offset(store_dir: Path, field: str, row: int) -> tuple[Path, int]:
    """(shard file, offset of the row's bytes in it): in a plain chunk the rows lie in order; a shard
    ends with its index, (offset, size) as two little-endian uint64 per row, then a crc32c (zarr's
    sharding codec)."""
    import numpy as np

    from stages.core.rowstore import RowStore

    store = RowStore.open(store_dir)
    per_shard, arr = store.rows_per_shard, store.group[field]
    path = shard_file(store_dir, field, row)
    if arr.shards is None:
        return path, (row % per_shard) * int(np.prod(arr.shape[1:])) * arr.dtype.itemsize
    index = np.frombuffer(path.read_bytes()[-(16 * per_shard + 4):-4], dtype="<u8").reshape(per_shard, 2)
    return path, int(index[row % per_shard, 0])


def shard_mates(store_dir: Path, row: int, referenced: list[int]) -> int:
    """How many of the `referenced` rows share `row`'s shard (a deleted shard file damages them all)."""
    from stages.core.rowstore import RowStore

    store = RowStore.open(store_dir)
    return sum(store.shard_of(r) == store.shard_of(row) for r in referenced)


def first_latent_row(cfg) -> tuple[Path, int, str]:
    """(bucket store folder, row, item key) of one cached image."""
    from stages.core.artifacts import read_manifest

    manifest = read_manifest(cfg.run_dir / "latents.zarr")
    key, image_id = sorted(manifest["items"].items())[0]
    loc = manifest["index"][image_id]
    return cfg.run_dir / "latents.zarr" / loc["bucket"], loc["row"], key


def encoded(result: dict) -> int:
    return result["encoded_this_run"]


@ON_FLUX
def test_deleted_and_truncated_shards_are_named_by_status_and_reencoded(run_copy):
    from stages import cache_latents, encode_captions, train
    from stages.core.artifacts import read_manifest
    from stages.core.errors import ArtifactError
    from stages.core.rowstore import RowStore
    from stages import registry
    from stages.core.stage import staleness

    store_dir, row, key = first_latent_row(run_copy)
    index = read_manifest(store_dir.parent)["index"]
    lost = shard_mates(store_dir, row, [loc["row"] for loc in index.values() if loc["bucket"] == store_dir.name])
    shard_file(store_dir, "mean", row).unlink()
    cap_dir = run_copy.run_dir / "captions.zarr"
    cap_shard = shard_file(cap_dir, RowStore.open(cap_dir).fields[0], 1)
    cap_shard.write_bytes(cap_shard.read_bytes()[:10])
    cap_lost = shard_mates(cap_dir, 1, list(read_manifest(cap_dir)["rows"].values()))

    ok, reasons = staleness(registry.get("cache-latents"), run_copy)
    assert not ok and f"damaged: {lost} row(s)" in reasons[0] and key in reasons[0] and "cache-latents" in reasons[0]
    ok, reasons = staleness(registry.get("encode-captions"), run_copy)
    assert not ok and f"damaged: {cap_lost} row(s) of captions.zarr" in reasons[0]
    with pytest.raises(ArtifactError, match="cache-latents"):
        train.check_upstream(run_copy)

    assert encoded(cache_latents.run(run_copy)) == lost and encoded(encode_captions.run(run_copy)) == cap_lost
    assert staleness(registry.get("cache-latents"), run_copy) == (True, []) and staleness(registry.get("encode-captions"), run_copy) == (True, [])


@ON_FLUX
def test_flipped_byte_stops_train_and_one_rerun_repairs_it_to_the_same_adapter(run_copy, built_run):
    from stages import cache_latents, encode_captions, train
    from stages.core.errors import ArtifactError
    from stages import registry
    from stages.core.stage import staleness

    store_dir, row, key = first_latent_row(run_copy)
    path, at = row_offset(store_dir, "logvar", row)
    data = bytearray(path.read_bytes())
    data[at + 20] ^= 0x01  # one row's bytes: only that row fails its checksum
    path.write_bytes(bytes(data))
    shutil.rmtree(lora_dir(run_copy))

    with pytest.raises(ArtifactError, match=f"item '{key}'.*cache-latents"):
        train.run(run_copy)
    assert not staleness(registry.get("cache-latents"), run_copy)[0]  # the read unflagged the row: status names it now
    assert encoded(cache_latents.run(run_copy)) == 1 and encoded(encode_captions.run(run_copy)) == 0
    train.run(run_copy)
    repaired = load_file(lora_dir(run_copy) / "final" / "adapter_model.safetensors")
    reference = load_file(lora_dir(built_run) / "final" / "adapter_model.safetensors")
    assert repaired.keys() == reference.keys()
    assert all(torch.equal(repaired[k], reference[k]) for k in reference)


@ON_FLUX
def test_truncated_manifest_reads_as_missing_with_a_warning_and_reencodes_nothing(run_copy):
    from stages import cache_latents
    from stages.core.artifacts import DamagedManifest, read_manifest
    from stages import registry
    from stages.core.stage import staleness

    path = run_copy.run_dir / "latents.zarr" / "manifest.json"
    path.write_text(path.read_text()[:40])
    with pytest.warns(DamagedManifest, match="manifest.json' is treated as missing"):
        assert read_manifest(path.parent) is None
    with pytest.warns(DamagedManifest):
        assert "damaged:" in staleness(registry.get("cache-latents"), run_copy)[1][0]
        assert encoded(cache_latents.run(run_copy)) == 0
    assert read_manifest(path.parent)["index"]


@ON_FLUX
def test_a_damaged_manifest_is_named_once_per_command_with_what_repairs_it(run_copy):
    import warnings

    from click.testing import CliRunner

    import pipeline
    from stages.core.artifacts import atomic_write_json

    atomic_write_json(run_copy.run_dir / "config.json", run_copy.to_dict())
    repair = f"`lorapipe cache-latents {run_copy.run} --artifacts {run_copy.artifacts}` rewrites it"

    def invoke(*args: str):
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = pipeline._show_warning  # as the CLI shows them
            result = CliRunner().invoke(pipeline.cli, [*args, run_copy.run, "--artifacts", run_copy.artifacts])
        lines = {line.split()[0]: line for line in result.output.splitlines() if line[:1].strip()}
        return result, lines

    def damage(name: str) -> None:
        path = run_copy.run_dir / name
        path.write_bytes(path.read_bytes()[:200])

    damage("latents.zarr/manifest.json")
    status, lines = invoke("status")
    warned = [line for line in status.output.splitlines() if line.startswith("warning:")]
    assert status.exit_code == 0 and len(warned) <= 1, status.output  # a damage is named once per command
    assert "damaged:" in lines["cache-latents"] and repair in lines["cache-latents"]
    assert "latents.zarr cannot be read (its manifest is damaged)" in lines["train"]
    train, _ = invoke("train", "--resume")
    assert train.exit_code == 2 and "not made for this config" not in train.output and train.output.count("warning:") <= 1
    assert "damaged: latents.zarr/manifest.json cannot be read" in train.output and repair in train.output
    assert invoke("cache-latents")[0].exit_code == 0 and "up to date" in invoke("status")[1]["cache-latents"]

    damage("lora/final/manifest.json")
    status, lines = invoke("status")
    warned = [line for line in status.output.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "lora/final/manifest.json' is treated as missing" in warned[0], status.output
    assert f"`lorapipe train {run_copy.run} --artifacts {run_copy.artifacts} --resume` writes the adapter again" in warned[0]
    assert "cached rows" not in warned[0] and "damaged:" in lines["train"]


@ON_FLUX
def test_force_checks_the_config_before_deleting_the_cache(run_copy):
    from click.testing import CliRunner

    import pipeline
    from conftest import demo_config_path

    cap_dir = run_copy.run_dir / "captions.zarr"
    before = (cap_dir / "manifest.json").read_bytes()
    sets = {"model": run_copy.model, "data.path": run_copy.data.path, "artifacts": run_copy.artifacts,
            "device": "cpu", "captions.text_encoder_precision": "nf4"}
    result = CliRunner().invoke(pipeline.cli, ["encode-captions", "--force", "--config", str(demo_config_path("flux")),
                                               "--run", run_copy.run, *[a for k, v in sets.items()
                                                                        for a in ("--set", f"{k}={v}")]])
    assert result.exit_code == 2 and "captions.text_encoder_precision = 'nf4' needs a CUDA GPU" in result.output
    assert (cap_dir / "manifest.json").read_bytes() == before and any((cap_dir / "written").rglob("*"))


@ON_FLUX
def test_caption_manifest_keeps_lengths_not_texts_and_inspect_reads_the_dataset(run_copy, tmp_path):
    from stages import inspect as inspect_stage
    from stages.core.artifacts import read_manifest
    from stages.core.dataset import scan

    manifest = read_manifest(run_copy.run_dir / "captions.zarr")
    items = scan(run_copy.data.path)
    assert "texts" not in manifest and manifest["lengths"] == {it.caption_id: len(it.caption) for it in items}
    assert all(it.caption not in json.dumps(manifest) for it in items if len(it.caption) > 12)

    data = tmp_path / "data"
    shutil.copytree(run_copy.data.path, data)
    edited = sorted(data.rglob("*.txt"))[0]
    edited.write_text("a caption written after encoding")
    moved = dataclasses.replace(run_copy, data=dataclasses.replace(run_copy.data, path=str(data)))
    texts = [c["text"] for c in inspect_stage.captions_section(run_copy.run_dir, 4, moved)["captions"]]
    assert texts.count(inspect_stage.CAPTION_GONE) == 1 and "a caption written after encoding" not in texts


@ON_FLUX
def test_inspect_reports_damaged_rows(run_copy):
    from stages import inspect as inspect_stage
    from stages.core.rowstore import RowStore

    store_dir, row, _ = first_latent_row(run_copy)
    path, at = row_offset(store_dir, "mean", row)
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    report = inspect_stage.latents_section(run_copy.run_dir, 64)
    assert report["buckets"][store_dir.name]["damaged_rows"] == [RowStore.open(store_dir).ids[row]]
    assert inspect_stage.captions_section(run_copy.run_dir, 64, run_copy)["damaged_rows"] == []


def test_manifest_schema_rejects_bad_fields_and_bucket_parses_once():
    from stages.core.artifacts import write_manifest
    from stages.core.schema import Bucket, validate_manifest

    assert str(Bucket.parse("512x768")) == "512x768" and Bucket.parse("512x768") == (512, 768, 1) and Bucket.parse("832x480x33f") == (832, 480, 33)
    with pytest.raises(ValueError, match="not a bucket name"):
        Bucket.parse("512-768")
    assert validate_manifest("latents", []) == ["a manifest is a JSON object, not list"]
    problems = validate_manifest("captions", {"schema_version": 2, "code_version": "x", "stage": "encode-captions",
                                              "written_at": "t", "rows": [], "texts": {}})
    assert "captions: missing field 'lengths'" in problems and any("'rows'" in p and "object" in p for p in problems)
    assert any("undocumented field 'texts'" in p for p in problems)
    with pytest.raises(ValueError, match="missing field 'step'"):
        write_manifest(Path("/nonexistent"), "train", kind="checkpoint", fingerprint="f", fingerprint_parts={})


@ON_FLUX
def test_prefetched_rows_load_as_read_rows_and_a_damaged_one_still_names_its_item(run_copy):
    """Train reads the next batch's rows on a thread: a load of prefetched rows equals a plain load,
    holds nothing once used, and a row damaged on disk stops training naming its item as before."""
    from stages.core.errors import ArtifactError
    from stages.train.trainer import build_data

    data, _ = build_data(run_copy)
    bucket = str(data.pairs[0].bucket)
    batch = [i for i, p in enumerate(data.pairs) if str(p.bucket) == bucket][:2]
    plain = data.load(batch, [0] * len(batch))
    data.prefetch(batch)
    assert data._ahead  # reads in flight or done, none consumed yet
    ahead = data.load(batch, [0] * len(batch))
    assert torch.equal(ahead.mean, plain.mean) and all(torch.equal(ahead.cond[k], plain.cond[k]) for k in plain.cond)
    assert all((id(data.latents[bucket]), data.pairs[i].latent_row) not in data._ahead for i in batch)  # taken, not kept

    store_dir = run_copy.run_dir / "latents.zarr" / bucket
    path, at = row_offset(store_dir, "mean", data.pairs[batch[0]].latent_row)
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    data, _ = build_data(run_copy)
    data.prefetch(batch)
    with pytest.raises(ArtifactError, match=f"item '{data.pairs[batch[0]].key}'.*cache-latents"):
        data.load(batch, [0] * len(batch))


@ON_FLUX
def test_a_cache_of_an_older_layout_is_rebuilt_once_with_one_warning(run_copy):
    """A latents.zarr of an older lorapipe (schema 3 manifest, stores of one chunk file per row, no
    `format` attribute) is read as missing with one warning and re-encoded whole, once."""
    import warnings

    import zarr

    from stages import cache_latents
    from stages.core.artifacts import DamagedManifest, atomic_write_json, read_json

    out = run_copy.run_dir / "latents.zarr"
    manifest = read_json(out / "manifest.json")
    atomic_write_json(out / "manifest.json", {**manifest, "schema_version": 3})
    for bucket in manifest["buckets"]:
        del zarr.open_group(str(out / bucket), mode="a").attrs["format"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rebuilt = cache_latents.run(run_copy)
    assert [str(w.message) for w in seen if w.category is DamagedManifest] == [
        f"'{out / 'manifest.json'}' is treated as missing: another lorapipe version wrote it (schema 3, this one "
        f"reads 4); `lorapipe cache-latents {run_copy.run} --artifacts {run_copy.artifacts}` rewrites it and keeps the "
        f"cached rows (only missing ones are encoded)"]
    assert encoded(rebuilt) == len(rebuilt["index"]) == len(manifest["index"])
    assert encoded(cache_latents.run(run_copy)) == 0
