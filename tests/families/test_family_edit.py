"""Edit families (flux-kontext, qwen-image-edit): control images through the dataset scan, the
caches, the loss and the pipelines' own code, on the tiny real architectures.

The generic per-family tests (tests/families/test_family.py: cached = uncached, batched = single, export
round trip through `load_lora_weights`, ids not positions, it learns) run for these families too,
on the edit pairs (conftest `family_data`). Here: what only edit pairs have.
"""

from __future__ import annotations

import json
import shutil

import diffusers
import pytest
import torch

from stages import cache_latents, encode_captions
from stages.core import aspect_buckets, dataset, image_io
from stages.core.errors import DatasetError
from stages.core.events import EventLog
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family, pipeline_class
from stages.train.trainer import Trainer
from conftest import make_cfg

KONTEXT = pytest.mark.parametrize("built_run", ["flux-kontext"], indirect=True)


def _png(path, colour=(200, 30, 30), size=(24, 16)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


# ---- dataset layouts (no torch, no model) ------------------------------------------------------


def test_folder_layouts_find_controls_and_never_train_them(tmp_path):
    _png(tmp_path / "a.png"), _png(tmp_path / "a_control.png")
    _png(tmp_path / "b.png"), _png(tmp_path / "b_control_1.png"), _png(tmp_path / "b_control_2.jpg")
    _png(tmp_path / "sub" / "c.png"), _png(tmp_path / "control" / "sub" / "c.png")
    _png(tmp_path / "d.png")  # a plain text-to-image item beside them
    for stem in ("a", "b", "sub/c", "d"):
        (tmp_path / f"{stem}.txt").write_text(f"edit {stem}")
    items = {it.key: it for it in dataset.scan(tmp_path)}
    assert sorted(items) == ["a.png", "b.png", "d.png", "sub/c.png"], "a control file was taken as a target"
    assert [p.name for p in items["a.png"].controls] == ["a_control.png"]
    assert [p.name for p in items["b.png"].controls] == ["b_control_1.png", "b_control_2.jpg"]
    assert items["sub/c.png"].controls == (tmp_path / "control" / "sub" / "c.png",)
    assert items["d.png"].controls == ()
    assert items["a.png"].control_ids == (dataset.content_id((tmp_path / "a_control.png").read_bytes()),)


def test_metadata_control_image_string_or_list_and_bad_paths(tmp_path):
    _png(tmp_path / "t1.png"), _png(tmp_path / "t2.png"), _png(tmp_path / "c1.png"), _png(tmp_path / "c2.png")
    rows = [{"file_name": "t1.png", "text": "one", "control_image": "c1.png"},
            {"file_name": "t2.png", "text": "two", "control_image": ["c1.png", "c2.png"]}]
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    items = {it.key: it for it in dataset.scan(tmp_path)}
    assert [p.name for p in items["t1.png"].controls] == ["c1.png"]
    assert [p.name for p in items["t2.png"].controls] == ["c1.png", "c2.png"]
    rows[1]["control_image"] = ["missing.png"]
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DatasetError, match=r"metadata.jsonl:2: control image '.*missing.png' of 't2.png' does not exist"):
        dataset.scan(tmp_path)
    rows[1]["control_image"] = ["../outside.png"]
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DatasetError, match="not inside the dataset folder"):
        dataset.scan(tmp_path)


