"""No-op reruns read no image: the image index (stages/core/image_index.py) and the one listing per process.

Opens are counted with an audit hook on the "open" event (every real open of the process, whatever
opens it: PIL, hashlib's threads, Path.read_bytes); nothing is mocked but, in the --rehash test, a
file system whose stat does not move when the bytes do.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import pipeline
from conftest import once
from stages.core import dataset, image_index
from stages.core.dataset import IMAGE_EXTS

_COUNTING: list[list[str]] = []  # the open lists of the `opened` blocks now running


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _COUNTING and isinstance(args[0], (str, bytes, os.PathLike)):
        for seen in _COUNTING:
            seen.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # a hook cannot be removed: it counts only inside `opened`


@contextlib.contextmanager
def opened(folder: Path):
    """The images under `folder` opened inside the block, one entry per open."""
    seen: list[str] = []
    _COUNTING.append(seen)
    images: list[str] = []
    try:
        yield images
    finally:
        _COUNTING.remove(seen)
        images += [p for p in seen if p.startswith(str(folder)) and Path(p).suffix.lower() in IMAGE_EXTS]


def invoke(*args: object) -> str:
    result = CliRunner().invoke(pipeline.cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def run(built_run, tmp_path_factory):
    """A finished run of its own dataset copy (the built run's caches, lora/ and export/ copied), as
    `lorapipe run` leaves it, with files old enough for the index to keep their ids."""
    from stages.core.artifacts import atomic_write_json
    from stages.core.config import load_config
    from stages.core.runspec import flatten

    root = tmp_path_factory.mktemp("index-run")
    data = shutil.copytree(built_run.data.path, root / "data")
    cfg = load_config(None, {**flatten(built_run.to_dict()), "data.path": str(data), "artifacts": str(root / "runs")})
    shutil.copytree(built_run.run_dir, cfg.run_dir, ignore=shutil.ignore_patterns(".*.lock", "events.jsonl"))
    atomic_write_json(cfg.run_dir / "config.json", cfg.to_dict())
    _settle(data)
    return cfg


def _settle(folder: Path) -> None:
    """Wait until every file under `folder` last changed RACY_NS ago: younger ones are hashed each time."""
    newest = max(max(p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in folder.iterdir())
    time.sleep(max(0.0, (newest + image_index.RACY_NS - time.time_ns()) / 1e9 + 0.05))


def _index_file(cfg) -> Path:
    return next((Path(cfg.artifacts) / image_index.INDEX_DIR).glob("*.json"))


@once
def test_noop_commands_open_no_image(run):
    by_name = [run.run, "--artifacts", run.artifacts]
    data = Path(run.data.path)
    with opened(data) as first:
        invoke("status", *by_name)
    assert sorted(first) == sorted(str(p) for p in data.glob("*.png"))  # each image read once, not once per stage
    with opened(data) as status, opened(data) as again:
        out = invoke("status", *by_name)
        invoke("status", *by_name)
    assert status == again == [] and "stale" not in out.split("sample")[0], out
    with opened(data) as noop_run:
        out = invoke("run", *by_name)
    assert noop_run == [] and out.count("up to date, skipped") == 4, out
    with opened(data) as latents:
        out = invoke("cache-latents", *by_name)
    assert latents == [] and "cache-latents up to date" in out, out
    _index_file(run).unlink()  # encode-captions needs no image id, so no index either
    with opened(data) as captions:
        invoke("encode-captions", *by_name)
    assert captions == []


@once
def test_an_image_written_again_is_the_only_one_read(run):
    by_name = [run.run, "--artifacts", run.artifacts]
    data = Path(run.data.path)
    invoke("status", *by_name)  # the index holds every image
    touched = sorted(data.glob("*.png"))[3]
    touched.write_bytes(touched.read_bytes())  # same size and bytes, new mtime and ctime
    with opened(data) as reads:
        out = invoke("status", *by_name)
    assert reads == [str(touched)] and "stale" not in out.split("sample")[0], out  # same bytes: same id


@once
def test_changed_bytes_are_seen_through_restored_times_and_by_rehash(run):
    """Bytes changed with the mtime put back still move ctime, so the index sees it. A file system
    whose stat does not move at all (the index vouching for old bytes) is what --rehash is for."""
    by_name = [run.run, "--artifacts", run.artifacts]
    data = Path(run.data.path)
    invoke("status", *by_name)
    image = sorted(data.glob("*.png"))[5]
    before, old = image.stat(), image.read_bytes()
    try:
        image.write_bytes(old[:-1] + bytes([old[-1] ^ 1]))  # same size, other bytes
        os.utime(image, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert image.stat().st_mtime_ns == before.st_mtime_ns
        assert image.name in invoke("status", *by_name).split("train")[0]  # cache-latents stale, naming it

        index = _index_file(run)
        entries = json.loads(index.read_text())
        signature = [list(image_index._stats((image, None))[0]), [image_index.content_id(old)] * 2]
        entries["entries"][image.name] = signature  # the stat of the new bytes, the id of the old ones
        index.write_text(json.dumps(entries))
        image_index._open.clear()  # a new process: the index is read from its file
        assert image.name not in invoke("status", *by_name).split("train")[0]  # trusted: the fault shows
        with opened(data) as reads:
            out = invoke("status", *by_name, "--rehash")
        # every image read again (the two written within RACY_NS are read by each stage that scans)
        assert image.name in out.split("train")[0] and set(reads) == {str(p) for p in data.glob("*.png")}
    finally:
        image.write_bytes(old)


@once
def test_a_damaged_index_is_rebuilt_with_a_warning(run):
    by_name = [run.run, "--artifacts", run.artifacts]
    data = Path(run.data.path)
    invoke("status", *by_name)
    index = _index_file(run)
    index.write_text('{"version": 1, "entries": {"shape_000.png": [[1, 2')  # cut short
    image_index._open.clear()  # a new process: the index is read from its file, the folder scanned anew
    dataset._RUN_ITEMS.clear()
    dataset._LISTED.clear()
    _settle(data)
    with pytest.warns(image_index.DamagedIndex, match=f"image index '{index}' is damaged") as caught, \
            opened(data) as reads:
        invoke("status", *by_name)
    assert len([w for w in caught if w.category is image_index.DamagedIndex]) == 1 and sorted(reads) == sorted(str(p) for p in data.glob("*.png"))
    assert len(json.loads(index.read_text())["entries"]) == len(reads)  # rebuilt whole
    with opened(data) as reads:
        invoke("status", *by_name)
    assert reads == []


def test_threaded_ids_are_the_content_hashes(tmp_path):
    """The thread pool's ids are sha256 of the bytes (a mask's item id covers both files), as one
    process reading them in turn gets; `ids` off reads nothing."""
    from stages.core import dataset

    for i in range(6):
        (tmp_path / f"{i}.png").write_bytes(bytes([i]) * (1000 + i))
        (tmp_path / f"{i}.txt").write_text(f"caption {i}")
    (tmp_path / "2_mask.png").write_bytes(b"mask")
    with opened(tmp_path) as reads:
        bare = dataset.scan(tmp_path, ids=False)
    assert reads == [] and all(it.image_id == "" for it in bare)
    items = {it.key: it for it in dataset.scan(tmp_path)}
    for i in range(6):
        data = (tmp_path / f"{i}.png").read_bytes()
        expected = image_index.content_id(b"%d:" % len(data) + data + b"mask") if i == 2 else image_index.content_id(data)
        assert items[f"{i}.png"].image_id == expected
    assert items["2.png"].pixel_id == image_index.content_id((tmp_path / "2.png").read_bytes())


@once
def test_an_added_image_is_the_only_one_cache_latents_opens(run, tmp_path):
    """An incremental cache-latents (one image added to a cached dataset) plans the buckets from the sizes
    its manifest recorded: it opens the new image, and no other."""
    from PIL import Image

    from stages.core.artifacts import atomic_write_json, read_manifest
    from stages.core.config import load_config
    from stages.core.runspec import flatten

    data = shutil.copytree(run.data.path, tmp_path / "data")
    cfg = load_config(None, {**flatten(run.to_dict()), "data.path": str(data), "artifacts": str(tmp_path / "runs")})
    shutil.copytree(run.run_dir, cfg.run_dir, ignore=shutil.ignore_patterns(".*.lock", "events.jsonl"))
    atomic_write_json(cfg.run_dir / "config.json", cfg.to_dict())
    by_name = (cfg.run, "--artifacts", cfg.artifacts)
    _settle(data)  # copies are new files: old enough, the index keeps their ids
    invoke("cache-latents", *by_name, "--force")  # a manifest of this version, which records each image's size
    first = sorted(p for p in data.iterdir() if p.suffix.lower() in IMAGE_EXTS)[0]
    added = data / f"added{first.suffix}"
    with Image.open(first) as im:
        im = im.convert("RGB")
        im.putpixel((0, 0), (1, 2, 3))  # other bytes: a new image
        im.save(added)
    shutil.copy(first.with_suffix(".txt"), added.with_suffix(".txt"))
    _settle(data)
    with opened(data) as reads:
        out = invoke("cache-latents", *by_name)
    assert reads and {Path(p).name for p in reads} == {added.name}, reads
    manifest = read_manifest(cfg.run_dir / "latents.zarr")
    assert manifest["encoded_this_run"] == 1 and len(manifest["index"]) == len(set(manifest["items"].values())), out
    assert manifest["images_per_second"] > 0 and 0 < manifest["encoder_busy"] <= 1  # the encode loop's pace
    assert "1 of 13 encoded this run (" in " ".join(out.split()) and "images/s, encoder busy" in out, out


def test_reads_run_ahead_of_the_encoder_in_order():
    """cache-latents' reader threads prepare the next images while the encoder works on one: every unit comes
    back once, in order, with its own result, a reader's error raised at its unit, and at most 2 x workers
    prepared ahead of the one being encoded."""
    import threading

    from stages.core.cache_build import prefetched

    started: list[int] = []
    lock = threading.Lock()

    def prepare(k: int) -> int:
        with lock:
            started.append(k)
        if k == 7:
            raise ValueError("unreadable 7")
        return k * k

    seen = []
    with pytest.raises(ValueError, match="unreadable 7"):
        for k, value in prefetched(range(20), prepare, workers=2):
            assert value == k * k and max(started) <= k + 4  # never more than 2 x workers ahead
            seen.append(k)
    assert seen == list(range(7))


HEAVY = ("torch", "diffusers", "transformers")


@once
def test_status_and_a_noop_run_import_no_torch(run):
    """`status` and a no-op `run` of a finished run, each in its own process as the user runs them, find
    every stage up to date without importing torch, diffusers or transformers (stages/core/lazy.py: torch
    alone is most of a 2 s budget)."""
    import subprocess

    root = Path(pipeline.__file__).resolve().parent
    code = ("import sys; sys.argv = ['lorapipe', *sys.argv[1:]]\nfrom pipeline import cli\n"
            "try:\n    cli(standalone_mode=False)\nfinally:\n"
            f"    print('heavy:', sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "LORAPIPE_PLAIN": "1"}
    for command in ("status", "run"):
        out = subprocess.run([sys.executable, "-c", code, command, run.run, "--artifacts", str(run.artifacts)],
                             cwd=root, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "heavy: []" in out.stdout, out.stdout
        lines = [line for line in out.stdout.splitlines() if line.startswith(("encode-captions", "cache-latents", "train"))]
        assert len(lines) == 3 and all("up to date" in line for line in lines), out.stdout
