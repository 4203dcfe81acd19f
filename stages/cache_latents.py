"""Stage 2: images -> artifacts/<run>/latents.zarr. Loads only the VAE.

    lorapipe cache-latents --config configs/flux-dev.toml

Each image goes to the aspect bucket nearest its shape. For each of `cache_variants` crop/flip
variants (a seeded plan keyed by image id) the VAE posterior **mean and logvar** are stored, so every
training step can draw a fresh sample mean + exp(logvar/2) * eps instead of reusing one frozen
sample. One zarr group per bucket (`latents.zarr/<W>x<H>/`), one row per distinct image, keyed by
image-content id; crop box, flip flag and original size are stored beside the latents.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from stages.core import aspect_buckets, dataset, distributed, image_io, video
from stages.core import faults
from stages.core.artifacts import (DamagedManifest, fingerprint, invalidate_manifest, read_manifest, remove_dir,
                                   sweep_leftovers, write_manifest)
from stages.core import caches
from stages.core.caches import latents_dir, load_latents  # noqa: F401 - load_latents: still importable from here
from stages.core.cache_build import damage_report, encode_units, keys_by_id, rows_to_encode
from stages.core.config import command
from stages.core.errors import ConfigError, listing
from stages.core.model_source import ModelSource, model_source
from stages.core.rowstore import RowStore, new_rows_per_shard
from stages.core.schema import Bucket
from stages.core.video import ClipInfo
from stages.core.stage import running_stage
from stages.registry import conflicts

NAME = "cache-latents"


def artifact_dir(cfg: Any) -> Path:
    return latents_dir(cfg)


def layout_parts(cfg: Any, vae_plan: Any = None) -> dict[str, Any]:
    """What every row of the cache depends on. The VAE's precision and tiling are the ones `vae_plan`
    encodes with (the run's own plan), else the ones cache-latents plans for `cfg` (what train expects)."""
    from stages.core.memory import planned_vae  # a small budget lowers the VAE's precision, then tiles
    from stages.families import get_family

    family = get_family(cfg.family)
    vae = vae_plan.settings if vae_plan is not None else planned_vae(cfg, family)
    vae = vae or {"vae_precision": cfg.latents.vae_precision, "tiled": False}  # CPU: as configured
    src = model_source(cfg)
    d = cfg.data
    return {"family": cfg.family, "model": src.identity(family.vae_components),
            # resolution, cache_variants, random_flip, crop, crop_zoom: the first dataset's, not [data]'s,
            # which [[datasets]] tables may all override (then no image reads them and they must not
            # rebuild the cache)
            **dataset.latent_reference(cfg),
            "bucket_step": d.bucket_step, "max_aspect": d.max_aspect, "background": d.background, "seed": cfg.seed,
            "dtype": cfg.latents.dtype, "vae_precision": vae["vae_precision"],
            "vae_tiled": bool(vae.get("tiled")),  # a tiled encode gives other numbers (bench/tiling.py)
            # merged buckets depend on the batch they fill
            "bucket_merge": cfg.train.batch_size if d.bucket_merge else None,
            # [[datasets]] with their own resolution or variants
            "datasets": [{k: getattr(c, k) for k in dataset.LATENT_KEYS} for c in cfg.dataset_configs()] if cfg.datasets else []}


def variants_stored(cfg: Any) -> int:
    """Variant slots per row: the most any dataset caches (a row of a dataset caching fewer repeats them)."""
    return max(d.cache_variants for d in cfg.dataset_configs())


def scan_items(cfg: Any, log: Any = None) -> list[dataset.Item]:
    """The run's items as its family trains them (stages.core.caches.scan_items)."""
    from stages.families import get_family

    return caches.scan_items(cfg, get_family(cfg.family), log)


def fingerprint_parts(cfg: Any) -> dict[str, Any]:
    items = scan_items(cfg)
    return {**layout_parts(cfg), "images": sorted({it.latent_key for it in items})}


def describe_change(cfg: Any, manifest: dict[str, Any], key: str, old: Any, new: Any) -> str:
    """A change of the images, by file (status names files, not content ids)."""
    from stages.core.stage import changed_items, describe_change as plain

    if key in dataset.CLIP_KEYS:  # a clip key at its default is left out of the fingerprint: name the default
        old, new = (dataset.CLIP_KEYS[key] if v is None else v for v in (old, new))
        return f"data.{key}: {old:g} -> {new:g}"
    if key != "images":
        return plain(key, old, new)
    return changed_items(manifest.get("items", {}), {it.key: it.latent_key for it in scan_items(cfg)}, "image")


def buckets_for(cfg: Any, family: Any, src: ModelSource, resolution: int | None = None) -> list[Bucket]:
    multiple = family.pixel_multiple(src)
    if cfg.data.bucket_step and cfg.data.bucket_step % multiple:
        raise ConfigError(f"data.bucket_step = {cfg.data.bucket_step} is not a multiple of {multiple}, which this "
                          f"model's latents need: set it to a multiple of {multiple} (or 0 for {multiple})")
    return [Bucket(*b) for b in aspect_buckets.make_buckets(resolution or cfg.data.resolution,
                                                     cfg.data.bucket_step or multiple, cfg.data.max_aspect)]


def _pixels(image: Any, variants: list[aspect_buckets.Variant], bucket: tuple[int, int]) -> Any:
    return _to_pixels([image_io.render_variant(image, v, bucket) for v in variants])


def _clip_pixels(item: dataset.Item, info: ClipInfo, variants: list[aspect_buckets.Variant], bucket: Bucket, data: Any,
                 cfg: Any) -> tuple[list[aspect_buckets.Variant], Any]:
    """A clip's variants with their start frames, and their pixels (N, 3, F, H, W) in [-1, 1]: every
    variant's frames decoded in one pass, each cut like the variant's crop."""
    import torch

    starts = video.start_frames(cfg.seed, dataset.pixels_id(item), info, data.frames, data.fps, len(variants))
    variants = [dataclasses.replace(v, start=s) for v, s in zip(variants, starts)]
    indices = [video.frame_indices(info, v.start, data.frames, data.fps) for v in variants]
    wanted = sorted({i for ix in indices for i in ix})
    decoded = dict(zip(wanted, video.read_frames(item.image_path, wanted, cfg.data.background)))
    clips = [_to_pixels([image_io.render_variant(decoded[i], v, bucket) for i in ix]) for v, ix in zip(variants, indices)]
    return variants, torch.stack([c.transpose(0, 1) for c in clips])  # (F, 3, H, W) -> (3, F, H, W) each


def _to_pixels(images: list[Any]) -> Any:
    """Same-size RGB PIL images -> (N, 3, H, W) float32 in [-1, 1]."""
    import numpy as np
    import torch

    arrays = [np.asarray(im, dtype=np.float32) for im in images]
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)
    return x / 127.5 - 1.0  # [0, 255] -> [-1, 1], as VaeImageProcessor.normalize


