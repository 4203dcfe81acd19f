"""Masked loss and held-out validation loss.

Masks: the mask math, the cached masks, and bad mask files.

The math: an all-white mask is bit-identical to no mask (loss and gradients), a half mask gives
exactly zero gradient from its black half, an all-black sample contributes 0. End to end on the
tiny FLUX model: white masks beside every image train exactly as no masks; a mask is cached with
the crop and flip of each variant; editing one mask re-encodes only its item; a broken or
wrongly sized mask is named like a broken image, before the VAE loads.

Validation: held-out items are cached with the rest and never trained on; the loss is logged every
N steps and at the last, draws nothing from training (same losses and adapter as without it), is
the same after a resume (fixed noise per item), and shows in `report` and `status`.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import make_cfg, once, run_beside
from stages.core.caches import lora_dir

N_ITEMS = 6


# ---- the math ---------------------------------------------------------------------------------


# a 3-step run beside the built one
SHORT = {"train.steps": 3, "train.batch_size": 2, "runtime.checkpoint_every": 1, "runtime.keep_checkpoints": 0}

def _pred_target(shape=(2, 4, 6, 8)):
    g = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=g, requires_grad=True), torch.randn(shape, generator=g)


def test_white_mask_is_bit_identical_to_no_mask():
    from stages.core.flow import per_sample_mse

    pred, target = _pred_target()
    plain = per_sample_mse(pred, target)
    (g_plain,) = torch.autograd.grad(plain.sum(), pred)
    white = per_sample_mse(pred, target, torch.ones(2, 1, 6, 8))
    (g_white,) = torch.autograd.grad(white.sum(), pred)
    assert torch.equal(plain, white) and torch.equal(g_plain, g_white)


def test_half_mask_gives_zero_gradient_from_the_masked_half():
    from stages.core.flow import per_sample_mse

    pred, target = _pred_target()
    mask = torch.zeros(2, 1, 6, 8)
    mask[..., :4] = 1.0  # left half trained, right half ignored
    loss = per_sample_mse(pred, target, mask)
    (grad,) = torch.autograd.grad(loss.sum(), pred)
    assert torch.all(grad[..., 4:] == 0) and torch.all(grad[..., :4] != 0)
    want = ((pred[..., :4] - target[..., :4]) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(loss, want)
    # grey weights: a weighted mean; an all-black sample contributes 0, not NaN
    mask[1] = 0.0
    mask[0, ..., 4:] = 0.5
    loss = per_sample_mse(pred, target, mask)
    err = ((pred - target) ** 2)[0].detach()
    w = mask[0].expand_as(err)
    torch.testing.assert_close(loss[0], (err * w).sum() / w.sum())
    assert loss[1] == 0


def test_mask_broadcasts_over_a_frame_axis():
    """Qwen-Image-style (B, C, T, h, w) predictions take the same (B, 1, h, w) mask."""
    from stages.core.flow import per_sample_mse

    pred, target = _pred_target((2, 4, 1, 6, 8))
    mask = torch.zeros(2, 1, 6, 8)
    mask[..., :4] = 1.0
    torch.testing.assert_close(per_sample_mse(pred, target, mask),
                               ((pred[..., :4] - target[..., :4]) ** 2).flatten(1).mean(1))


def test_sdxl_min_snr_weights_multiply_the_masked_mean():
    """SDXL weights each sample's loss by min-SNR after the (masked) mean: the mask changes what is
    averaged, never the weights."""
    from stages.families.sdxl.family import min_snr_weights

    snr_t = torch.tensor([0.5, 20.0])
    weights = min_snr_weights(snr_t, 5.0, "epsilon")
    torch.testing.assert_close(weights, torch.tensor([1.0, 0.25]))


# ---- end to end on the tiny FLUX model ----------------------------------------------------------


def _dataset(demo_data: Path, folder: Path) -> Path:
    folder.mkdir(parents=True)
    for image in sorted(demo_data.glob("*.png"))[:N_ITEMS]:
        for path in (image, image.with_suffix(".txt")):
            shutil.copy(path, folder / path.name)
    return folder


def _mask(image: Path, fill=255, left_only: bool = False) -> Image.Image:
    w, h = Image.open(image).size
    arr = np.full((h, w), fill, np.uint8)
    if left_only:
        arr[:, w // 2:] = 0
    return Image.fromarray(arr, "L")


def _cfg(assets, data, root, run):
    return make_cfg("flux", assets, data, root, run=run, **{"train.steps": 3, "train.batch_size": 2,
                                                           "runtime.checkpoint_every": 0})


def _train(cfg, restart: bool = False) -> tuple[list[float], dict]:
    from safetensors.torch import load_file

    from stages import cache_latents, encode_captions, train
    from stages.core.events import read_events

    encode_captions.run(cfg)
    cache_latents.run(cfg)
    train.run(cfg, restart=restart)
    events = [e for e in read_events(cfg.run_dir) if e["stage"] == "train"]
    start = max(i for i, e in enumerate(events) if e["event"] == "start")
    losses = [e["loss"] for e in events[start:] if e["event"] == "step"]
    return losses, load_file(str(lora_dir(cfg) / "final" / "adapter_model.safetensors"))


def _cached_masks(cfg) -> dict[str, tuple[np.ndarray, dict]]:
    """item key -> (its cached masks (variants, h, w), its whole row)."""
    from stages import cache_latents

    stores, manifest = cache_latents.load_latents(cfg)
    out = {}
    for key, image_id in manifest["items"].items():
        loc = manifest["index"][image_id]
        row = stores[loc["bucket"]].read_row(loc["row"])
        out[key] = (row["mask"].astype(np.float32), row)
    return out


def test_masks_end_to_end(assets, demo_data, tmp_path):
    from stages import cache_latents
    from stages.core import aspect_buckets, dataset, image_io

    plain = _dataset(demo_data, tmp_path / "plain")
    losses, adapter = _train(_cfg(assets, plain, tmp_path / "a", "plain"))

    masked = _dataset(demo_data, tmp_path / "masked")
    for image in sorted(masked.glob("*.png")):
        _mask(image).save(image.with_name(image.stem + "_mask.png"))
    cfg = _cfg(assets, masked, tmp_path / "b", "masked")
    assert [it.mask_path.name for it in dataset.scan_data(cfg.data)] == [
        p.stem + "_mask.png" for p in sorted(plain.glob("*.png"))]  # masks are found, and are not items
    white_losses, white_adapter = _train(cfg)
    assert white_losses == losses  # bit-identical: an all-white mask is no mask
    assert all(torch.equal(white_adapter[k], adapter[k]) for k in adapter)
    assert all(np.all(m == 1.0) for m, _ in _cached_masks(cfg).values())

    # one item's mask becomes left-half white: only that item is re-encoded, cut like each variant
    first = sorted(masked.glob("*.png"))[0]
    key = first.relative_to(masked).as_posix()
    _mask(first, left_only=True).save(first.with_name(first.stem + "_mask.png"))
    assert cache_latents.run(cfg)["encoded_this_run"] == 1
    masks, row = _cached_masks(cfg)[key]
    item = next(it for it in dataset.scan_data(cfg.data) if it.key == key)
    size = image_io.image_size(item.image_path)
    bucket = tuple(int(x) for x in cache_latents.load_latents(cfg)[1]["index"][item.image_id]["bucket"].split("x"))
    variants = aspect_buckets.plan_variants(dataset.pixels_id(item), size, bucket, cfg.data.cache_variants, cfg.seed,
                                     cfg.data.random_flip, cfg.data.crop, cfg.data.crop_zoom)
    assert [int(v.flip) for v in variants] == row["flip"].tolist()  # the same plan as the latents' crops
    source = image_io.load_mask(item.mask_path, size)
    for k, v in enumerate(variants):
        want = image_io.mask_at_latents(source, v, bucket, masks.shape[-2:])
        np.testing.assert_allclose(masks[k], want, atol=1e-3)  # float16 storage
        left, right = masks[k][:, : masks.shape[-1] // 4].mean(), masks[k][:, -masks.shape[-1] // 4:].mean()
        assert (left < right) if v.flip else (left > right), f"variant {k} (flip={v.flip}) is cut the wrong way"
    assert {int(f) for f in row["flip"]} == {0, 1}  # both orientations were checked
    masked_losses, masked_adapter = _train(cfg, restart=True)  # its caches changed: train starts over
    assert len(masked_losses) == 3 and all(np.isfinite(masked_losses)) and masked_losses != losses

    # stopped after step 1 and resumed: the masked run's adapter is bit-identical to the whole run's
    import dataclasses
    import shutil

    from stages import train
    from stages.core import faults

    cut = dataclasses.replace(cfg, run="masked-cut")
    for cache in ("captions.zarr", "latents.zarr"):
        shutil.copytree(cfg.run_dir / cache, cut.run_dir / cache)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(faults.ENV, "train:1:TERM")
        assert train.run(cut)["step"] == 1
    assert train.run(cut, resume=True)["step"] == 3
    from safetensors.torch import load_file

    resumed = load_file(str(lora_dir(cut) / "final" / "adapter_model.safetensors"))
    assert all(torch.equal(resumed[k], masked_adapter[k]) for k in masked_adapter)


def test_masks_folder_and_bad_masks(assets, demo_data, tmp_path):
    from stages import cache_latents
    from stages.core import dataset, image_io
    from stages.core.errors import DatasetError

    data = _dataset(demo_data, tmp_path / "data")
    images = sorted(data.glob("*.png"))
    (data / "masks").mkdir()
    _mask(images[0]).save(data / "masks" / images[0].name)  # masks/<same stem>.png
    cfg = _cfg(assets, data, tmp_path / "a", "bad-masks")
    items = dataset.scan_data(cfg.data)
    assert len(items) == N_ITEMS and items[0].mask_path == data / "masks" / images[0].name

    # two masks for one image
    _mask(images[0]).save(images[0].with_name(images[0].stem + "_mask.png"))
    with pytest.raises(DatasetError, match=f"image '{images[0]}' has 2 loss masks"):
        dataset.scan_data(cfg.data)
    (data / "masks" / images[0].name).unlink()

    # a mask of the wrong size: named, before the VAE loads
    w, h = Image.open(images[0]).size
    Image.new("L", (w + 8, h), 255).save(images[0].with_name(images[0].stem + "_mask.png"))
    with pytest.raises(image_io.BadImage, match=r"loss mask '.*_mask.png' is \d+x\d+ but its image .* is "
                                               r"\d+x\d+: save the mask at the image's size"):
        cache_latents.run(cfg)
    assert not (cfg.run_dir / "latents.zarr" / "manifest.json").exists()

    # a corrupt mask: the same message and policy as a corrupt image
    mask = images[0].with_name(images[0].stem + "_mask.png")
    mask.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    with pytest.raises(image_io.BadImage, match=f"'{mask}' .*corrupt.*data.on_bad_image = \"skip\""):
        cache_latents.run(cfg)
    skip = _cfg(assets, data, tmp_path / "a", "bad-masks")
    skip.data.on_bad_image = "skip"
    manifest = cache_latents.run(skip)
    assert [s["item"] for s in manifest["skipped"]] == [images[0].name]
    assert len(manifest["index"]) == N_ITEMS - 1


# ---- held-out validation loss ---------------------------------------------------------------------


def test_validation_settings_are_config_errors(tmp_path):
    from stages.core.config import load_config
    from stages.core.errors import ConfigError

    from conftest import demo_config_path

    cases = [({"validation.path": str(tmp_path), "validation.split": 0.1, "validation.every_n_steps": 5}, "set one of them"),
             ({"validation.split": 0.1}, r"'validation.every_n_steps' = 0 but held-out items are set"),
             ({"validation.every_n_steps": 5}, "but no held-out items: set validation.path"),
             ({"validation.split": 1.0, "validation.every_n_steps": 5}, r"'validation.split' = 1.0 must be in \[0, 1\)"),
             ({"validation.path": str(tmp_path), "data.path": str(tmp_path), "validation.every_n_steps": 5},
              "held-out images must not be trained on")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(demo_config_path("flux"), overrides)


def test_split_is_by_content_id(demo_data, tmp_path):
    from stages.core import dataset, validation
    from stages.core.config import load_config

    from conftest import demo_config_path

    cfg = load_config(demo_config_path("flux"), {"data.path": str(demo_data), "validation.split": 0.4,
                                                 "validation.every_n_steps": 1})
    items = dataset.scan_data(cfg.data)
    train_items, held = validation.partition(cfg, items)
    assert held and train_items and len(held) + len(train_items) == len(items)
    # the same image is held out whatever else is in the dataset, and whatever its name
    assert validation.partition(cfg, items[::-1])[1] == held[::-1]
    renamed = [dataclasses.replace(it, key="x/" + it.key) for it in items[:4]]
    assert [it.image_id for it in validation.partition(cfg, renamed)[1]] == \
        [it.image_id for it in held if it.image_id in {r.image_id for r in renamed}]


def _events(cfg, event: str) -> list[dict]:
    from stages.core.events import read_events

    lines = [e for e in read_events(cfg.run_dir) if e["stage"] == "train"]
    start = max(i for i, e in enumerate(lines) if e["event"] == "start")
    return [e for e in lines[start:] if e["event"] == event]


@once
def test_validation_loss_end_to_end(built_run, tmp_path, monkeypatch):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from pipeline import cli
    from stages import cache_latents, encode_captions, report, train
    from stages.core.events import validate_event
    from stages.tiny.shapes import make_demo_dataset
    from stages.train.trainer import Trainer

    grad_when_validating = []  # autograd's state in each loss validation computes (the model in eval mode)
    per_sample_loss = Trainer._per_sample_loss

    def spy(self, model, *args, **kwargs):
        if not model.training:
            grad_when_validating.append(torch.is_grad_enabled())
        return per_sample_loss(self, model, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_per_sample_loss", spy)

    held = make_demo_dataset(tmp_path / "held", n=3, seed=7)
    val = {"validation.path": str(held), "validation.every_n_steps": 2}
    cfg = run_beside(built_run, "validation", **{**SHORT, **val})
    assert encode_captions.run(cfg)["encoded_this_run"] == 3  # the held-out items join the caches
    assert cache_latents.run(cfg)["encoded_this_run"] == 3
    train.run(cfg)
    events = _events(cfg, "validation")
    assert [(e["step"], e["items"]) for e in events] == [(2, 3), (3, 3)]  # every 2 steps and at the last
    assert [validate_event(e) for e in events] == [[], []]  # EVENT_SCHEMA
    assert all(np.isfinite(e["loss"]) for e in events) and events[0]["loss"] != events[1]["loss"]
    assert grad_when_validating and not any(grad_when_validating)  # no activations kept for a backward

    # it draws nothing from training: the same losses and adapter as a run without it
    plain = run_beside(built_run, "no-validation", **SHORT)
    train.run(plain)
    final = lambda c: load_file(str(lora_dir(c) / "final" / "adapter_model.safetensors"))  # noqa: E731
    assert [e["loss"] for e in _events(plain, "step")] == [e["loss"] for e in _events(cfg, "step")]
    assert all(torch.equal(a, b) for a, b in zip(final(plain).values(), final(cfg).values()))

    # fixed noise per item: a resume from checkpoint-1 logs the very same validation figures
    resumed = run_beside(built_run, "validation-resumed", **{**SHORT, **val})
    encode_captions.run(resumed)
    cache_latents.run(resumed)
    shutil.copytree(lora_dir(cfg) / "checkpoint-1", lora_dir(resumed) / "checkpoint-1")
    train.run(resumed, resume=True)
    assert _events(resumed, "validation") == [dict(e, ts=r["ts"], run=r["run"]) for e, r in
                                             zip(events, _events(resumed, "validation"))]

    # report draws it and summarises it; status shows the newest figure
    _, summary = report.run(cfg.run_dir)
    assert summary["validation_loss_last"] == events[-1]["loss"]
    assert "validation loss" in "\n".join(report.format_summary(summary))
    from conftest import demo_config_path

    args = ["status", "--config", str(demo_config_path("flux")), "--run", cfg.run, "--model", cfg.model,
            "--set", f"data.path={cfg.data.path}", "--set", f"artifacts={cfg.artifacts}",
            "--set", f"validation.path={held}", "--set", "validation.every_n_steps=2"]
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 0, out.output
    assert f"validation loss {events[-1]['loss']:.4g} at step 3 (3 held-out items)" in out.output
