"""Unit tests of the pieces under the stages: config, flow-matching math, dataset plan, stores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT
from stages.core import aspect_buckets, dataset, flow
from stages.core.artifacts import RowStore
from stages.core.config import ConfigError, load_config, parse_override


# ---- config ----------------------------------------------------------------------------------


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_unknown_key_names_the_nearest(tmp_path):
    p = _write(tmp_path, 'model = "x"\n[train]\nlearnig_rate = 1e-4\nstepz = 3\n[dta]\npath = "d"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg
    assert "'train.learnig_rate'" in msg and "did you mean 'train.learning_rate'" in msg
    assert "did you mean 'train.steps'" in msg
    assert "unknown key 'dta.path' (did you mean 'data.path'?)" in msg  # all errors at once, a misspelt section by key


def test_types_and_choices_are_checked(tmp_path):
    p = _write(tmp_path, 'model = "x"\n[train]\nsteps = "many"\nlr_scheduler = "cosinus"\nbatch_size = 0\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "'train.steps' must be an integer" in msg
    assert "'train.lr_scheduler' = 'cosinus' is not one of" in msg
    assert "'train.batch_size' = 0 must be >= 1" in msg  # value errors are not hidden by the type errors


def test_cli_overrides_win_over_the_file(tmp_path):
    p = _write(tmp_path, 'model = "x"\n[train]\nsteps = 5\n')
    cfg = load_config(p, dict(parse_override(s) for s in ["train.steps=7", "train.target_modules=['a', 'b']", "run=r2"]))
    assert cfg.train.steps == 7 and cfg.train.target_modules == ["a", "b"] and cfg.run == "r2"
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        load_config(p, {"train.step": 3})


def test_help_does_not_import_torch():
    code = "import sys; sys.argv=['pipeline.py','--help']; import pipeline\ntry:\n pipeline.cli()\nexcept SystemExit: pass\nassert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "encode-captions" in r.stdout


# ---- flow matching ---------------------------------------------------------------------------


def test_sigma_table_matches_diffusers_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    for shift in (1.0, 3.0):
        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
        torch.testing.assert_close(flow.sigma_table(shift), sched.sigmas[:1000].float(), rtol=1e-6, atol=1e-6)


def test_vectorized_lookup_equals_per_sample_search():
    """diffusers' examples search each timestep in the schedule with .nonzero(); ours indexes."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    u = flow.sample_density(256, torch.Generator().manual_seed(0), "logit_normal")
    timesteps = sched.timesteps[(u * 1000).long()]
    searched = torch.stack([sched.sigmas[(sched.timesteps == t).nonzero().item()] for t in timesteps])
    torch.testing.assert_close(flow.lookup_sigmas(u, flow.sigma_table(3.0)), searched.float())


def test_densities():
    g = torch.Generator().manual_seed(0)
    for name in ("logit_normal", "mode", "uniform"):
        u = flow.sample_density(20000, g, name)
        assert 0 <= u.min() and u.max() <= 1, name
    assert abs(flow.sample_density(20000, g, "logit_normal").median().item() - 0.5) < 0.02
    assert flow.sample_density(20000, g, "logit_normal", logit_mean=1.0).median() > 0.7
    with pytest.raises(ValueError):
        flow.sample_density(2, g, "gamma")


def test_packing_matches_flux_pipeline():
    from diffusers import FluxPipeline

    x = torch.randn(2, 16, 8, 12)
    packed = flow.pack_2x2(x)
    torch.testing.assert_close(packed, FluxPipeline._pack_latents(x, 2, 16, 8, 12))
    torch.testing.assert_close(flow.unpack_2x2(packed, 8, 12), x)


def test_posterior_sample_equals_diffusers_distribution():
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    mean, logvar = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8) * 3
    dist = DiagonalGaussianDistribution(torch.cat([mean, logvar], dim=1))
    expected = dist.sample(torch.Generator().manual_seed(1))
    eps = torch.randn(mean.shape, generator=torch.Generator().manual_seed(1))
    from stages.core.train_data import sample_posterior

    torch.testing.assert_close(sample_posterior(mean, dist.logvar, eps), expected)