def plan_images(cfg: Any, items: list[dataset.Item], buckets: dict[int, list[Bucket]],
                log: Any, known: dict[str, tuple[int, int]] | None = None,
                clips: dict[str, ClipInfo] | None = None) -> tuple[dict, list, dict]:
    """latent id -> (item, size, bucket) for readable images and clips, each bucketed among its dataset's
    resolution's `buckets` (a clip's bucket also has its dataset's data.frames); skipped [(key, reason)];
    duplicates. `known`: the sizes of images the cache already holds (its manifest's, by content id), whose
    headers are then not read again; `clips`: the probes of clips, by content id, read and filled in."""
    known = known or {}
    clips = clips if clips is not None else {}
    found: dict[str, tuple[dataset.Item, tuple[int, int]]] = {}
    skipped, duplicates, bad = [], defaultdict(list), []
    for it in items:
        if it.latent_key in found:
            duplicates[it.latent_key].append(it.key)
            log.emit("warning", item=it.key, message=f"image '{it.key}' has the same bytes as "
                     f"'{found[it.latent_key][0].key}': cached once, both items train on it with their own captions")
            continue
        if it.latent_key in known and not it.is_clip:  # its size is recorded, its mask was checked
            found[it.latent_key] = (it, known[it.latent_key])  # (a known clip's length is checked again below)
            continue
        try:
            size = _probe(cfg, it, clips)
            _check_mask_size(it, size)
            slow = _slow_motion(cfg, it, clips.get(it.latent_key))
            if slow:
                log.emit("warning", item=it.key, message=slow)
        except Exception as e:  # noqa: BLE001 - PIL raises many types for broken files
            err = image_io.BadImage(str(e)) if isinstance(e, video.BadClip) else e if isinstance(e, image_io.BadImage) \
                else image_io.BadImage(f"image '{it.image_path}' cannot be read ({e})")
            if cfg.data.on_bad_image == "error":
                err.item = it.key
                bad.append(err)
                continue
            skipped.append((it.key, image_io.as_skipped(str(err))))
            log.emit("skipped", item=it.key, reason=image_io.as_skipped(str(err)))
            continue
        found[it.latent_key] = (it, size)
    if bad:
        raise dataset.collected(bad, _what([it for it in items if it.key in {e.item for e in bad}]))
    fill = cfg.train.batch_size if cfg.data.bucket_merge else 0
    datasets = cfg.dataset_configs()
    frames_of = {i: datasets[it.dataset].frames if it.is_clip else 1 for i, (it, _) in found.items()}
    assigned: dict[str, Bucket] = {}
    for resolution, group in sorted(buckets.items()):  # each resolution's images fill its own buckets,
        for frames in sorted(set(frames_of.values())):  # and each clip length its own
            part, notes = aspect_buckets.bucket_plan({i: (it.key, size) for i, (it, size) in found.items()
                                               if datasets[it.dataset].resolution == resolution
                                               and frames_of[i] == frames}, group, fill, cfg.data.max_aspect)
            assigned.update({i: Bucket(*b[:2], frames) for i, b in part.items()})
            for key, note in notes:
                log.emit("warning", item=key, message=note)
    plan = {i: (it, size, assigned[i]) for i, (it, size) in found.items()}
    return plan, skipped, dict(duplicates)