def test_edit_family_refuses_items_without_controls_and_t2i_family_ignores_them(tmp_path, edit_data):
    kontext, flux = get_family("flux-kontext"), get_family("flux")
    _png(tmp_path / "x.png"), (tmp_path / "x.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"flux-kontext trains on edit pairs with 1\.\.1 control images.*'x.png' \(0\)"):
        dataset.for_family(dataset.scan(tmp_path), kontext)
    items = dataset.scan(edit_data)
    warned = []
    assert dataset.for_family(items, flux, lambda m, i: warned.append(m)) == items  # ids untouched
    assert len(warned) == 1 and "text-to-image family" in warned[0] and "ignored" in warned[0]
    keyed = dataset.for_family(items, kontext)
    assert all(k.image_id != it.image_id and k.caption_id == it.caption_id for k, it in zip(keyed, items))


def test_ids_of_a_family_whose_text_sees_controls_and_mixed_control_counts(tmp_path):
    """A family whose text encoder reads the controls keys caption rows by (caption, controls): the
    same caption with another control is another row. Items must all have the same control count."""
    from types import SimpleNamespace

    for stem, colour in (("a", (200, 0, 0)), ("b", (0, 200, 0))):
        _png(tmp_path / f"{stem}.png"), _png(tmp_path / f"{stem}_control.png", colour)
        (tmp_path / f"{stem}.txt").write_text("the same instruction")
    sees = SimpleNamespace(name="reads-controls", control_range=(1, 3), text_sees_controls=True)
    a, b = dataset.for_family(dataset.scan(tmp_path), sees)
    assert a.caption_id != b.caption_id and a.image_id != b.image_id
    _png(tmp_path / "b_control_1.png"), _png(tmp_path / "b_control_2.png")
    (tmp_path / "b_control.png").unlink()
    with pytest.raises(DatasetError, match=r"same number of control images.*\{1: 1, 2: 1\}"):
        dataset.for_family(dataset.scan(tmp_path), sees)


# ---- FLUX.1 Kontext against FluxKontextPipeline's own code -------------------------------------


def _one(built_run, index=0, variant=0, model=False):
    trainer = Trainer(built_run, EventLog(built_run.run_dir, built_run.run, "test", enabled=False))
    if model:
        trainer.setup_model()
    pair = trainer.data.pairs[index]
    item = next(it for it in cache_latents.scan_items(built_run) if it.key == pair.key)
    return trainer, pair, item, trainer.data.load([index], [variant])


@KONTEXT
def test_kontext_caption_row_is_the_pipelines_encode_prompt(built_run):
    _, _, item, batch = _one(built_run)
    pipe = diffusers.FluxKontextPipeline.from_pretrained(built_run.model)
    embeds, pooled, text_ids = pipe.encode_prompt(prompt=item.caption, prompt_2=None,
                                                  max_sequence_length=built_run.captions.max_sequence_length)
    torch.testing.assert_close(batch.cond["prompt_embeds"], embeds, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batch.cond["pooled"], pooled, rtol=1e-5, atol=1e-6)
    assert not text_ids.any()


def _control_on_the_fly(cfg, family, vae, item, bucket, k):
    """Variant k of the item's control, encoded now as cache-latents planned it."""
    size = image_io.image_size(item.image_path)
    variants = aspect_buckets.plan_variants(item.image_id, size, tuple(bucket), cfg.data.cache_variants, cfg.seed,
                                     cfg.data.random_flip, cfg.data.crop, cfg.data.crop_zoom)
    controls = [image_io.load_image(c, cfg.data.background) for c in item.controls]
    pixels = [cache_latents._to_pixels(family.control_images(c, size, [variants[k]], tuple(bucket))) for c in controls]
    with torch.no_grad():
        return pixels, [family.encode_posterior(vae, p) for p in pixels]


@KONTEXT
def test_kontext_control_latents_ids_and_loss_match_the_pipeline(built_run):
    """Cached control = control encoded now; the pipeline's prepare_latents packs it and ids it as
    the family does; and the loss equals one written with the pipeline's own helpers."""
    cfg = built_run
    trainer, pair, item, batch = _one(cfg, index=1, variant=1, model=True)  # variant 1 is flipped
    family = trainer.family
    pipe = diffusers.FluxKontextPipeline.from_pretrained(cfg.model)
    (pixels,), ((mean, _),) = _control_on_the_fly(cfg, family, pipe.vae, item, pair.bucket, 1)
    torch.testing.assert_close(batch.controls[0][0], mean, rtol=1e-4, atol=3e-4)

    h, w = batch.mean.shape[-2:]
    bw, bh = pair.bucket[:2]
    _, image_latents, latent_ids, image_ids = pipe.prepare_latents(pixels, 1, 16, bh, bw, torch.float32, torch.device("cpu"), None)
    control = family.normalize_latents(batch.controls[0][0], trainer.norm)
    torch.testing.assert_close(image_latents, pipe._pack_latents(control, 1, 16, h, w), rtol=1e-3, atol=2e-3)
    assert torch.equal(image_ids, family.control_ids(h, w, torch.device("cpu"), torch.float32))
    assert torch.equal(latent_ids, family.image_ids(h, w, torch.device("cpu"), torch.float32))

    g = torch.Generator().manual_seed(0)
    x0 = family.normalize_latents(batch.mean, trainer.norm)
    noise, t = torch.randn(x0.shape, generator=g), torch.tensor([0.7])
    with torch.no_grad():
        ours = trainer.compute_loss(batch, torch.zeros_like(batch.mean), noise, t)  # eps 0: x0 = the mean
        x_t = (1 - t) * x0 + t * noise
        latents = pipe._pack_latents(x_t, 1, 16, h, w)
        pred = pipe.transformer(
            hidden_states=torch.cat([latents, pipe._pack_latents(control, 1, 16, h, w)], dim=1),
            timestep=t, guidance=torch.full([1], cfg.train.guidance_scale), pooled_projections=batch.cond["pooled"],
            encoder_hidden_states=batch.cond["prompt_embeds"], txt_ids=torch.zeros(batch.cond["prompt_embeds"].shape[1], 3),
            img_ids=torch.cat([latent_ids, image_ids]), return_dict=False)[0][:, : latents.size(1)]
        theirs = ((pipe._unpack_latents(pred, bh, bw, pipe.vae_scale_factor) - (noise - x0)) ** 2).mean()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@KONTEXT
def test_kontext_loss_is_on_target_tokens_and_sees_the_control(built_run):
    trainer, _, _, batch = _one(built_run, model=True)
    g = torch.Generator().manual_seed(1)
    noise, t = torch.randn(batch.mean.shape, generator=g), torch.tensor([0.5])
    eps = torch.zeros_like(batch.mean)
    with torch.no_grad():
        with_control = trainer.compute_loss(batch, eps, noise, t)
        batch.controls = ((batch.controls[0][0] + 1.0, batch.controls[0][1]),)
        other_control = trainer.compute_loss(batch, eps, noise, t)
    assert with_control.shape == () and abs(float(with_control - other_control)) > 1e-6


def test_changed_or_swapped_controls_reencode_exactly_their_rows(assets, edit_data, tmp_path):
    data = shutil.copytree(edit_data, tmp_path / "data")
    cfg = make_cfg("flux-kontext", assets, data, tmp_path / "runs", **{"data.cache_variants": 2})
    encode_captions.run(cfg)
    assert cache_latents.run(cfg)["encoded_this_run"] == 12
    # another control for one item (a drawn one: a flat colour makes the random VAE round unstably)
    (data / "shape_004_control.png").write_bytes((data / "shape_001_control.png").read_bytes())
    assert cache_latents.run(cfg)["encoded_this_run"] == 1
    assert encode_captions.run(cfg)["encoded_this_run"] == 0  # Kontext's text never sees the control
    a, b = data / "shape_000_control.png", data / "shape_003_control.png"  # same size, swapped
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes()), b.write_bytes(a_bytes)
    assert cache_latents.run(cfg)["encoded_this_run"] == 2
    family = get_family(cfg.family)
    vae = family.load_vae(ModelSource(cfg.model), make_runtime("cpu", "fp32"))
    trainer = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
    items = {it.key: it for it in cache_latents.scan_items(cfg)}
    for index, pair in enumerate(trainer.data.pairs):
        if pair.key in ("shape_000.png", "shape_003.png", "shape_004.png", "shape_001.png"):
            _, ((mean, _),) = _control_on_the_fly(cfg, family, vae, items[pair.key], pair.bucket, 1)
            torch.testing.assert_close(trainer.data.load([index], [1]).controls[0][0], mean, rtol=1e-4, atol=3e-4)


