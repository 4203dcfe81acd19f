"""FLUX.2 reference images (flux2-klein, flux2): an item's control images as the pipelines' `image=`
references, checked against Flux2KleinPipeline's / Flux2Pipeline's own helpers on the tiny models.

One run of all four stages per family on edit pairs (square items first, so the sample pipeline's
64 px minimum side holds at a 64 px sample); text-to-image runs of these families are tested in
tests/families/test_family.py and stay as they were (items without references keep their ids and draws).
"""

from __future__ import annotations

import dataclasses
import shutil

import diffusers
import numpy as np
import pytest
import torch

from stages import cache_latents, encode_captions, export_lora, sample, train
from stages.core import aspect_buckets, dataset, image_io, lora
from stages.core.config import SampleConfig
from stages.core.errors import DatasetError
from stages.core.events import EventLog
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family, pipeline_class
from stages.train.trainer import Trainer
from conftest import make_cfg, trained_denoiser
from stages.core.caches import export_dir

FAMILIES = ["flux2-klein", "flux2"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ref_data(assets):
    from stages.tiny.shapes import make_edit_dataset

    return make_edit_dataset(assets / "data-flux2-refs", n=8, seed=3, sizes=((64, 64), (80, 80), (64, 64), (96, 64)))


_RUNS: dict[str, object] = {}


@pytest.fixture
def ref_run(request, assets, ref_data, tmp_path_factory):
    family = request.param
    if family not in _RUNS:
        cfg = make_cfg(family, assets, ref_data, tmp_path_factory.mktemp(f"refs-{family}"),
                       **{"train.steps": 4, "data.cache_variants": 2})
        for module in (encode_captions, cache_latents, train, export_lora):
            module.run(cfg)
        _RUNS[family] = cfg
    return _RUNS[family]


BOTH = pytest.mark.parametrize("ref_run", FAMILIES, indirect=True)
KLEIN = pytest.mark.parametrize("ref_run", ["flux2-klein"], indirect=True)


def _pipe(cfg):
    pipe = pipeline_class(get_family(cfg.family)).from_pretrained(cfg.model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _batch(cfg, key, variant, model=False):
    trainer = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
    if model:
        trainer.setup_model()
    index = next(i for i, p in enumerate(trainer.data.pairs) if p.key == key)
    item = next(it for it in cache_latents.scan_items(cfg) if it.key == key)
    return trainer, trainer.data.pairs[index], item, trainer.data.load([index], [variant])


def _pipeline_reference(pipe, path, area):
    """The pipeline's step 4 for one reference, with the bucket's area for its 1024 x 1024."""
    img = image_io.load_image(path)
    img = pipe.image_processor._resize_to_target_area(img, area)
    m = pipe.vae_scale_factor * 2
    w, h = img.width // m * m, img.height // m * m
    return pipe.image_processor.preprocess(img, height=h, width=w, resize_mode="crop")


# ---- without a model ---------------------------------------------------------------------------


def test_references_are_optional_but_all_or_none(tmp_path, ref_data):
    from PIL import Image

    family = get_family("flux2-klein")
    for stem in ("a", "b"):
        Image.new("RGB", (32, 32), "red").save(tmp_path / f"{stem}.png")
        (tmp_path / f"{stem}.txt").write_text(stem)
    plain = dataset.scan(tmp_path)
    assert dataset.for_family(plain, family) == plain  # text-to-image: the same ids, so the same rows and draws
    Image.new("RGB", (32, 32), "blue").save(tmp_path / "a_control.png")
    with pytest.raises(DatasetError, match=r"every item needs the same number of control images.*\{0: 1, 1: 1\}"):
        dataset.for_family(dataset.scan(tmp_path), family)
    items = dataset.scan(ref_data)
    keyed = dataset.for_family(items, family)  # with references: the latent id covers them, the caption's not
    assert all(k.image_id != it.image_id and k.caption_id == it.caption_id for k, it in zip(keyed, items))


def test_reference_ids_are_the_pipelines_prepare_image_ids():
    pipe_cls = diffusers.Flux2KleinPipeline
    latents = [torch.zeros(1, 8, 3, 4), torch.zeros(1, 8, 2, 5), torch.zeros(1, 8, 1, 1)]
    for family in FAMILIES:
        ours = get_family(family).reference_ids([(3, 4), (2, 5), (1, 1)], CPU)
        assert torch.equal(ours, pipe_cls._prepare_image_ids(latents)[0])
        assert torch.equal(ours, diffusers.Flux2Pipeline._prepare_image_ids(latents)[0])


def test_memory_plan_counts_the_runs_references(assets, ref_data, demo_data, tmp_path, monkeypatch):
    """Optional references: the planned sequence has as many as the run's items carry (none for a
    text-to-image run, so its plan is as before); so does an edit family that takes 1 to 3 inputs (Qwen-Image-Edit:
    an item of two inputs plans two, not its most; planning three had Qwen-Image-Edit-2511's train at 16 GB
    predict 1.5x what one input held). The count comes from file names: no image is read or hashed (a spy on the
    id hashing sees no call)."""
    from stages.core import image_index, memory

    klein = get_family("flux2-klein")
    hashed: list[object] = []
    real_ids = image_index.read_ids
    monkeypatch.setattr(image_index, "read_ids", lambda *a: hashed.append(a) or real_ids(*a))
    assert memory.stage_plan.planned_controls(make_cfg("flux2-klein", assets, ref_data, tmp_path), klein) == 1
    assert memory.stage_plan.planned_controls(make_cfg("flux2-klein", assets, demo_data, tmp_path), klein) == 0
    assert hashed == []
    assert memory.stage_plan.planned_controls(None, get_family("flux-kontext")) == 1
    assert memory.stage_plan.planned_controls(None, get_family("flux")) == 0
    meta = tmp_path / "meta"  # metadata.jsonl's control_image lists count the same way
    meta.mkdir()
    for name in ("t1.png", "t2.png", "c1.png", "c2.png"):
        shutil.copy(next(ref_data.glob("*.png")), meta / name)
    (meta / "metadata.jsonl").write_text('{"file_name": "t1.png", "text": "a", "control_image": "c1.png"}\n'
                                         '{"file_name": "t2.png", "text": "b", "control_image": ["c1.png", "c2.png"]}\n')
    assert memory.stage_plan.planned_controls(make_cfg("flux2-klein", assets, meta, tmp_path / "m"), klein) == 2
    edit = get_family("qwen-image-edit")
    assert memory.stage_plan.planned_controls(make_cfg("qwen-image-edit", assets, meta, tmp_path / "e"), edit) == 2
    assert memory.stage_plan.planned_controls(make_cfg("qwen-image-edit", assets, ref_data, tmp_path / "r"), edit) == 1
    # no data folder yet (`lorapipe plan` before the images are in place): the most it takes, an upper bound
    assert memory.stage_plan.planned_controls(make_cfg("qwen-image-edit", assets, tmp_path / "none", tmp_path / "n"), edit) == 3
    assert max(len(it.controls) for it in dataset.scan(meta)) == 2 and len(hashed) > 0  # scan hashes; the count did not


# ---- against the pipelines ---------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("key", ["shape_003.png", "shape_001.png"])  # 96 x 64 (aspect kept), 80 x 80
def test_cached_references_are_the_pipelines_prepare_image_latents(ref_run, key):
    """Each cached variant's reference, normalized and packed, is prepare_image_latents of the
    pipeline's own preprocessing at the bucket's area (mirrored for a flipped variant); its ids are
    _prepare_image_ids'."""
    from stages.core import flow

    cfg = ref_run
    pipe, flips = _pipe(cfg), []
    for k in range(cfg.data.cache_variants):
        trainer, pair, item, batch = _batch(cfg, key, k)
        family = trainer.family
        bw, bh = pair.bucket[:2]
        pixels = _pipeline_reference(pipe, item.controls[0], bw * bh)
        size = image_io.image_size(item.image_path)
        flip = aspect_buckets.plan_variants(dataset.pixels_id(item), size, (bw, bh), cfg.data.cache_variants, cfg.seed,
                                     cfg.data.random_flip, cfg.data.crop, cfg.data.crop_zoom)[k].flip
        flips.append(flip)
        with torch.no_grad():
            latents, ids = pipe.prepare_image_latents([pixels.flip(-1) if flip else pixels], 1, None, CPU, torch.float32)
        control = family.normalize_latents(batch.controls[0][0], trainer.norm)
        h, w = control.shape[-2:]
        assert (h, w) == (pixels.shape[-2] // pipe.vae_scale_factor, pixels.shape[-1] // pipe.vae_scale_factor)
        torch.testing.assert_close(flow.pack_2x2(control), latents, rtol=1e-3, atol=3e-3)
        assert torch.equal(family.reference_ids([(h // 2, w // 2)], CPU), ids[0])
    assert len(set(flips)) == 2, "the variants should include a flipped one and an unflipped one"


@BOTH
def test_loss_equals_the_pipelines_helpers_on_the_target_tokens(ref_run):
    cfg = ref_run
    trainer, pair, _, batch = _batch(cfg, "shape_003.png", 0, model=True)
    family, pipe = trainer.family, _pipe(cfg)
    x0 = family.normalize_latents(batch.mean, trainer.norm)
    control = pipe._patchify_latents(family.normalize_latents(batch.controls[0][0], trainer.norm))
    noise, t = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0)), torch.tensor([0.65])
    text = batch.cond["prompt_embeds"]
    with torch.no_grad():
        ours = trainer.compute_loss(batch, torch.zeros_like(batch.mean), noise, t)  # eps 0: x0 = the mean
        x_t = pipe._patchify_latents((1 - t) * x0 + t * noise)
        latents, latent_ids = pipe._pack_latents(x_t), pipe._prepare_latent_ids(x_t)
        guidance = torch.full([1], cfg.train.guidance_scale) if pipe.transformer.config.guidance_embeds else None
        pred = pipe.transformer(
            hidden_states=torch.cat([latents, pipe._pack_latents(control)], dim=1), timestep=t, guidance=guidance,
            encoder_hidden_states=text, txt_ids=pipe._prepare_text_ids(text),
            img_ids=torch.cat([latent_ids, pipe._prepare_image_ids([control])], dim=1),
            return_dict=False)[0][:, : latents.size(1)]
        pred = pipe._unpatchify_latents(pipe._unpack_latents_with_ids(pred, latent_ids))
        theirs = ((pred - (noise - x0)) ** 2).mean()
        # and the reference matters: another one gives another loss
        batch.controls = ((batch.controls[0][0].flip(-1), batch.controls[0][1]),)
        other = trainer.compute_loss(batch, torch.zeros_like(batch.mean), noise, t)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert abs(float(ours - other)) > 1e-6


@KLEIN
def test_export_round_trip_with_references(ref_run):
    """The exported file loads into the pipeline with exactly the trained keys, and its transformer
    then gives the trained adapter's loss on a batch with references."""
    cfg = ref_run
    trainer, _, _, batch = _batch(cfg, "shape_001.png", 1, model=True)
    family, pipe = trainer.family, _pipe(cfg)
    adapter, adapter_cfg = lora.load_adapter_files(train.artifact_dir(cfg))
    pipe.load_lora_weights(str(export_dir(cfg)), weight_name="pytorch_lora_weights.safetensors")
    in_memory = trained_denoiser(cfg, train.artifact_dir(cfg))
    noise, t = torch.randn(batch.mean.shape, generator=torch.Generator().manual_seed(2)), torch.tensor([0.4])
    eps = torch.zeros_like(batch.mean)
    with torch.no_grad():  # the trainer's loss (references included) through either denoiser
        loaded = trainer._per_sample_loss(pipe.transformer, batch, eps, noise, t)
        expected = trainer._per_sample_loss(in_memory, batch, eps, noise, t)
        base = trainer._per_sample_loss(family.load_denoiser(ModelSource(cfg.model), "fp32", make_runtime("cpu", "fp32"),
                                                              cfg.train), batch, eps, noise, t)
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-6)
    assert (loaded - base).abs().max() > 1e-6, "the LoRA changed nothing: the test cannot tell files apart"
    assert len(adapter) > 0


def test_changed_reference_reencodes_exactly_its_item(assets, ref_data, tmp_path):
    data = shutil.copytree(ref_data, tmp_path / "data")
    cfg = make_cfg("flux2-klein", assets, data, tmp_path / "runs", **{"data.cache_variants": 1})
    encode_captions.run(cfg)
    assert cache_latents.run(cfg)["encoded_this_run"] == 8
    (data / "shape_002_control.png").write_bytes((data / "shape_000_control.png").read_bytes())  # both 64 x 64
    assert cache_latents.run(cfg)["encoded_this_run"] == 1
    assert encode_captions.run(cfg)["encoded_this_run"] == 0  # the text encoder never sees references
    trainer, pair, item, batch = _batch(cfg, "shape_002.png", 0)
    family = trainer.family
    vae = family.load_vae(ModelSource(cfg.model), make_runtime("cpu", "fp32"))
    size = image_io.image_size(item.image_path)
    variants = aspect_buckets.plan_variants(dataset.pixels_id(item), size, tuple(pair.bucket), 1, cfg.seed, cfg.data.random_flip,
                                     cfg.data.crop, cfg.data.crop_zoom)
    images = family.control_images(image_io.load_image(data / "shape_000_control.png"), size, variants, tuple(pair.bucket))
    with torch.no_grad():
        mean, _ = family.encode_posterior(vae, cache_latents._to_pixels(images))
    torch.testing.assert_close(batch.controls[0][0], mean, rtol=1e-4, atol=3e-4)


@KLEIN
def test_sample_grid_passes_the_references(ref_run, tmp_path):
    """The grid's base cell is the pipeline's image for that prompt with the item's references, not
    the text-only one; the first column shows the reference."""
    from PIL import Image

    shutil.copytree(ref_run.run_dir, tmp_path / ref_run.run, ignore=shutil.ignore_patterns(".*.lock"))
    cfg = dataclasses.replace(ref_run, artifacts=str(tmp_path),
                              sample=SampleConfig(seeds=[0], steps=2, width=64, height=64))
    manifest = sample.run(cfg)
    rows = sample.edit_rows(cfg)
    assert manifest["columns"][:2] == ["control", "base"] and len(rows) == 3
    family, pipe = get_family(cfg.family), _pipe(cfg)
    prompt, controls = rows[0]
    kwargs = dict(prompt=prompt, height=64, width=64, num_inference_steps=2, output_type="pil")
    refs = family.sample_image_kwargs([image_io.load_image(c) for c in controls], (64, 64))
    with torch.no_grad():
        direct = pipe(generator=torch.Generator("cpu").manual_seed(0), **kwargs, **refs).images[0]
        text_only = pipe(generator=torch.Generator("cpu").manual_seed(0), **kwargs).images[0]
    grid = Image.open(cfg.run_dir / "samples" / sample.GRID)
    scale = -(-sample.MIN_CELL // 64)
    cell = 64 * scale
    base = np.asarray(grid.crop((200 + cell + 4, 28, 200 + 2 * cell + 4, 28 + cell)))[::scale, ::scale]
    assert np.array_equal(base, np.asarray(direct.convert("RGB")))
    assert not np.array_equal(base, np.asarray(text_only.convert("RGB")))


@KLEIN
def test_a_guidance_scale_klein_ignores_is_said_once(ref_run, tmp_path):
    """klein's step-distilled pipeline ignores guidance and logs so for every image handed a scale above
    1, its own default 4.0 included. The stage hands it 1.0 (the same image:
    test_sample_grid_passes_the_references compares the grid with the pipeline at its default), and a
    `sample.guidance_scale` set above 1 is said once, by the stage, in a run with references
    (tests/stages/test_sample_quiet.py checks every family's base column for library notices)."""
    import json

    from conftest import library_lines

    said = {}
    with library_lines() as seen:
        for scale in (-1.0, 4.0):
            root = tmp_path / f"g{scale:g}"
            shutil.copytree(ref_run.run_dir, root / ref_run.run, ignore=shutil.ignore_patterns(".*.lock", "events.jsonl"))
            cfg = dataclasses.replace(ref_run, artifacts=str(root), sample=SampleConfig(
                seeds=[0, 1], steps=2, width=64, height=64, guidance_scale=scale))
            sample.run(cfg)
            said[scale] = [e["message"] for e in map(json.loads, (cfg.run_dir / "events.jsonl").read_text().splitlines())
                           if e["event"] == "warning"]
    assert seen == []
    note = ("sample.guidance_scale = 4 is ignored: Flux2KleinPipeline is step-distilled (is_distilled in "
            "model_index.json) and samples without guidance")
    assert said == {-1.0: [], 4.0: [note]}


def test_only_a_pipeline_that_drops_guidance_when_distilled_loses_the_scale():
    """Krea 2's Turbo pipeline is `is_distilled` too but still guides (guidance_scale > 0): it keeps the
    user's scale, or its own default; klein's base (not distilled) guides as asked."""
    from types import SimpleNamespace

    def pipe(distilled):  # the flag as the pipelines register it from model_index.json
        return SimpleNamespace(config=SimpleNamespace(is_distilled=distilled))

    klein, krea2 = get_family("flux2-klein"), get_family("krea2")
    assert sample.guidance_kwargs(pipe(True), klein, 4.5) == {"guidance_scale": 1.0}
    assert sample.guidance_kwargs(pipe(True), klein, -1.0) == {"guidance_scale": 1.0}
    assert sample.guidance_kwargs(pipe(False), klein, 4.5) == {"guidance_scale": 4.5}
    assert sample.guidance_kwargs(pipe(True), krea2, 4.5) == {"guidance_scale": 4.5}
    assert sample.guidance_kwargs(pipe(True), krea2, -1.0) == {}
    assert sample.guidance_note(pipe(True), krea2, 4.5) is None


@KLEIN
def test_inspect_checks_the_cached_references(ref_run, tmp_path):
    """`inspect` reads the control (reference) posteriors a bucket stores beside its targets': their
    shapes and NaN/Inf, and their checksums, so a damaged reference row is named like a damaged target."""
    import numpy as np

    from stages import inspect as inspect_stage
    from stages.core.artifacts import read_json
    from stages.core.rowstore import RowStore

    shutil.copytree(ref_run.run_dir, tmp_path / ref_run.run, ignore=shutil.ignore_patterns(".*.lock"))
    cfg = dataclasses.replace(ref_run, artifacts=str(tmp_path))
    latents = cfg.run_dir / "latents.zarr"
    index = read_json(latents / "manifest.json")["index"]
    bucket = max(read_json(latents / "manifest.json")["buckets"], key=lambda b: sum(v["bucket"] == b for v in index.values()))
    store = RowStore.open(latents / bucket, mode="a")
    clean = inspect_stage.inspect_run(cfg.run_dir, cfg)["latents"]["buckets"][bucket]
    assert clean["controls"] == [{"name": "control_0", "shape": list(store.group["control_0_mean"].shape[1:]),
                                  "mean": {"nan": 0, "inf": 0}, "logvar": {"nan": 0, "inf": 0}}]
    assert clean["damaged_rows"] == []

    mean = store.read("control_0_mean", 0).copy()
    mean[0, 0, 0, :3] = np.nan
    store.write_row(0, {"control_0_mean": mean})  # NaN, with its checksum: read, counted
    logvar = store.read("control_0_logvar", 1).copy()
    store.group["control_0_logvar"][1] = logvar + 1.0  # bytes changed behind the checksum: damaged
    rep = inspect_stage.inspect_run(cfg.run_dir, cfg)["latents"]["buckets"][bucket]
    assert rep["controls"][0]["mean"]["nan"] == 3
    assert rep["damaged_rows"] == [store.ids[1]]


@KLEIN
def test_inspect_decodes_a_cached_reference(ref_run, tmp_path):
    """`inspect --decode ITEM --control K` decodes the item's K-th control as cached for that variant:
    the VAE's image of that posterior mean, not the target's; a control the item lacks is named."""
    import numpy as np
    from click.testing import CliRunner
    from PIL import Image

    import pipeline
    from stages import inspect as inspect_stage
    from stages.core.artifacts import atomic_write_json, read_manifest
    from stages.core.rowstore import RowStore

    manifest = read_manifest(ref_run.run_dir / "latents.zarr")
    key = sorted(manifest["items"])[0]
    where = manifest["index"][manifest["items"][key]]
    control, info = inspect_stage.decode(ref_run, key, 1, tmp_path / "control.png", control=0)
    target, _ = inspect_stage.decode(ref_run, key, 1, tmp_path / "target.png")
    cached = RowStore.open(ref_run.run_dir / "latents.zarr" / where["bucket"]).read("control_0_mean", (where["row"], 1))
    assert info["control"] == 0 and info["latent_shape"] == list(cached.shape)
    family, rt = get_family(ref_run.family), make_runtime("cpu", ref_run.latents.vae_precision)
    vae = family.load_vae(ModelSource(ref_run.model), rt)
    with torch.no_grad():
        pixels = vae.decode(torch.from_numpy(cached.astype(np.float32))[None].to(vae.dtype)).sample
    expected = ((pixels[0].float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
    assert np.array_equal(np.asarray(Image.open(control)), expected)
    assert not np.array_equal(np.asarray(Image.open(control)), np.asarray(Image.open(target)))
    with pytest.raises(inspect_stage.InspectError, match=f"item '{key}' has no cached control 1: its controls are 0..0"):
        inspect_stage.decode(ref_run, key, 0, tmp_path / "x.png", control=1)
    shutil.copytree(ref_run.run_dir, tmp_path / ref_run.run, ignore=shutil.ignore_patterns(".*.lock"))
    copy = dataclasses.replace(ref_run, artifacts=str(tmp_path))
    atomic_write_json(copy.run_dir / "config.json", copy.to_dict())  # what `pipeline.py run` leaves
    result = CliRunner().invoke(pipeline.cli, ["inspect", copy.run, "--artifacts", copy.artifacts,
                                               "--decode", key, "--control", "0"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"decoded {key}'s control 0 variant 0 -> ")