def _slow_motion(cfg: Any, item: dataset.Item, info: ClipInfo | None) -> str | None:
    """Why a clip slower than its data.fps trains as slow motion (its frames repeat), or None."""
    fps = cfg.dataset_configs()[item.dataset].fps
    if info is None or not fps or fps <= info.fps * 1.01:
        return None
    rate = f"is read as {info.fps:g} fps (a folder of frames)" if item.image_path.is_dir() else f"runs at {info.fps:g} fps"
    return (f"clip '{item.image_path}' {rate}, below data.fps = {fps:g}: its frames repeat (each about "
            f"{fps / info.fps:.2g} times), so it trains as slow motion; set data.fps = {info.fps:g} or lower, or 0 "
            f"for its own frames one after another")


def _what(items: list[dataset.Item], both: str = "images and clips") -> str:
    """What a count of `items` counts: images, clips, or `both` (a pace reads better as "items/s")."""
    kinds = {it.is_clip for it in items}
    return "clips" if kinds == {True} else both if len(kinds) == 2 else "images"


def _probe(cfg: Any, item: dataset.Item, clips: dict[str, ClipInfo]) -> tuple[int, int]:
    """(width, height) of an image from its header; of a clip from its container, whose frame count and
    rate go to `clips` (a clip already there, from the cache's manifest, is not probed again). A clip too short
    for its dataset's data.frames at data.fps, or one for a family that trains on images, is a BadClip naming
    it: a cached clip too, when data.frames or data.fps changed since."""
    from stages.families import get_family

    if not item.is_clip:
        return image_io.image_size(item.image_path)
    family = get_family(cfg.family)
    if not family.trains_video:
        raise video.BadClip(f"clip '{item.image_path}': {cfg.family} trains on images, not clips; train a video "
                            f"family (wan2.2-5b), or {video.BAD_CLIP_HINT}")
    d = cfg.dataset_configs()[item.dataset]
    info = clips.get(item.latent_key) or video.probe(item.image_path)  # a cached clip's probe is in its manifest
    problem = video.too_short(item.image_path, info, d.frames, d.fps)
    if problem:
        raise video.BadClip(problem)
    clips[item.latent_key] = info
    return info.width, info.height


def _check_mask_size(item: dataset.Item, size: tuple[int, int]) -> None:
    """A loss mask must be its image's size (read from the headers, before the VAE loads; `load_mask`
    checks the decoded mask again, in case the file changed since)."""
    if item.mask_path is None:
        return
    w, h = image_io.image_size(item.mask_path)
    if (w, h) != size:
        raise image_io.BadImage(f"loss mask '{item.mask_path}' is {w}x{h} but its image '{item.image_path}' is "
                               f"{size[0]}x{size[1]}: save the mask at the image's size")


def _masks(mask: Any, variants: list[aspect_buckets.Variant], bucket: Bucket, latent_hw: tuple[int, int]) -> Any:
    """(variants, h, w) loss weights at latent resolution, cut like each variant; ones without a mask."""
    import numpy as np

    if mask is None:
        return np.ones((len(variants), *latent_hw), dtype=np.float32)
    return np.stack([image_io.mask_at_latents(mask, v, bucket, latent_hw) for v in variants])


def _open_store(path: Path, bucket: Bucket, layout_fp: str) -> RowStore | None:
    """The bucket's store if it was made with the same layout (and carries checksums), else None."""
    group = path / str(bucket)
    if not (group / "zarr.json").exists():
        return None
    store = RowStore.open(group, mode="a")
    return store if store.group.attrs.get("layout") == layout_fp and store.is_current else None