def test_bad_control_image_is_named(assets, edit_data, tmp_path):
    data = shutil.copytree(edit_data, tmp_path / "data")
    (data / "shape_002_control.png").write_bytes(b"\x89PNG not really")
    cfg = make_cfg("flux-kontext", assets, data, tmp_path / "runs")
    with pytest.raises(image_io.BadImage, match=r"shape_002_control.png' starts like a PNG but is corrupt"):
        cache_latents.run(cfg)


# ---- Qwen-Image-Edit-Plus against QwenImageEditPlusPipeline's own code -------------------------

QWEN_EDIT = pytest.mark.parametrize("built_run", ["qwen-image-edit"], indirect=True)


@QWEN_EDIT
def test_qwen_edit_caption_row_is_the_pipelines_encode_prompt_with_its_controls(built_run):
    """The row is the VL encoder's output over instruction + control images, as the pipeline
    conditions on them (its own resize to CONDITION_IMAGE_SIZE, its processor, drop 64)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

    _, _, item, batch = _one(built_run)
    pipe = pipeline_class(get_family(built_run.family)).from_pretrained(built_run.model)
    condition = []
    for path in item.controls:
        image = image_io.load_image(path)
        w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
        condition.append(pipe.image_processor.resize(image, h, w))
    embeds, mask = pipe.encode_prompt(prompt=item.caption, image=condition, device=torch.device("cpu"))
    assert mask is None  # one prompt: all valid
    n = int(batch.cond["prompt_length"][0])
    assert n == embeds.shape[1] < built_run.captions.max_sequence_length
    torch.testing.assert_close(batch.cond["prompt_embeds"][:, :n], embeds, rtol=1e-5, atol=1e-5)


@QWEN_EDIT
def test_qwen_edit_control_latents_and_loss_match_the_pipeline(built_run, monkeypatch):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    from stages.families.common import qwen_image_edit as edit_module
    from stages.families.text_encoders import trim_to_longest

    cfg = built_run
    trainer, pair, item, batch = _one(cfg, index=2, variant=0, model=True)
    family, pipe = trainer.family, pipeline_class(trainer.family).from_pretrained(cfg.model)
    bw, bh = pair.bucket[:2]
    image = image_io.load_image(item.controls[0])
    vw, vh = calculate_dimensions(bw * bh, image.width / image.height)  # the pipeline's rule at this area
    vae_image = pipe.image_processor.preprocess(image, vh, vw).unsqueeze(2)
    _, image_latents = pipe.prepare_latents([vae_image], 1, 16, bh, bw, torch.float32, torch.device("cpu"), None)
    control = family.normalize_latents(batch.controls[0][0], trainer.norm)
    ch, cw = control.shape[-2:]
    assert (ch, cw) == (vh // pipe.vae_scale_factor, vw // pipe.vae_scale_factor)
    torch.testing.assert_close(image_latents, pipe._pack_latents(control, 1, 16, ch, cw), rtol=1e-3, atol=2e-3)

    g = torch.Generator().manual_seed(0)
    x0 = family.normalize_latents(batch.mean, trainer.norm)
    h, w = x0.shape[-2:]
    noise, t = torch.randn(x0.shape, generator=g), torch.tensor([0.6])
    with torch.no_grad():
        ours = trainer.compute_loss(batch, torch.zeros_like(batch.mean), noise, t)
        latents = pipe._pack_latents((1 - t) * x0 + t * noise, 1, 16, h, w)
        n = int(batch.cond["prompt_length"][0])
        pred = pipe.transformer(
            hidden_states=torch.cat([latents, pipe._pack_latents(control, 1, 16, ch, cw)], dim=1), timestep=t,
            guidance=None, encoder_hidden_states_mask=None, encoder_hidden_states=batch.cond["prompt_embeds"][:, :n],
            img_shapes=[[(1, h // 2, w // 2), (1, ch // 2, cw // 2)]], return_dict=False)[0][:, : latents.size(1)]
        theirs = ((pipe._unpack_latents(pred, bh, bw, pipe.vae_scale_factor)[:, :, 0] - (noise - x0)) ** 2).mean()
        # the caption rounded up to the stored length (runtime.caption_tokens_multiple), its padding masked
        stored = batch.cond["prompt_embeds"].shape[1]
        assert n < stored
        trainer.cfg.runtime.caption_tokens_multiple = stored
        seen = []
        monkeypatch.setattr(edit_module, "trim_to_longest", lambda *a: seen.append(trim_to_longest(*a)) or seen[-1])
        rounded = trainer.compute_loss(batch, torch.zeros_like(batch.mean), noise, t)
        assert [text.shape[1] for text, _ in seen] == [stored], "the trainer hands the setting to the loss"
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rounded, theirs, rtol=1e-5, atol=1e-6)


def test_qwen_edit_changed_control_reencodes_its_caption_row(assets, edit_data, tmp_path):
    """The VL encoder sees the controls: a changed control re-encodes its caption row, only that one."""
    data = shutil.copytree(edit_data, tmp_path / "data")
    cfg = make_cfg("qwen-image-edit", assets, data, tmp_path / "runs")
    assert encode_captions.run(cfg)["encoded_this_run"] == 12
    (data / "shape_004_control.png").write_bytes((data / "shape_001_control.png").read_bytes())
    assert encode_captions.run(cfg)["encoded_this_run"] == 1



@QWEN_EDIT
def test_qwen_edit_encode_plan_counts_each_controls_vision_tokens(built_run, tmp_path):
    """The text encoder reads each control's vision tokens with the caption, one caption at a time: each control,
    whatever its aspect, adds at most family.text_tokens_per_control tokens to what it reads (196 vision tokens for a
    square one, and its label),
    which encode-captions' plan counts for the most controls an item of the run's data has (the demo's edit pairs:
    one), and the batch size does not change the plan's working memory."""
    from PIL import Image

    from stages.core import memory
    from stages.core.memory import captions as plan_captions

    family = get_family(built_run.family)
    encoder = family.load_text_encoder(ModelSource(built_run.model), built_run.captions, make_runtime("cpu", "fp32"))
    counts = []
    for sizes in ([(1024, 512)], [(1024, 512), (512, 512)], [(1024, 512), (512, 512), (300, 900)]):
        images = [Image.new("RGB", s, (40 * i, 90, 160)) for i, s in enumerate(sizes)]
        with torch.no_grad():
            encoder.encode(["a red circle"], controls=[images])
        counts.append(encoder.token_counts(["a red circle"])[0])
    added = [b - a for a, b in zip(counts, counts[1:])]
    assert all(family.text_tokens_per_control * 0.9 <= n <= family.text_tokens_per_control for n in added), (added, counts)
    assert 196 < added[0] < 196 + 16, (added, counts)  # the square control: 28 x 28 patches of 14 px merged 2 x 2, and its label
    tokens = plan_captions.encode_tokens(built_run, family)
    assert memory.stage_plan.planned_controls(built_run, family) == 1
    assert tokens >= built_run.captions.max_sequence_length + family.text_tokens_per_control
    plan = memory.PLANNERS["encode-captions"].plan(built_run, family, ModelSource(built_run.model), memory.Budget(1e6, "cap"))
    assert len({round(t["predicted_peak_gb"], 9) for t in plan.tried if t["text_encoder_precision"] == "bf16"}) == 1