# ---- dataset ---------------------------------------------------------------------------------


def test_buckets_respect_multiple_area_and_aspect():
    buckets = aspect_buckets.make_buckets(1024, 16, 3.0)
    assert (1024, 1024) in buckets
    for w, h in buckets:
        assert w % 16 == 0 and h % 16 == 0
        assert 0.8 * 1024**2 <= w * h <= 1024**2
        assert max(w / h, h / w) <= 3.0
    assert aspect_buckets.assign_bucket((3000, 2000), buckets)[0] > aspect_buckets.assign_bucket((3000, 2000), buckets)[1]
    assert aspect_buckets.assign_bucket((500, 500), buckets) == (1024, 1024)


def test_variant_plan_is_seeded_and_covers_the_bucket():
    a = aspect_buckets.plan_variants("abc", (300, 200), (96, 64), 4, seed=0, random_flip=True, crop="random", zoom=0.2)
    assert a == aspect_buckets.plan_variants("abc", (300, 200), (96, 64), 4, seed=0, random_flip=True, crop="random", zoom=0.2)
    assert a != aspect_buckets.plan_variants("abc", (300, 200), (96, 64), 4, seed=1, random_flip=True, crop="random", zoom=0.2)
    assert [v.flip for v in a] == [False, True, False, True]
    assert a[0].resized == (96, 64) and len({(v.resized, v.crop_left, v.crop_top) for v in a}) == 4
    no_zoom = aspect_buckets.plan_variants("abc", (300, 200), (96, 64), 4, seed=0, random_flip=False, crop="random")
    assert len(set(no_zoom)) == 1, "same aspect as the bucket and no zoom: nothing to vary"
    for v in a:
        assert v.resized[0] >= 96 and v.resized[1] >= 64
        assert 0 <= v.crop_left <= v.resized[0] - 96 and 0 <= v.crop_top <= v.resized[1] - 64


def test_scan_folder_and_metadata(tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("a red square\n")
    Image.new("RGB", (8, 8), "blue").save(tmp_path / "b.png")
    with pytest.raises(dataset.DatasetError, match=r"b\.png' has no caption file 'b\.txt'"):
        dataset.scan(tmp_path)
    (tmp_path / "b.txt").write_text("a blue square")
    items = dataset.scan(tmp_path)
    assert [it.key for it in items] == ["a.png", "b.png"] and items[0].caption == "a red square"
    assert items[0].caption_id == dataset.caption_id("a red square")
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "b.png", "text": "blue"}\n')
    assert [(it.key, it.caption) for it in dataset.scan(tmp_path)] == [("b.png", "blue")]


def test_rowstore_bfloat16_roundtrip_matches_torch(tmp_path):
    values = torch.randn(3, 5, dtype=torch.float32) * 100
    store = RowStore.create(tmp_path / "s.zarr", ["x", "y"], {"v": ((3, 5), "bfloat16")})
    store.write_row(1, {"v": values})
    store.write_row(0, {"v": values.to(torch.bfloat16)})
    back = RowStore.open(tmp_path / "s.zarr")
    expected = values.to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(back.read("v", 1), expected)
    np.testing.assert_array_equal(back.read("v", 0), expected)
    assert back.written_mask().tolist() == [True, True] and back.ids == ["x", "y"]


def _write_rows(path: Path, rows: list[int], kill: str = "") -> None:
    """A writer process: journals `rows` (row r holds r), flushing at the end; `kill`: a fault spec."""
    import os

    from stages.core.faults import ENV

    if kill:
        os.environ[ENV] = kill
    store = RowStore.open(path, mode="a")
    for r in rows:
        store.journal_row(r, {"v": np.full((2, 3), r), "n": [r]})
    store.flush()