def _prepare_stores(out: Path, layout_fp: str, by_bucket: dict[Bucket, list[str]],
                    writer: bool) -> tuple[dict[Bucket, RowStore | None], list[tuple[Bucket, str]]]:
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
    stores: dict[Bucket, RowStore | None] = {}
    todo: list[tuple[Bucket, str]] = []
    for bucket, ids in sorted(by_bucket.items()):
        stores[bucket] = _open_store(out, bucket, layout_fp)
        todo += [(bucket, i) for i in rows_to_encode(stores[bucket], ids, grow=writer)]
    return stores, todo


def check(cfg: Any) -> dict[int, list[Bucket]]:
    """Everything this stage needs that a config can get wrong, before it deletes or loads anything:
    the model folder's VAE, the device, and the bucket settings. -> the buckets of each resolution."""
    from stages.core.runtime import make_runtime
    from stages.families import get_family

    family = get_family(cfg.family)
    src = model_source(cfg)
    src.check(family.vae_components, family)
    make_runtime(cfg.device, cfg.latents.vae_precision)
    return {r: buckets_for(cfg, family, src, r) for r in sorted({d.resolution for d in cfg.dataset_configs()})}


def run(cfg: Any, force: bool = False) -> dict[str, Any]:
    from stages.core import memory
    from stages.core.runtime import install_model_trace
    from stages.families import library_notices
    from stages.families import get_family

    install_model_trace(NAME, library_notices())
    with running_stage(cfg, NAME, beside=conflicts(NAME)) as ctx:
        configured = cfg
        # the plan the fingerprint asks for, recorded for later checks of this config (memory.recorded_plan)
        planned = memory.recorded_plan(cfg, get_family(cfg.family), NAME)
        cfg, vae_plan = memory.plan_stage(cfg, get_family(cfg.family), NAME, ctx.log)  # the budget's VAE settings
        buckets = check(cfg)
        out = artifact_dir(cfg)
        if force and ctx.dist.is_main:
            remove_dir(out)  # only now that the config is known to work
        items = scan_items(cfg, ctx.log)
        layout = layout_parts(cfg, vae_plan)  # what the rows really are, tiled or not
        forced = _forced(ctx, configured, vae_plan, layout)
        layout_fp = fingerprint(layout)
        _same_plan_on_every_rank(ctx, layout_fp, vae_plan)
        existing = None if force else read_manifest(out)  # --force: every image is encoded again
        current = None if existing is None else _up_to_date(cfg, existing, items, layout, ctx.log)
        if current is not None:
            return current
        clips = _known_clips(existing)
        plan, skipped, duplicates = plan_images(cfg, items, buckets, ctx.log, _known_sizes(existing), clips)
        by_bucket: dict[Bucket, list[str]] = defaultdict(list)
        for image_id, (_, _, bucket) in sorted(plan.items()):
            by_bucket[bucket].append(image_id)
        with distributed.main_first(ctx.dist):  # rank 0 (re)makes the root and grows stores first
            stores, todo = _prepare_stores(out, layout_fp, by_bucket, writer=ctx.dist.is_main)
        ctx.log.emit("preparing", done=len(plan) - len(todo), total=len(plan), encoded=0)
        encoded = _encode(ctx, cfg, plan, by_bucket, stores, todo, layout_fp, vae_plan, clips)
        _raise_failed(distributed.all_gather(encoded["load_failed"], ctx.dist))
        gathered = distributed.all_gather(encoded["load_skipped"], ctx.dist)
        for part in gathered[1:]:
            for _, key, reason in part:
                ctx.log.emit("skipped", item=key, reason=reason)
        if not ctx.dist.is_main:
            return {"stage": NAME, "rank": ctx.dist.rank, "encoded_this_run": len(todo)}
        skipped += [(key, reason) for _, key, reason in sorted(s for part in gathered for s in part)]
        n_encoded = len(todo) - sum(len(part) for part in gathered)  # images that failed to load were not encoded
        manifest = _write(ctx, cfg, items, plan, by_bucket, encoded, skipped, duplicates, n_encoded, layout, forced,
                          clips, planned)
        _tidy(out, by_bucket)  # after the manifest: the one it replaced may still have used those buckets
        ctx.log.emit("done", seconds=ctx.elapsed(), encoded=n_encoded, total=len(plan), skipped=len(skipped),
                     unit=_what([it for it, _, _ in plan.values()], "items"), **_pace(encoded["pace"]))
        return manifest


def _known_sizes(manifest: dict[str, Any] | None) -> dict[str, tuple[int, int]]:
    """Content id -> (width, height) of every image the existing cache's `manifest` holds: an incremental run
    (images added, settings changed) reads the headers of the new images only. A size is a function of the
    image's bytes, which its id hashes, so no setting makes it stale."""
    entries = manifest.get("index", {}) if manifest else {}
    return {i: (int(e["size"][0]), int(e["size"][1])) for i, e in entries.items()
            if isinstance(e, dict) and isinstance(e.get("size"), list) and len(e["size"]) == 2}


