"""Stage 2: images -> artifacts/<run>/latents.zarr. Loads only the VAE.

    python pipeline.py cache-latents --config configs/flux-dev.toml

Each image goes to the aspect bucket nearest its shape. For each of `cache_variants` crop/flip
variants (a seeded plan keyed by image id) the VAE posterior **mean and logvar** are stored, so every
training step can draw a fresh sample mean + exp(logvar/2) * eps instead of reusing one frozen
sample. One zarr group per bucket (`latents.zarr/<W>x<H>/`), one row per distinct image, keyed by
image-content id; crop box, flip flag and original size are stored beside the latents.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from stages.core import dataset
from stages.core.artifacts import RowStore, dir_bytes, fingerprint, write_manifest
from stages.core.model_source import ModelSource
from stages.core.stage import running_stage

NAME = "cache-latents"


def artifact_dir(cfg: Any) -> Path:
    return cfg.run_dir / "latents.zarr"


def layout_parts(cfg: Any) -> dict[str, Any]:
    from stages.families import get_family

    family = get_family(cfg.family)
    src = ModelSource(cfg.model, cfg.revision)
    d = cfg.data
    return {"family": cfg.family, "model": src.identity(family.vae_components), "resolution": d.resolution,
            "bucket_step": d.bucket_step, "max_aspect": d.max_aspect, "cache_variants": d.cache_variants,
            "random_flip": d.random_flip, "crop": d.crop, "background": d.background, "seed": cfg.seed,
            "dtype": cfg.latents.dtype, "vae_precision": cfg.latents.vae_precision}


def fingerprint_parts(cfg: Any) -> dict[str, Any]:
    items = dataset.scan(cfg.data.path, cfg.data.caption_ext)
    return {**layout_parts(cfg), "images": sorted({it.image_id for it in items})}


def buckets_for(cfg: Any, family: Any, src: ModelSource) -> tuple[list[tuple[int, int]], int]:
    multiple = cfg.data.bucket_step or family.pixel_multiple(src)
    if cfg.data.bucket_step and cfg.data.bucket_step % family.pixel_multiple(src):
        raise ValueError(f"data.bucket_step = {cfg.data.bucket_step} is not a multiple of {family.pixel_multiple(src)}, "
                         f"which this model's latents need")
    return dataset.make_buckets(cfg.data.resolution, multiple, cfg.data.max_aspect), multiple


def _pixels(image: Any, variants: list[dataset.Variant], bucket: tuple[int, int]) -> Any:
    import numpy as np
    import torch

    arrays = [np.asarray(dataset.render_variant(image, v, bucket), dtype=np.float32) for v in variants]
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)
    return x / 127.5 - 1.0  # [0, 255] -> [-1, 1], as VaeImageProcessor.normalize


def plan_images(cfg: Any, items: list[dataset.Item], buckets: list[tuple[int, int]], log: Any) -> tuple[dict, list, dict]:
    """image id -> (item, size, bucket) for readable images; skipped [(key, reason)]; duplicates."""
    plan: dict[str, tuple[dataset.Item, tuple[int, int], tuple[int, int]]] = {}
    skipped, duplicates = [], defaultdict(list)
    for it in items:
        if it.image_id in plan:
            duplicates[it.image_id].append(it.key)
            continue
        try:
            size = dataset.image_size(it.image_path)
        except Exception as e:  # noqa: BLE001 - PIL raises many types for broken files
            err = e if isinstance(e, dataset.BadImage) else dataset.BadImage(f"image '{it.image_path}' cannot be read ({e})")
            if cfg.data.on_bad_image == "error":
                err.item = it.key  # type: ignore[attr-defined]
                raise err from None
            skipped.append((it.key, str(err)))
            log.emit("skipped", item=it.key, reason=str(err))
            continue
        plan[it.image_id] = (it, size, dataset.assign_bucket(size, buckets))
    return plan, skipped, dict(duplicates)


def _open_store(path: Path, bucket: tuple[int, int], layout_fp: str) -> RowStore | None:
    group = path / dataset.bucket_name(bucket)
    if not (group / "zarr.json").exists():
        return None
    store = RowStore.open(group, mode="a")
    return store if store.group.attrs.get("layout") == layout_fp else None


def run(cfg: Any) -> dict[str, Any]:
    import torch
    import zarr

    from stages.core.events import Progress
    from stages.core.runtime import install_model_trace, make_runtime, peak_vram_gb, reset_peak
    from stages.families import get_family

    install_model_trace()
    with running_stage(cfg, NAME) as ctx:
        family = get_family(cfg.family)
        src = ModelSource(cfg.model, cfg.revision)
        items = dataset.scan(cfg.data.path, cfg.data.caption_ext)
        buckets, multiple = buckets_for(cfg, family, src)
        layout = layout_parts(cfg)
        layout_fp = fingerprint(layout)
        out = artifact_dir(cfg)
        root = zarr.open_group(str(out), mode="a")
        if root.attrs.get("layout") != layout_fp:
            root = zarr.open_group(str(out), mode="w")  # settings changed: rebuild every bucket
            root.attrs["layout"] = layout_fp
        plan, skipped, duplicates = plan_images(cfg, items, buckets, ctx.log)

        by_bucket: dict[tuple[int, int], list[str]] = defaultdict(list)
        for image_id, (_, _, bucket) in sorted(plan.items()):
            by_bucket[bucket].append(image_id)
        stores: dict[tuple[int, int], RowStore] = {}
        todo: list[tuple[tuple[int, int], str]] = []
        for bucket, ids in sorted(by_bucket.items()):
            store = _open_store(out, bucket, layout_fp)
            if store is not None:
                new = [i for i in ids if i not in set(store.ids)]
                if new:
                    store.append_rows(new)
            stores[bucket] = store  # type: ignore[assignment]
            done = set() if store is None else {i for i, ok in zip(store.ids, store.written_mask()) if ok}
            todo += [(bucket, i) for i in ids if i not in done]
        ctx.log.emit("preparing", done=len(plan) - len(todo), total=len(plan), encoded=0)

        rt = make_runtime(cfg.device, cfg.latents.vae_precision)
        reset_peak(rt)
        vae = norm = None
        if todo or not (out / "manifest.json").exists():
            src.check(family.vae_components)
            ctx.log.emit("loading", component="vae")
            vae = family.load_vae(src, rt)
            norm = family.latent_normalization(vae)
            ctx.log.emit("loaded", component="vae", seconds=ctx.elapsed())
        else:
            from stages.core.artifacts import read_manifest

            norm = read_manifest(out)["normalization"]
        n_var = cfg.data.cache_variants
        with Progress("cache-latents", len(todo), "images") as bar:
            for k, (bucket, image_id) in enumerate(todo):
                item, size, _ = plan[image_id]
                try:
                    image = dataset.load_image(item.image_path, cfg.data.background)
                except dataset.BadImage as e:
                    if cfg.data.on_bad_image == "error":
                        e.item = item.key  # type: ignore[attr-defined]
                        raise
                    skipped.append((item.key, str(e)))
                    ctx.log.emit("skipped", item=item.key, reason=str(e))
                    continue
                variants = dataset.plan_variants(image_id, size, bucket, n_var, cfg.seed, cfg.data.random_flip, cfg.data.crop)
                with torch.no_grad():
                    mean, logvar = family.encode_posterior(vae, _pixels(image, variants, bucket).to(rt.device))
                store = stores[bucket]
                if store is None:
                    fields = {"mean": ((n_var, *mean.shape[1:]), cfg.latents.dtype),
                              "logvar": ((n_var, *logvar.shape[1:]), cfg.latents.dtype),
                              "crop_top_left": ((n_var, 2), "int64"), "flip": ((n_var,), "uint8"),
                              "original_size": ((2,), "int64")}
                    store = stores[bucket] = RowStore.create(out / dataset.bucket_name(bucket), by_bucket[bucket], fields)
                    store.group.attrs["layout"] = layout_fp
                    store.group.attrs["bucket"] = list(bucket)
                row = store.ids.index(image_id)
                store.write_row(row, {
                    "mean": mean.float(), "logvar": logvar.float(),
                    # (top, left) in the resized image, as diffusers' SDXL training script computes it
                    "crop_top_left": [[v.crop_top, v.crop_left] for v in variants],
                    "flip": [int(v.flip) for v in variants], "original_size": [size[1], size[0]]})
                bar.advance(1)
                ctx.log.emit("preparing", done=len(plan) - len(todo) + k + 1, total=len(plan), encoded=k + 1)
        skipped_keys = {key for key, _ in skipped}
        index = {}
        for bucket, ids in sorted(by_bucket.items()):
            store = stores[bucket]
            if store is None:
                continue
            rows = {i: r for r, i in enumerate(store.ids)}
            written = store.written_mask()
            for image_id in ids:
                if plan[image_id][0].key not in skipped_keys and written[rows[image_id]]:
                    index[image_id] = {"bucket": dataset.bucket_name(bucket), "row": rows[image_id]}
        parts = {**layout, "images": sorted(index)}
        manifest = write_manifest(
            out, NAME, family=cfg.family, model=cfg.model, fingerprint=fingerprint(parts), fingerprint_parts=parts,
            index=index, items={it.key: it.image_id for it in items if it.image_id in index},
            buckets={dataset.bucket_name(b): len(ids) for b, ids in sorted(by_bucket.items())},
            normalization=norm, variants=n_var, bucket_multiple=multiple, dtype=cfg.latents.dtype,
            latent_shapes={dataset.bucket_name(b): list(s.group["mean"].shape[2:]) for b, s in stores.items() if s},
            skipped=[{"item": k, "reason": r} for k, r in skipped], duplicates=duplicates,
            encoded_this_run=len(todo), bytes_on_disk=dir_bytes(out), seconds=ctx.elapsed(), peak_vram_gb=peak_vram_gb(rt))
        ctx.log.emit("done", seconds=ctx.elapsed(), encoded=len(todo), total=len(plan), skipped=len(skipped))
        return manifest


def load_latents(cfg: Any) -> tuple[dict[str, RowStore], dict[str, Any]]:
    """Bucket name -> RowStore, and the manifest (refuses if missing)."""
    from stages.core.artifacts import require_manifest

    out = artifact_dir(cfg)
    manifest = require_manifest(out, f"cache-latents --config <your config>  (run '{cfg.run}')")
    stores = {name: RowStore.open(out / name) for name in manifest["buckets"] if (out / name / "zarr.json").exists()}
    return stores, manifest