def test_rowstore_packs_rows_into_shards_and_writers_of_one_shard_lose_none(tmp_path):
    """Three processes write interleaved rows of the same shards at once: every row arrives (packing
    a shard is a locked read-modify-write), and each array holds one file per shard."""
    import multiprocessing as mp

    path = tmp_path / "s.zarr"
    store = RowStore.create(path, [f"i{k}" for k in range(30)], {"v": ((2, 3), "float16"), "n": ((1,), "int64")},
                            rows_per_shard=8)
    ctx = mp.get_context("fork")
    writers = [ctx.Process(target=_write_rows, args=(path, list(range(k, 30, 3)))) for k in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
        assert w.exitcode == 0
    back = RowStore.open(path)
    assert back.intact_mask().all() and [int(back.read_row(r)["n"][0]) for r in range(30)] == list(range(30))
    for name in ("v", "n", "checksums", "written"):
        assert len([p for p in (path / name).rglob("*") if p.is_file() and p.name != "zarr.json"]) == 4  # 30 rows / 8
    assert [p.name for p in (path / "journal").iterdir()] == ["pack.lock"]  # journals deleted once packed
    store.append_rows(["late"])  # a new row goes to the last shard
    _write_rows(path, [30])
    assert RowStore.open(path).intact_mask().sum() == 31


def test_rowstore_journal_of_a_killed_writer_is_packed_and_its_torn_record_dropped(tmp_path):
    import multiprocessing as mp
    import signal

    path = tmp_path / "s.zarr"
    RowStore.create(path, [f"i{k}" for k in range(6)], {"v": ((2, 3), "float16"), "n": ((1,), "int64")},
                    rows_per_shard=4)
    child = mp.get_context("fork").Process(target=_write_rows, args=(path, [0, 1, 2], "mid-row:3"))
    child.start()
    child.join()
    assert child.exitcode == -signal.SIGKILL
    store = RowStore.open(path, mode="a")
    assert not store.written_mask().any() and len(list((path / "journal").glob("*.log"))) == 1
    assert store.recover() == 2  # rows 0 and 1; row 2's record is torn
    assert store.intact_mask().tolist() == [True, True, False, False, False, False]
    assert not list((path / "journal").glob("*.log")) and int(store.read_row(1)["n"][0]) == 1


def test_text_encoder_guards_name_the_value_the_limit_and_the_model(tmp_path):
    """The Qwen text encoders' caption-length guard and the FLUX.2 ones' layer-count guard (one helper
    each, shared by the families) refuse before any weight loads."""
    from stages.core.config import CaptionsConfig
    from stages.core.errors import ConfigError, ModelError
    from stages.core.model_source import ModelSource
    from stages.core.runtime import make_runtime
    from stages.families import get_family
    from stages.families.common.flux2_dit import require_text_layers
    from stages.families.text_encoders import require_max_length

    require_max_length(CaptionsConfig(max_sequence_length=1024), 1024, "Qwen-Image")  # the limit itself is fine
    with pytest.raises(ConfigError, match=r"max_sequence_length = 1025 is above Qwen-Image's 1024; set it to 1024 or less"):
        require_max_length(CaptionsConfig(max_sequence_length=1025), 1024, "Qwen-Image")
    with pytest.raises(ConfigError, match="is above Qwen-Image-Edit-Plus's 1024"):  # through the family, nothing loaded
        get_family("qwen-image-edit").load_text_encoder(ModelSource(str(tmp_path / "none")),
                                                         CaptionsConfig(max_sequence_length=2000), make_runtime("cpu", "fp32"))
    require_text_layers(ModelSource("x"), 27, (9, 18, 27), "FLUX.2 klein")
    with pytest.raises(ModelError, match=r"has 26 layers, but FLUX.2 klein reads hidden states \(9, 18, 27\)"):
        require_text_layers(ModelSource("x"), 26, (9, 18, 27), "FLUX.2 klein")
