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

from stages.core import dataset, distributed
from stages.core import faults
from stages.core.artifacts import (RowStore, dir_bytes, fingerprint, invalidate_manifest, remove_dir, sweep_leftovers,
                                   write_manifest)
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
            "random_flip": d.random_flip, "crop": d.crop, "crop_zoom": d.crop_zoom, "background": d.background, "seed": cfg.seed,
            "dtype": cfg.latents.dtype, "vae_precision": cfg.latents.vae_precision,
            # merged buckets depend on the batch they fill; off adds no key, so older caches stay valid
            **({"bucket_merge": cfg.train.batch_size} if d.bucket_merge else {})}


def fingerprint_parts(cfg: Any) -> dict[str, Any]:
    items = dataset.scan_data(cfg.data)
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
    found: dict[str, tuple[dataset.Item, tuple[int, int]]] = {}
    skipped, duplicates = [], defaultdict(list)
    for it in items:
        if it.image_id in found:
            duplicates[it.image_id].append(it.key)
            log.emit("warning", item=it.key, message=f"image '{it.key}' has the same bytes as "
                     f"'{found[it.image_id][0].key}': cached once, both items train on it with their own captions")
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
        found[it.image_id] = (it, size)
    fill = cfg.train.batch_size if cfg.data.bucket_merge else 0
    assigned, notes = dataset.bucket_plan({i: (it.key, size) for i, (it, size) in found.items()}, buckets, fill,
                                          cfg.data.max_aspect)
    for key, note in notes:
        log.emit("warning", item=key, message=note)
    plan = {i: (it, size, assigned[i]) for i, (it, size) in found.items()}
    return plan, skipped, dict(duplicates)


def _open_store(path: Path, bucket: tuple[int, int], layout_fp: str) -> RowStore | None:
    group = path / dataset.bucket_name(bucket)
    if not (group / "zarr.json").exists():
        return None
    store = RowStore.open(group, mode="a")
    return store if store.group.attrs.get("layout") == layout_fp else None


def _prepare_stores(out: Path, layout_fp: str, by_bucket: dict[tuple[int, int], list[str]],
                    writer: bool) -> tuple[dict[tuple[int, int], RowStore | None], list[tuple[tuple[int, int], str]]]:
    """Each bucket's store (None: not made yet) and the (bucket, image id) pairs still to encode.
    The writer (rank 0) rebuilds the root when settings changed and grows stores by new images."""
    import zarr

    if writer:
        root = zarr.open_group(str(out), mode="a")
        if root.attrs.get("layout") != layout_fp:
            # Settings changed: the manifest goes now, so nothing here looks valid until rebuilt;
            # each bucket store made with other settings is replaced when its first new row is
            # ready (RowStore.create), so a model path that fails to load deletes nothing.
            invalidate_manifest(out)
            root.attrs["layout"] = layout_fp
    stores: dict[tuple[int, int], RowStore | None] = {}
    todo: list[tuple[tuple[int, int], str]] = []
    for bucket, ids in sorted(by_bucket.items()):
        store = _open_store(out, bucket, layout_fp)
        if store is not None and writer:
            new = [i for i in ids if i not in set(store.ids)]
            if new:
                store.append_rows(new)
        stores[bucket] = store
        done = set() if store is None else {i for i, ok in zip(store.ids, store.written_mask()) if ok}
        todo += [(bucket, i) for i in ids if i not in done]
    return stores, todo


def _seed_stores(todo: list, stores: dict, encode_image: Any) -> list:
    """Encode images of each bucket without a store until one is written (a bad image is skipped),
    which creates the store; returns the (bucket, image id) pairs handled."""
    handled = []
    for bucket, image_id in todo:
        if stores[bucket] is None:
            handled.append((bucket, image_id))
            encode_image(bucket, image_id)
    return handled