def _known_clips(manifest: dict[str, Any] | None) -> dict[str, ClipInfo]:
    """Content id -> the probe of every clip the existing cache's `manifest` holds (its "clip": [frames, fps])."""
    entries = manifest.get("index", {}) if manifest else {}
    return {i: ClipInfo(int(e["size"][0]), int(e["size"][1]), int(e["clip"][0]), float(e["clip"][1]))
            for i, e in entries.items() if isinstance(e, dict) and isinstance(e.get("clip"), list)
            and len(e["clip"]) == 2 and isinstance(e.get("size"), list) and len(e["size"]) == 2}


def _up_to_date(cfg: Any, manifest: dict[str, Any], items: list[dataset.Item], layout: dict[str, Any],
                log: Any) -> dict[str, Any] | None:
    """The cache's `manifest`, when it holds these images with this layout and no row is damaged: then the
    stage opens no image (planning the buckets reads every image's header), as `run` skips it."""
    parts = {**layout, "images": sorted({it.latent_key for it in items})}
    if not manifest.get("complete", True) or manifest.get("fingerprint") != fingerprint(parts) \
            or damaged_rows(cfg, manifest) or lacks(cfg, manifest):
        return None  # a skipped image refused by data.on_bad_image = "error" is planned again, and named
    skipped = [s["item"] for s in manifest.get("skipped", [])]
    cached = f"every image but the {len(skipped)} skipped ({listing(skipped)})" if skipped else "every image"
    log.emit("up_to_date", fingerprint=manifest["fingerprint"],
             notes=[f"{cached} is cached with these settings; `{command(cfg, NAME, '--force')}` encodes them again"])
    return {**manifest, "encoded_this_run": 0, "up_to_date": True}


def _raise_failed(gathered: list[list[tuple[int, str, str]]]) -> None:
    """Under data.on_bad_image = "error": every image that failed to load (all ranks'), in one error,
    after the others were encoded (their rows are kept; no manifest is written)."""
    failed = sorted(f for part in gathered for f in part)
    errors = []
    for _, key, reason in failed:
        errors.append(image_io.BadImage(reason))
        errors[-1].item = key
    if errors:
        raise dataset.collected(errors, "images")


def _forced(ctx: Any, configured: Any, vae_plan: Any, layout: dict[str, Any]) -> dict[str, Any] | None:
    """Under "auto", the layout parts the free memory forced (a lower VAE precision, a tiled encode),
    which the config's own layout (what train and status expect) does not have: {"parts", "message"}
    for the manifest, with a warning now. Train accepts such a cache with that warning (memory had no
    other plan), `run` and `status` count it stale, and a rerun with enough free memory re-encodes it."""
    from stages.core import memory

    message = memory.forced_by_memory(configured, vae_plan)
    if message is None:
        return None
    expected = layout_parts(configured)
    parts = {k: v for k, v in layout.items() if expected.get(k) != v}
    if set(expected) - set(layout) or not parts:
        return None  # nothing the config's layout would not also say (the budget plans alike for both)
    ctx.log.emit("warning", message=message)
    return {"parts": parts, "message": message}


def _same_plan_on_every_rank(ctx: Any, layout_fp: str, vae_plan: Any) -> None:
    """Under "auto" each GPU plans from its own free memory: GPUs that would encode other numbers
    (one tiled, one not) must not write rows into one cache."""
    from stages.core.errors import ResourceError

    plans = distributed.all_gather((layout_fp, vae_plan.settings), ctx.dist)
    if len({fp for fp, _ in plans}) > 1:
        each = "; ".join(f"rank {r}: {settings}" for r, (_, settings) in enumerate(plans))
        raise ResourceError(f"the GPUs of this cache-latents run planned VAE settings that give different latents "
                            f"from their free memory ({each}), and one cache cannot mix them: free memory on the busier "
                            f"GPU, or set gpu.vram_budget_gb (--vram) to a number of GB every GPU has free")


