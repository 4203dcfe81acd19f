"""Stage 1: captions -> artifacts/<run>/captions.zarr. Loads only tokenizers and text encoders.

    python pipeline.py encode-captions --config configs/flux-dev.toml

One row per distinct caption text, keyed by its content id. Incremental: rows already written for
the same encoder and settings are kept, so editing one caption encodes one caption, and a killed
run resumes where it stopped (a row's `written` flag is set only after its arrays are on disk).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.core import dataset
from stages.core.artifacts import RowStore, dir_bytes, fingerprint, write_manifest
from stages.core.model_source import ModelSource
from stages.core.stage import running_stage

NAME = "encode-captions"


def artifact_dir(cfg: Any) -> Path:
    return cfg.run_dir / "captions.zarr"


def resolved_precision(precision: str) -> str:
    if precision != "auto":
        return precision
    import torch

    return "bf16" if torch.cuda.is_available() else "fp32"


def layout_parts(cfg: Any) -> dict[str, Any]:
    """What every row depends on; a change here rebuilds the store."""
    from stages.families import get_family

    family = get_family(cfg.family)
    src = ModelSource(cfg.model, cfg.revision)
    return {"family": cfg.family, "model": src.identity(family.text_components),
            "max_sequence_length": cfg.captions.max_sequence_length,
            "precision": resolved_precision(cfg.captions.text_encoder_precision)}


def fingerprint_parts(cfg: Any) -> dict[str, Any]:
    items = dataset.scan(cfg.data.path, cfg.data.caption_ext)
    return {**layout_parts(cfg), "captions": sorted({it.caption_id for it in items})}


def _open_store(path: Path, layout: dict[str, Any]) -> RowStore | None:
    """The existing store if it was made with the same layout, else None (rebuild)."""
    if not (path / "zarr.json").exists():
        return None
    store = RowStore.open(path, mode="a")
    return store if store.group.attrs.get("layout") == fingerprint(layout) else None


def run(cfg: Any) -> dict[str, Any]:
    import torch

    from stages.core.events import Progress
    from stages.core.runtime import install_model_trace, make_runtime, peak_vram_gb, reset_peak
    from stages.families import get_family

    install_model_trace()
    with running_stage(cfg, NAME) as ctx:
        family = get_family(cfg.family)
        items = dataset.scan(cfg.data.path, cfg.data.caption_ext)
        texts = {it.caption_id: it.caption for it in items}
        parts = {**layout_parts(cfg), "captions": sorted(texts)}
        out = artifact_dir(cfg)
        store = _open_store(out, {k: v for k, v in parts.items() if k != "captions"})
        todo_ids = [cid for cid in sorted(texts)]
        if store is not None:
            done = {cid for cid, ok in zip(store.ids, store.written_mask()) if ok}
            todo_ids = [cid for cid in todo_ids if cid not in done]
        ctx.log.emit("preparing", done=len(texts) - len(todo_ids), total=len(texts), encoded=0)

        src = ModelSource(cfg.model, cfg.revision)
        rt = make_runtime(cfg.device, "auto")
        reset_peak(rt)
        encoder = None
        truncated: dict[str, int] = {}
        if todo_ids:
            src.check(family.text_components)
            ctx.log.emit("loading", component="text encoders")
            encoder = family.load_text_encoder(src, cfg.captions, rt)
            ctx.log.emit("loaded", component="text encoders", seconds=ctx.elapsed())
        bs = cfg.captions.batch_size
        with Progress("encode-captions", len(todo_ids), "captions") as bar:
            for start in range(0, len(todo_ids), bs):
                batch = todo_ids[start:start + bs]
                batch_texts = [texts[c] for c in batch]
                with torch.no_grad():
                    encoded = encoder.encode(batch_texts)
                if store is None:
                    fields = {k: (tuple(v.shape[1:]), _dtype_name(v.dtype)) for k, v in encoded.items()}
                    store = RowStore.create(out, sorted(texts), fields)
                    store.group.attrs["layout"] = fingerprint({k: v for k, v in parts.items() if k != "captions"})
                missing = [c for c in batch if c not in store.ids]
                if missing:
                    store.append_rows(missing)
                row_of = {cid: r for r, cid in enumerate(store.ids)}
                for i, cid in enumerate(batch):
                    store.write_row(row_of[cid], {k: v[i] for k, v in encoded.items()})
                for cid, n in zip(batch, encoder.token_counts(batch_texts)):
                    if n > cfg.captions.max_sequence_length:
                        truncated[cid] = n
                bar.advance(len(batch))
                ctx.log.emit("preparing", done=len(texts) - len(todo_ids) + start + len(batch), total=len(texts),
                             encoded=start + len(batch))
        for cid, n in truncated.items():
            keys = [it.key for it in items if it.caption_id == cid]
            ctx.log.emit("warning", message=f"caption of {keys[0]} has {n} tokens; truncated to "
                         f"{cfg.captions.max_sequence_length} (captions.max_sequence_length)", item=keys[0])
        assert store is not None
        row_of = {cid: r for r, cid in enumerate(store.ids)}
        manifest = write_manifest(
            out, NAME, family=cfg.family, model=cfg.model, fingerprint=fingerprint(parts), fingerprint_parts=parts,
            rows={cid: row_of[cid] for cid in sorted(texts)}, texts=texts,
            items={it.key: it.caption_id for it in items},
            fields={k: {"shape": list(store.group[k].shape[1:]), "dtype": store.group[k].attrs["logical_dtype"]}
                    for k in store.fields},
            encoded_this_run=len(todo_ids), truncated={c: n for c, n in truncated.items()},
            bytes_on_disk=dir_bytes(out), seconds=ctx.elapsed(), peak_vram_gb=peak_vram_gb(rt))
        ctx.log.emit("done", seconds=ctx.elapsed(), encoded=len(todo_ids), total=len(texts))
        del encoder
        return manifest


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def load_captions(cfg: Any) -> tuple[RowStore, dict[str, Any]]:
    """The caption store and its manifest, for train (refuses if missing)."""
    from stages.core.artifacts import require_manifest

    out = artifact_dir(cfg)
    manifest = require_manifest(out, f"encode-captions --config <your config>  (run '{cfg.run}')")
    return RowStore.open(out), manifest
