"""Masked loss (issue 20): the mask math, the cached masks, and bad mask files.

The math: an all-white mask is bit-identical to no mask (loss and gradients), a half mask gives
exactly zero gradient from its black half, an all-black sample contributes 0. End to end on the
tiny FLUX model: white masks beside every image train exactly as no masks; a mask is cached with
the crop and flip of each variant; editing one mask re-encodes only its item; a broken or
wrongly sized mask is named like a broken image, before the VAE loads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import make_cfg

N_ITEMS = 6


# ---- the math ---------------------------------------------------------------------------------


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
                                                           "train.checkpoint_every": 0})


def _train(cfg) -> tuple[list[float], dict]:
    from safetensors.torch import load_file

    from stages import cache_latents, encode_captions, train
    from stages.core.events import read_events

    encode_captions.run(cfg)
    cache_latents.run(cfg)
    train.run(cfg)
    events = [e for e in read_events(cfg.run_dir) if e["stage"] == "train"]
    start = max(i for i, e in enumerate(events) if e["event"] == "start")
    losses = [e["loss"] for e in events[start:] if e["event"] == "step"]
    return losses, load_file(str(cfg.run_dir / "lora" / "final" / "adapter_model.safetensors"))


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
    from stages.core import dataset

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
    size = dataset.image_size(item.image_path)
    bucket = tuple(int(x) for x in cache_latents.load_latents(cfg)[1]["index"][item.image_id]["bucket"].split("x"))
    variants = dataset.plan_variants(dataset.pixels_id(item), size, bucket, cfg.data.cache_variants, cfg.seed,
                                     cfg.data.random_flip, cfg.data.crop, cfg.data.crop_zoom)
    assert [int(v.flip) for v in variants] == row["flip"].tolist()  # the same plan as the latents' crops
    source = dataset.load_mask(item.mask_path, size)
    for k, v in enumerate(variants):
        want = dataset.mask_at_latents(source, v, bucket, masks.shape[-2:])
        np.testing.assert_allclose(masks[k], want, atol=1e-3)  # float16 storage
        left, right = masks[k][:, : masks.shape[-1] // 4].mean(), masks[k][:, -masks.shape[-1] // 4:].mean()
        assert (left < right) if v.flip else (left > right), f"variant {k} (flip={v.flip}) is cut the wrong way"
    assert {int(f) for f in row["flip"]} == {0, 1}  # both orientations were checked
    masked_losses, _ = _train(cfg)
    assert len(masked_losses) == 3 and all(np.isfinite(masked_losses)) and masked_losses != losses


def test_masks_folder_and_bad_masks(assets, demo_data, tmp_path):
    from stages import cache_latents
    from stages.core import dataset
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
    with pytest.raises(dataset.BadImage, match=r"loss mask '.*_mask.png' is \d+x\d+ but its image .* is "
                                               r"\d+x\d+: save the mask at the image's size"):
        cache_latents.run(cfg)
    assert not (cfg.run_dir / "latents.zarr" / "manifest.json").exists()

    # a corrupt mask: the same message and policy as a corrupt image
    mask = images[0].with_name(images[0].stem + "_mask.png")
    mask.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    with pytest.raises(dataset.BadImage, match=f"'{mask}' .*corrupt.*data.on_bad_image = \"skip\""):
        cache_latents.run(cfg)
    skip = _cfg(assets, data, tmp_path / "a", "bad-masks")
    skip.data.on_bad_image = "skip"
    manifest = cache_latents.run(skip)
    assert [s["item"] for s in manifest["skipped"]] == [images[0].name]
    assert len(manifest["index"]) == N_ITEMS - 1