def run(cfg: Any) -> dict[str, Any]:
    import torch

    from stages.core import memory
    from stages.core.runtime import install_model_trace, make_runtime, peak_vram_gb, reset_peak
    from stages.families import get_family

    install_model_trace(NAME)
    with running_stage(cfg, NAME) as ctx:
        family = get_family(cfg.family)
        cfg, memory_plan = memory.plan_stage(cfg, family, NAME, ctx.log)  # the budget's VAE settings
        src = ModelSource(cfg.model, cfg.revision)
        src.check(family.vae_components)  # a mistyped model path fails here, before the cache is touched
        items = dataset.scan_data(cfg.data, ctx.log)
        buckets, multiple = buckets_for(cfg, family, src)
        layout = layout_parts(cfg)
        layout_fp = fingerprint(layout)
        out = artifact_dir(cfg)
        dist = ctx.dist
        plan, skipped, duplicates = plan_images(cfg, items, buckets, ctx.log)

        by_bucket: dict[tuple[int, int], list[str]] = defaultdict(list)
        for image_id, (_, _, bucket) in sorted(plan.items()):
            by_bucket[bucket].append(image_id)
        with distributed.main_first(dist):  # rank 0 (re)makes the root and grows stores first
            stores, todo = _prepare_stores(out, layout_fp, by_bucket, writer=dist.is_main)
        ctx.log.emit("preparing", done=len(plan) - len(todo), total=len(plan), encoded=0)

        rt = make_runtime(cfg.device, cfg.latents.vae_precision)
        reset_peak(rt)
        vae = norm = None
        if todo or not (out / "manifest.json").exists():
            src.check(family.vae_components)
            ctx.log.emit("loading", component="vae")
            vae = family.load_vae(src, rt)
            memory.apply_vae_plan(vae, memory_plan)  # sliced/tiled encode when the plan needs it
            norm = family.latent_normalization(vae)
            ctx.log.emit("loaded", component="vae", seconds=ctx.elapsed())
        else:
            from stages.core.artifacts import read_manifest

            norm = read_manifest(out)["normalization"]
        n_var = cfg.data.cache_variants
        load_skipped: list[tuple[int, str, str]] = []  # (position in todo, item, reason)
        position = {t: k for k, t in enumerate(todo)}
        encoded_here = 0

        def encode_image(bucket: tuple[int, int], image_id: str) -> None:
            nonlocal encoded_here
            item, size, _ = plan[image_id]
            encoded_here += 1
            bar.advance(1)
            est = min(len(todo), encoded_here * dist.world_size)  # rank 0 reports for the job
            ctx.log.emit("preparing", done=len(plan) - len(todo) + est, total=len(plan), encoded=est)
            try:
                image = dataset.load_image(item.image_path, cfg.data.background)
            except dataset.BadImage as e:
                if cfg.data.on_bad_image == "error":
                    e.item = item.key  # type: ignore[attr-defined]
                    raise
                load_skipped.append((position[(bucket, image_id)], item.key, str(e)))
                ctx.log.emit("skipped", item=item.key, reason=str(e))
                return
            variants = dataset.plan_variants(image_id, size, bucket, n_var, cfg.seed, cfg.data.random_flip,
                                                 cfg.data.crop, cfg.data.crop_zoom)
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
                # (top, left) of the crop in the image the model sees: for a flipped variant that
                # is the mirrored image, where the box starts at resized_width - left - bucket_width
                "crop_top_left": [[v.crop_top, v.resized[0] - v.crop_left - bucket[0] if v.flip else v.crop_left]
                                  for v in variants],
                "flip": [int(v.flip) for v in variants], "original_size": [size[1], size[0]]})
            faults.hit(NAME)

        with distributed.progress(dist, "cache-latents", -(-len(todo) // dist.world_size), "images") as bar:
            # A bucket's store is created from its first encoded image (the latent shape comes from
            # the VAE): under torchrun rank 0 does that for every new bucket before the others write.
            seeded: list[tuple[tuple[int, int], str]] = []
            with distributed.main_first(dist):
                if dist.is_main and dist.is_distributed:
                    seeded = _seed_stores(todo, stores, encode_image)
            seeded = distributed.broadcast(seeded, dist)
            for bucket, _ in seeded:
                stores[bucket] = stores[bucket] or _open_store(out, bucket, layout_fp)
            done_first = set(seeded)
            rest = [t for t in todo if t not in done_first]
            for bucket, image_id in distributed.shard(rest, dist, first=len(seeded)):
                encode_image(bucket, image_id)
        distributed.barrier(dist)  # every rank's rows are on disk: rank 0 writes the manifest
        gathered = distributed.all_gather(load_skipped, dist)
        for part in gathered[1:]:
            for _, key, reason in part:
                ctx.log.emit("skipped", item=key, reason=reason)
        skipped += [(key, reason) for _, key, reason in sorted(s for part in gathered for s in part)]
        if not dist.is_main:
            return {"stage": NAME, "rank": dist.rank, "encoded_this_run": len(todo)}
        skipped_keys = {key for key, _ in skipped}
        encoded = len(todo) - sum(len(part) for part in gathered)  # images that failed to load were not encoded
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
        # Every scanned image counts as an input, skipped ones too (they are listed as skipped):
        # otherwise a run with a skipped image would never be up to date.
        parts = {**layout, "images": sorted({it.image_id for it in items})}
        manifest = write_manifest(
            out, NAME, family=cfg.family, model=cfg.model, fingerprint=fingerprint(parts), fingerprint_parts=parts,
            index=index, items={it.key: it.image_id for it in items if it.image_id in index},
            buckets={dataset.bucket_name(b): len(ids) for b, ids in sorted(by_bucket.items())},
            normalization=norm, variants=n_var, bucket_multiple=multiple, dtype=cfg.latents.dtype,
            latent_shapes={dataset.bucket_name(b): list(s.group["mean"].shape[2:]) for b, s in stores.items() if s},
            skipped=[{"item": k, "reason": r} for k, r in skipped], duplicates=duplicates,
            warnings=[{"item": it.key, "message": note} for it, size, bucket in plan.values()
                      for note in dataset.size_notes(it.key, size, bucket, cfg.data.max_aspect)],
            encoded_this_run=encoded, bytes_on_disk=dir_bytes(out), seconds=ctx.elapsed(), peak_vram_gb=peak_vram_gb(rt),
            world_size=dist.world_size)
        _tidy(out, by_bucket)  # after the manifest: the one it replaced may still have used those buckets
        ctx.log.emit("done", seconds=ctx.elapsed(), encoded=encoded, total=len(plan), skipped=len(skipped))
        return manifest


def _tidy(out: Path, by_bucket: dict[tuple[int, int], list[str]]) -> None:
    """Once the manifest is written: drop bucket stores no image uses any more (settings changed)
    and the temp files of killed writers. Only space is freed; nothing the manifest uses is touched."""
    keep = {dataset.bucket_name(b) for b in by_bucket}
    for group in out.iterdir() if out.is_dir() else []:
        if group.is_dir() and not group.name.startswith(".") and group.name not in keep:
            remove_dir(group)
    sweep_leftovers(out)


def load_latents(cfg: Any) -> tuple[dict[str, RowStore], dict[str, Any]]:
    """Bucket name -> RowStore, and the manifest (refuses if missing)."""
    from stages.core.artifacts import require_manifest

    out = artifact_dir(cfg)
    manifest = require_manifest(out, f"cache-latents --config <your config>  (run '{cfg.run}')")
    stores = {name: RowStore.open(out / name) for name in manifest["buckets"] if (out / name / "zarr.json").exists()}
    return stores, manifest
