"""Incremental, content-addressed reruns, in-process on the tiny FLUX model.

Counts what each caching stage actually encoded (`encoded_this_run` in its manifest) and checks,
independently, that the zarr shard files holding only untouched rows were not rewritten (same inode
and mtime; stores of 2 rows per shard here, so that a few images span several): adding images encodes only them, editing a caption re-encodes one caption, removing an
image drops its rows from the manifests, changing cache_variants or the resolution re-caches the
latents but not the captions, and `status` says why a stage is stale.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from badinput import write_good_images
from conftest import demo_config_path, make_cfg


def encode(cfg) -> tuple[int, int]:
    """Run both caching stages; (captions encoded, images encoded) this time."""
    from stages import cache_latents, encode_captions

    return encode_captions.run(cfg)["encoded_this_run"], cache_latents.run(cfg)["encoded_this_run"]


def chunk_stamps(cache: Path) -> dict[tuple[str, int], tuple[int, int]]:
    """(store folder, shard) -> (inode, mtime_ns) of each shard file: a rewritten shard gets a new inode
    (zarr writes a temp file and renames it over the old one)."""
    out = {}
    for p in cache.rglob("*"):
        parts = p.relative_to(cache).parts
        if p.is_file() and "c" in parts:
            at = parts.index("c")
            out[("/".join(parts[:at]), int(parts[at + 1]))] = (p.stat().st_ino, p.stat().st_mtime_ns)
    return out


def kept(cache: Path, before: tuple[dict, dict]) -> bool:
    """No shard file of `cache` that held only rows of before's stores (rows below their count then)
    was rewritten; the last, partly filled shard of a store may take new rows."""
    from stages.core.rowstore import RowStore

    stamps, counts = before
    after = chunk_stamps(cache)
    for (field_dir, shard), stamp in stamps.items():
        store = (cache / field_dir).parent
        if after.get((field_dir, shard)) != stamp and (shard + 1) * RowStore.open(store).rows_per_shard <= counts[store]:
            return False
    return True


def snapshot(cache: Path) -> tuple[dict, dict]:
    from stages.core.rowstore import RowStore

    stores = {p.parent for p in cache.rglob("zarr.json") if (p.parent / "written").is_dir()}
    return chunk_stamps(cache), {s: len(RowStore.open(s).ids) for s in stores}


def status(cfg) -> dict[str, str]:
    """`pipeline.py status --config ...` output, one line per stage."""
    from click.testing import CliRunner

    from pipeline import cli

    args = ["status", "--config", str(demo_config_path("flux")), "--model", cfg.model,
            "--set", f"data.path={cfg.data.path}", "--set", f"artifacts={cfg.artifacts}",
            "--set", f"data.cache_variants={cfg.data.cache_variants}",
            "--set", f"data.resolution={cfg.data.resolution}"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return {line.split()[0]: line for line in result.output.splitlines()}


def test_incremental_reruns_encode_only_what_changed(assets, demo_data, tmp_path, monkeypatch):
    from stages.core.artifacts import read_manifest
    from stages.core.rowstore import SHARD_ENV

    monkeypatch.setenv(SHARD_ENV, "2")
    data = tmp_path / "data"
    data.mkdir()
    for image in sorted(demo_data.glob("*.png"))[:6]:  # six items keep this test fast
        for path in (image, image.with_suffix(".txt")):
            shutil.copy(path, data / path.name)
    cfg = make_cfg("flux", assets, data, tmp_path / "artifacts", **{"data.cache_variants": 1})
    captions, latents = cfg.run_dir / "captions.zarr", cfg.run_dir / "latents.zarr"
    assert encode(cfg) == (6, 6)
    assert encode(cfg) == (0, 0)

    before = snapshot(captions), snapshot(latents)
    assert len(before[0][0]) >= 3 * 4  # several shards per array
    write_good_images(data, 3, prefix="added")
    assert encode(cfg) == (3, 3)
    assert kept(captions, before[0]) and kept(latents, before[1])
    assert chunk_stamps(captions) != before[0][0]  # the check can fail: new rows did rewrite shards

    edited = sorted(data.glob("*.txt"))[0]
    edited.write_text(edited.read_text() + ", seen from above")
    before = snapshot(captions), snapshot(latents)
    assert encode(cfg) == (1, 0)
    assert kept(captions, before[0]) and chunk_stamps(latents) == before[1][0]

    removed = sorted(data.glob("*.png"))[-1]
    removed_id = read_manifest(latents)["items"][removed.name]
    removed.unlink()
    removed.with_suffix(".txt").unlink()
    lines = status(cfg)
    assert "stale" in lines["cache-latents"] and f"1 removed ({removed.name})" in lines["cache-latents"]
    assert "stale" in lines["train"]
    assert encode(cfg) == (0, 0)
    cap, lat = read_manifest(captions), read_manifest(latents)
    assert removed.name not in cap["items"] and removed.name not in lat["items"] and removed_id not in lat["index"]
    assert len(lat["index"]) == len(cap["items"]) == 8

    for change in ({"data.cache_variants": 2}, {"data.resolution": 48}):
        cfg = make_cfg("flux", assets, data, tmp_path / "artifacts", **{"data.cache_variants": 1, **change})
        key = next(iter(change))
        lines = status(cfg)
        assert "up to date" in lines["encode-captions"], lines
        assert f"{key.split('.')[1]}: " in lines["cache-latents"], lines  # names the key that changed
        before = chunk_stamps(captions)
        assert encode(cfg) == (0, 8)
        assert chunk_stamps(captions) == before
    assert "up to date" in status(cfg)["cache-latents"]


class _Died(BaseException):
    """Stands in for SIGKILL in-process: nothing after the fault point runs (no manifest write)."""


def latent_means(latents: Path) -> dict[str, bytes]:
    from stages.core.artifacts import RowStore, read_manifest

    index = read_manifest(latents)["index"]
    return {i: RowStore.open(latents / loc["bucket"]).read("mean", loc["row"]).tobytes() for i, loc in index.items()}


def test_interrupted_rebuild_never_looks_valid(assets, demo_data, tmp_path, monkeypatch):
    """A settings change rebuilds latents.zarr in place. Interrupted midway, no manifest may vouch
    for the mix of old and new rows, under the new settings or the old ones; going back to the old
    settings re-encodes only what the rebuild replaced and ends with the same bytes as before."""
    from stages import cache_latents
    from stages.core import faults
    from stages.core.artifacts import read_manifest
    from stages import registry
    from stages.core.stage import staleness

    data = tmp_path / "data"
    data.mkdir()
    for image in sorted(demo_data.glob("*.png"))[:6]:
        for path in (image, image.with_suffix(".txt")):
            shutil.copy(path, data / path.name)
    old = make_cfg("flux", assets, data, tmp_path / "artifacts", **{"data.cache_variants": 1})
    new = make_cfg("flux", assets, data, tmp_path / "artifacts", **{"data.cache_variants": 2})
    latents = old.run_dir / "latents.zarr"
    cache_latents.run(old)
    before = latent_means(latents)

    hits: list[str] = []

    def die_in_second_row(point: str) -> None:
        hits.append(point)
        if hits.count("mid-row") == 2:
            raise _Died

    monkeypatch.setattr(faults, "hit", die_in_second_row)
    with pytest.raises(_Died):
        cache_latents.run(new)
    assert read_manifest(latents) is None
    assert "incomplete" in staleness(registry.get("cache-latents"), old)[1][0] and "incomplete" in staleness(registry.get("cache-latents"), new)[1][0]
    monkeypatch.undo()
    again = cache_latents.run(old)
    assert 1 <= again["encoded_this_run"] < 6  # buckets the rebuild had not reached yet were kept
    assert latent_means(latents) == before
