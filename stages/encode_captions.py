"""Stage 1: captions -> artifacts/<run>/captions.zarr. Loads only tokenizers and text encoders.

    python pipeline.py encode-captions --config configs/flux-dev.toml

One row per distinct caption text, keyed by its content id. Incremental: rows already written for
the same encoder and settings are kept, so editing one caption encodes one caption, and a killed
run resumes where it stopped (a row's `written` flag is set only after its arrays are on disk).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.core import dataset, distributed
from stages.core import faults
from stages.core.artifacts import RowStore, dir_bytes, fingerprint, sweep_leftovers, write_manifest
from stages.core.model_source import ModelSource
from stages.core.stage import running_stage

NAME = "encode-captions"


def artifact_dir(cfg: Any) -> Path:
    return cfg.run_dir / "captions.zarr"


def resolved_precision(cfg: Any) -> str:
    """The text encoders' precision as this stage will run them (on cfg.device, not merely any GPU)."""
    from stages.core import memory
    from stages.core.runtime import pick_device, resolve_precision
    from stages.families import get_family

    planned = memory.planned_caption_precision(cfg, get_family(cfg.family))  # memory: "auto" under a GPU budget is the planner's choice
    return planned or resolve_precision(cfg.captions.text_encoder_precision, pick_device(cfg.device), "text_encoder")


def layout_parts(cfg: Any) -> dict[str, Any]:
    """What every row depends on; a change here rebuilds the store."""
    from stages.families import get_family

    family = get_family(cfg.family)
    src = ModelSource(cfg.model, cfg.revision)
    return {"family": cfg.family, "model": src.identity(family.text_components),
            "max_sequence_length": cfg.captions.max_sequence_length,
            "precision": resolved_precision(cfg)}


def fingerprint_parts(cfg: Any) -> dict[str, Any]:
    items = dataset.scan_data(cfg.data)
    return {**layout_parts(cfg), "captions": sorted({it.caption_id for it in items})}


def _open_store(path: Path, layout: dict[str, Any]) -> RowStore | None:
    """The existing store if it was made with the same layout, else None (rebuild)."""
    if not (path / "zarr.json").exists():
        return None
    store = RowStore.open(path, mode="a")
    return store if store.group.attrs.get("layout") == fingerprint(layout) else None