def _encode(ctx: Any, cfg: Any, plan: dict, by_bucket: dict[Bucket, list[str]], stores: dict[Bucket, RowStore | None],
            todo: list[tuple[Bucket, str]], layout_fp: str, vae_plan: Any,
            plan_clips: dict[str, ClipInfo]) -> dict[str, Any]:
    """Encode every (bucket, image id) of `todo` over the ranks; -> stores, normalization, skipped, runtime."""
    import torch

    from stages.core import memory
    from stages.core.host_copies import pinned, to_host
    from stages.core.runtime import make_runtime, reset_peak
    from stages.families import get_family

    family, out, n_var = get_family(cfg.family), artifact_dir(cfg), variants_stored(cfg)
    datasets = cfg.dataset_configs()
    rt = make_runtime(cfg.device, cfg.latents.vae_precision)
    reset_peak(rt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamagedManifest)  # `run` above named a damaged or older manifest once
        previous = read_manifest(out)
    vae, norm = None, previous and previous["normalization"]
    if todo or previous is None:
        ctx.log.emit("loading", component="vae")
        vae = family.load_vae(model_source(cfg), rt)
        memory.apply_vae_plan(vae, vae_plan)  # sliced/tiled encode when the plan needs it
        norm = family.latent_normalization(vae)
        ctx.log.emit("loaded", component="vae", seconds=ctx.elapsed())
    load_skipped: list[tuple[int, str, str]] = []  # (position in todo, item, reason)
    load_failed: list[tuple[int, str, str]] = []  # the same, under data.on_bad_image = "error"
    clips = {**_known_clips(previous), **plan_clips}
    position = {t: k for k, t in enumerate(todo)}
    rows_of = {b: s.row_of() for b, s in stores.items() if s is not None}

    def read_image(unit: tuple[Bucket, str]) -> Any:
        """The host's part, on a reader thread ahead of the encoder: the decoded image, its mask and
        controls, its variants and their pixels (pinned for a CUDA GPU); or the BadImage that stops it."""
        bucket, image_id = unit
        item, size, _ = plan[image_id]
        d = datasets[item.dataset]
        variants = aspect_buckets.plan_variants(dataset.pixels_id(item), size, bucket, d.cache_variants, cfg.seed, d.random_flip,
                                         d.crop, d.crop_zoom)
        try:
            if item.is_clip:
                variants, pixels = _clip_pixels(item, clips[image_id], variants, bucket, d, cfg)
                return None, None, [], variants, pinned(pixels, rt.device)
            image = image_io.load_image(item.image_path, cfg.data.background)
            mask = None if item.mask_path is None else image_io.load_mask(item.mask_path, size)
            controls = [image_io.load_image(c, cfg.data.background) for c in item.controls]
        except video.BadClip as e:
            return image_io.BadImage(str(e))
        except image_io.BadImage as e:
            return e
        return image, mask, controls, variants, pinned(_pixels(image, variants, bucket), rt.device)

    def skip_image(unit: tuple[Bucket, str], bad: image_io.BadImage) -> None:
        item = plan[unit[1]][0]
        if cfg.data.on_bad_image == "error":  # reported with every other one once the rest are encoded
            load_failed.append((position[unit], item.key, str(bad)))
            return
        load_skipped.append((position[unit], item.key, image_io.as_skipped(str(bad))))
        ctx.log.emit("skipped", item=item.key, reason=image_io.as_skipped(str(bad)))

    def encode_image(unit: tuple[Bucket, str], read: Any) -> Callable[[], None]:
        """Queue the VAE's work for one image; -> its finish (encode_units calls it once the next image's
        work is queued): the row copied to the host and journaled, or a bad image reported, in order."""
        bucket, image_id = unit
        item, size, _ = plan[image_id]
        if isinstance(read, image_io.BadImage):
            return lambda: skip_image(unit, read)
        _, mask, controls, variants, pixels = read
        with torch.no_grad():
            mean, logvar = family.encode_posterior(vae, pixels.to(rt.device, non_blocking=True))
            posteriors = _control_posteriors(family, vae, controls, size, variants, bucket, rt.device)
        if len(variants) < n_var:  # another dataset caches more: repeat this one's to fill the row
            cycle = [k % len(variants) for k in range(n_var)]
            variants, mean, logvar = [variants[k] for k in cycle], mean[cycle], logvar[cycle]
            posteriors = {name: v[cycle] for name, v in posteriors.items()}
        if stores[bucket] is None:
            fields = {"mean": ((n_var, *mean.shape[1:]), cfg.latents.dtype),
                      "logvar": ((n_var, *logvar.shape[1:]), cfg.latents.dtype),
                      "crop_top_left": ((n_var, 2), "int64"), "flip": ((n_var,), "uint8"),
                      "original_size": ((2,), "int64"), "mask": ((n_var, *mean.shape[-2:]), "float16"),
                      **({"start_frame": ((n_var,), "int64")} if bucket.frames > 1 else {}),
                      **{name: (tuple(v.shape), cfg.latents.dtype) for name, v in posteriors.items()}}
            stores[bucket] = RowStore.create(out / str(bucket), by_bucket[bucket], fields)
            stores[bucket].group.attrs["layout"] = layout_fp
            stores[bucket].group.attrs["bucket"] = list(bucket)
        if bucket not in rows_of:
            rows_of[bucket] = stores[bucket].row_of()
        _check_control_shapes(stores[bucket], posteriors, item, bucket)
        latents = to_host({"mean": mean.float(), "logvar": logvar.float(),
                           **{k: v.float() for k, v in posteriors.items()}}, rt.device)
        store, row, latent_hw = stores[bucket], rows_of[bucket][image_id], tuple(mean.shape[-2:])

        def finish() -> None:
            store.journal_row(row, {
                **latents(),
                # (top, left) of the crop in the image the model sees: for a flipped variant that
                # is the mirrored image, where the box starts at resized_width - left - bucket_width
                "crop_top_left": [[v.crop_top, v.resized[0] - v.crop_left - bucket[0] if v.flip else v.crop_left]
                                  for v in variants],
                "flip": [int(v.flip) for v in variants], "original_size": [size[1], size[0]],
                **({"start_frame": [v.start for v in variants]} if bucket.frames > 1 else {}),
                "mask": _masks(mask, variants, bucket, latent_hw)})
            faults.hit(NAME)

        return finish

    def reopen() -> None:  # stores rank 0 created while seeding
        for bucket in stores:
            stores[bucket] = stores[bucket] or _open_store(out, bucket, layout_fp)

    # a new store's rows are its bucket's ids in order (RowStore.create)
    rows = {b: rows_of.get(b) or {i: k for k, i in enumerate(by_bucket[b])} for b in stores}
    per_shard = {b: s.rows_per_shard if s is not None else new_rows_per_shard() for b, s in stores.items()}

    def flush() -> None:
        for store in stores.values():
            if store is not None:
                store.flush()

    from stages.core.gpu_busy import GpuBusy

    with GpuBusy(rt.device) as busy:  # the GPU's utilization over the encode loop (None off CUDA)
        unit = _what([it for it, _, _ in plan.values()])  # the progress bar counts "images", "clips" or both
        pace = encode_units(ctx, NAME, unit, todo, encode_image, size=lambda unit: 1,
                            needs_store=lambda unit: stores[unit[0]] is None, reopen=reopen,
                            done_before=len(plan) - len(todo), total=len(plan), prepare=read_image,
                            shard_of=lambda unit: (unit[0], rows[unit[0]][unit[1]] // per_shard[unit[0]]), flush=flush)
    pace["gpu_busy"] = busy.share
    return {"stores": stores, "normalization": norm, "load_skipped": load_skipped, "load_failed": load_failed, "rt": rt,
            "pace": pace}


def _control_posteriors(family: Any, vae: Any, controls: list[Any], size: tuple[int, int],
                        variants: list[aspect_buckets.Variant], bucket: Bucket, device: Any) -> dict[str, Any]:
    """Each control image's posterior, `control_<k>_mean`/`_logvar` (n_variants, C, h, w), as the
    family's pipeline would see it beside each variant of the target (its `control_images`)."""
    from stages.core.host_copies import pinned

    out = {}
    for k, control in enumerate(controls):
        pixels = _to_pixels(family.control_images(control, size, variants, tuple(bucket)))
        pixels = pinned(pixels, device).to(device, non_blocking=True)
        out[f"control_{k}_mean"], out[f"control_{k}_logvar"] = family.encode_posterior(vae, pixels)
    return out


def _check_control_shapes(store: RowStore, posteriors: dict[str, Any], item: dataset.Item, bucket: Bucket) -> None:
    """A bucket's rows stack into one batch, so its controls must share one latent shape."""
    from stages.core.errors import DatasetError

    for name, v in posteriors.items():
        want = tuple(store.group[name].shape[1:]) if name in store.fields else None
        if want != tuple(v.shape):
            k = int(name.split("_")[1])
            raise DatasetError(f"control image '{item.controls[k]}' of '{item.key}' gives latents {tuple(v.shape)}, "
                               f"but the other items of bucket {bucket} have {want}: a batch stacks the controls of "
                               f"one bucket, so give this control the aspect ratio of the other items' controls")


def _write(ctx: Any, cfg: Any, items: list[dataset.Item], plan: dict, by_bucket: dict[Bucket, list[str]],
           encoded: dict[str, Any], skipped: list[tuple[str, str]], duplicates: dict, n_encoded: int,
           layout: dict[str, Any], forced: dict[str, Any] | None, clips: dict[str, ClipInfo],
           planned: dict[str, Any]) -> dict[str, Any]:
    """The manifest (rank 0): every image id whose row is written, by bucket and row; `forced`: what the
    free memory forced (`_forced`), absent otherwise."""
    from stages.core.runtime import peak_vram_gb

    skipped_keys = {key for key, _ in skipped}
    index = {}
    for bucket, ids in sorted(by_bucket.items()):
        store = encoded["stores"][bucket]
        if store is None:
            continue
        rows, written = store.row_of(), store.written_mask()
        index.update({image_id: {"bucket": str(bucket), "row": rows[image_id], "size": list(plan[image_id][1]),
                                 **({"clip": [clips[image_id].frames, clips[image_id].fps]} if image_id in clips else {})}
                      for image_id in ids if plan[image_id][0].key not in skipped_keys and written[rows[image_id]]})
    # Every scanned image counts as an input, skipped ones too (they are listed as skipped):
    # otherwise a run with a skipped image would never be up to date.
    parts = {**layout, "images": sorted({it.latent_key for it in items})}
    n_var, datasets = variants_stored(cfg), cfg.dataset_configs()
    fewer = {i: datasets[it.dataset].cache_variants for i, (it, _, _) in plan.items()
             if i in index and datasets[it.dataset].cache_variants < n_var}
    return write_manifest(
        artifact_dir(cfg), NAME, family=cfg.family, model=cfg.model, fingerprint=fingerprint(parts),
        fingerprint_parts=parts, index=index, items={it.key: it.latent_key for it in items if it.latent_key in index},
        buckets={str(b): len(ids) for b, ids in sorted(by_bucket.items())},
        normalization=encoded["normalization"], variants=n_var, **({"variants_of": fewer} if fewer else {}),
        **({"memory_forced": forced} if forced else {}), **planned,
        skipped=[{"item": k, "reason": r} for k, r in skipped], duplicates=duplicates,
        warnings=[{"item": it.key, "message": note} for it, size, bucket in plan.values()
                  for note in aspect_buckets.size_notes(it.key, size, bucket, cfg.data.max_aspect)],
        encoded_this_run=n_encoded, seconds=ctx.elapsed(), peak_vram_gb=peak_vram_gb(encoded["rt"]),
        world_size=ctx.dist.world_size, **_pace(encoded["pace"]))


def _pace(pace: dict[str, float]) -> dict[str, float]:
    """images_per_second (the encode loop's, rank 0's share times the ranks is the run's), encoder_busy:
    the share of that loop's time the encoder (VAE forward and row write) worked, not waiting on reads, and on a
    CUDA GPU gpu_busy: the share of it in which the GPU ran kernels (NVML's utilization, stages/core/gpu_busy.py)."""
    if not pace["units"] or pace["seconds"] <= 0:
        return {}
    gpu = {"gpu_busy": pace["gpu_busy"]} if pace.get("gpu_busy") is not None else {}
    return {"images_per_second": round(pace["units"] / pace["seconds"], 3),
            "encoder_busy": round(min(1.0, pace["encode_seconds"] / pace["seconds"]), 3), **gpu}


def _tidy(out: Path, by_bucket: dict[Bucket, list[str]]) -> None:
    """Once the manifest is written: drop bucket stores no image uses any more (settings changed)
    and the temp files of killed writers. Only space is freed; nothing the manifest uses is touched."""
    keep = {str(b) for b in by_bucket}
    for group in out.iterdir() if out.is_dir() else []:
        if group.is_dir() and not group.name.startswith(".") and group.name not in keep:
            remove_dir(group)
    sweep_leftovers(out)


def lacks(cfg: Any, manifest: dict[str, Any]) -> list[str]:
    """The images the cache skipped as unreadable (a run with data.on_bad_image = "skip") while `cfg` has
    data.on_bad_image = "error": that setting refuses them, so the cache does not count as up to date and
    its rerun names them as errors."""
    skipped = [s["item"] for s in manifest.get("skipped", [])]
    if cfg.data.on_bad_image != "error" or not skipped:
        return []
    return [f"{listing(skipped)} {'was' if len(skipped) == 1 else 'were'} skipped as unreadable under "
            f"data.on_bad_image = \"skip\", and the run's setting is \"error\": replace or remove "
            f"{'it' if len(skipped) == 1 else 'them'}, or keep skipping with "
            f"`{command(cfg, 'config', '--set', 'data.on_bad_image=skip')}`"]


def damaged_rows(cfg: Any, manifest: dict[str, Any]) -> list[str]:
    """For `status`: rows of the manifest that are damaged (stat only), per bucket, named, with the command."""
    out, keys = artifact_dir(cfg), keys_by_id(manifest["items"])
    reasons = []
    for name in manifest["buckets"]:
        referenced = {i: loc["row"] for i, loc in manifest["index"].items() if loc["bucket"] == name}
        store = RowStore.open(out / name) if (out / name / "zarr.json").exists() else None
        reasons += damage_report(store, referenced, keys, f"{out.name}/{name}", command(cfg, NAME)) if referenced else []
    return reasons