def run(cfg: Any) -> dict[str, Any]:
    import torch

    from stages.core import memory
    from stages.core.runtime import install_model_trace, make_runtime, peak_vram_gb, reset_peak
    from stages.families import get_family

    install_model_trace(NAME)
    with running_stage(cfg, NAME) as ctx:
        family = get_family(cfg.family)
        cfg, _ = memory.plan_stage(cfg, family, NAME, ctx.log)  # the budget's precision and batch size
        items = dataset.scan_data(cfg.data, ctx.log)
        texts = {it.caption_id: it.caption for it in items}
        parts = {**layout_parts(cfg), "captions": sorted(texts)}
        out = artifact_dir(cfg)
        layout = {k: v for k, v in parts.items() if k != "captions"}
        dist = ctx.dist
        with distributed.main_first(dist):  # rank 0 grows the store before the others read it
            store = _open_store(out, layout)
            todo_ids = [cid for cid in sorted(texts)]
            if store is not None:
                done = {cid for cid, ok in zip(store.ids, store.written_mask()) if ok}
                todo_ids = [cid for cid in todo_ids if cid not in done]
                missing = [cid for cid in todo_ids if cid not in set(store.ids)]
                if missing and dist.is_main:
                    store.append_rows(missing)
        ctx.log.emit("preparing", done=len(texts) - len(todo_ids), total=len(texts), encoded=0)
        # Ranks deal out whole batches, so each batch is encoded exactly as one process would
        # (same composition and padding: byte-identical rows). With no store yet, rank 0 first
        # encodes one batch alone to learn the field shapes and create the store.
        bs = cfg.captions.batch_size
        batches = [todo_ids[i:i + bs] for i in range(0, len(todo_ids), bs)]
        seed = batches[:1] if store is None and dist.is_distributed else []
        mine = (seed if dist.is_main else []) + distributed.shard(batches[len(seed):], dist, first=len(seed))

        src = ModelSource(cfg.model, cfg.revision)
        rt = make_runtime(cfg.device, "auto")
        reset_peak(rt)
        encoder = None
        # with the same settings, captions truncated by earlier runs stay listed
        earlier = _earlier_truncations(out) if store is not None else {}
        truncated: dict[str, int] = {cid: n for cid, n in earlier.items() if cid in texts}
        if mine:
            src.check(family.text_components)
            ctx.log.emit("loading", component="text encoders")
            encoder = family.load_text_encoder(src, cfg.captions, rt)
            ctx.log.emit("loaded", component="text encoders", seconds=ctx.elapsed())
        encoded_here = 0

        def encode_batch(batch: list[str], store: RowStore | None) -> RowStore:
            nonlocal encoded_here
            batch_texts = [texts[c] for c in batch]
            with torch.no_grad():
                encoded = encoder.encode(batch_texts)
            if store is None:
                fields = {k: (tuple(v.shape[1:]), _dtype_name(v.dtype)) for k, v in encoded.items()}
                store = RowStore.create(out, sorted(texts), fields)
                store.group.attrs["layout"] = fingerprint(layout)
            row_of = {cid: r for r, cid in enumerate(store.ids)}
            for i, cid in enumerate(batch):
                store.write_row(row_of[cid], {k: v[i] for k, v in encoded.items()})
                faults.hit(NAME)
            for cid, n in zip(batch, encoder.token_counts(batch_texts)):
                if n > cfg.captions.max_sequence_length:
                    truncated[cid] = n
            bar.advance(len(batch))
            encoded_here += len(batch)
            # Rank 0 reports for the job, assuming ranks keep the same pace.
            est = min(len(todo_ids), encoded_here * dist.world_size)
            ctx.log.emit("preparing", done=len(texts) - len(todo_ids) + est, total=len(texts), encoded=est)
            return store

        with distributed.progress(dist, "encode-captions", sum(map(len, mine)), "captions") as bar:
            with distributed.main_first(dist):
                for batch in mine[:len(seed)] if dist.is_main else []:
                    store = encode_batch(batch, store)
            if store is None and seed:
                store = _open_store(out, layout)  # made by rank 0 just now
            for batch in mine[len(seed) if dist.is_main else 0:]:
                store = encode_batch(batch, store)
        distributed.barrier(dist)  # every rank's rows are on disk: rank 0 writes the manifest
        truncated = {c: n for part in distributed.all_gather(truncated, dist) for c, n in part.items()}
        if not dist.is_main:
            del encoder
            return {"stage": NAME, "rank": dist.rank, "encoded_this_run": len(todo_ids)}
        for cid, n in truncated.items():
            keys = [it.key for it in items if it.caption_id == cid]
            ctx.log.emit("warning", message=f"caption of '{keys[0]}' has {n} tokens; truncated to "
                         f"{cfg.captions.max_sequence_length}, the rest is ignored: shorten it or raise "
                         f"captions.max_sequence_length", item=keys[0])
        assert store is not None
        sweep_leftovers(out)  # temp files of killed writers: space only, never read
        row_of = {cid: r for r, cid in enumerate(store.ids)}
        manifest = write_manifest(
            out, NAME, family=cfg.family, model=cfg.model, fingerprint=fingerprint(parts), fingerprint_parts=parts,
            rows={cid: row_of[cid] for cid in sorted(texts)}, texts=texts,
            items={it.key: it.caption_id for it in items},
            fields={k: {"shape": list(store.group[k].shape[1:]), "dtype": store.group[k].attrs["logical_dtype"]}
                    for k in store.fields},
            encoded_this_run=len(todo_ids), world_size=dist.world_size,
            truncated={it.key: truncated[it.caption_id] for it in items if it.caption_id in truncated},
            bytes_on_disk=dir_bytes(out), seconds=ctx.elapsed(), peak_vram_gb=peak_vram_gb(rt))
        ctx.log.emit("done", seconds=ctx.elapsed(), encoded=len(todo_ids), total=len(texts))
        del encoder
        return manifest


def _earlier_truncations(out: Path) -> dict[str, int]:
    """caption id -> token count of captions truncated by earlier runs into this same store, so an
    incremental run keeps listing them."""
    from stages.core.artifacts import read_manifest

    m = read_manifest(out) or {}
    return {m["items"][key]: n for key, n in m.get("truncated", {}).items() if key in m.get("items", {})}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def load_captions(cfg: Any) -> tuple[RowStore, dict[str, Any]]:
    """The caption store and its manifest, for train (refuses if missing)."""
    from stages.core.artifacts import require_manifest

    out = artifact_dir(cfg)
    manifest = require_manifest(out, f"encode-captions --config <your config>  (run '{cfg.run}')")
    return RowStore.open(out), manifest
