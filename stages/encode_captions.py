"""Stage 1: captions -> artifacts/<run>/captions.zarr. Loads only tokenizers and text encoders.

    lorapipe encode-captions --config configs/flux-dev.toml

One row per distinct caption text, keyed by its content id. Incremental: rows already written for
the same encoder and settings are kept, so editing one caption encodes one caption, and a killed
run resumes where it stopped (a row's `written` flag is set only after its arrays are on disk).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.core import dataset, distributed, image_io, validation
from stages.core import faults
from stages.core.artifacts import fingerprint, read_manifest, remove_dir, sweep_leftovers, write_manifest
from stages.core.cache_build import damage_report, encode_units, keys_by_id, rows_to_encode
from stages.core.config import command
from stages.core.caches import captions_dir, load_captions, scan_items as scan_family_items  # noqa: F401 - load_captions: still importable from here
from stages.core.model_source import model_source
from stages.core.rowstore import RowStore, new_rows_per_shard
from stages.core.stage import running_stage
from stages.registry import conflicts

NAME = "encode-captions"


def scan_items(cfg: Any, log: Any = None) -> list[dataset.Item]:
    """The run's items as its family trains them (stages.core.caches.scan_items), with image ids only
    where the caption rows depend on the images (`needs_image_ids`): otherwise no image is read."""
    from stages.families import get_family

    family = get_family(cfg.family)
    return scan_family_items(cfg, family, log, ids=needs_image_ids(cfg, family))


def needs_image_ids(cfg: Any, family: Any) -> bool:
    """Whether the caption rows depend on image bytes: a text encoder that sees the control images
    (rows keyed by them), or caption dropout with a validation split (the split picks held-out items,
    which keep their caption, by image id). Tag shuffles seeded by the image id are scan_run's to see."""
    dropout = any(d.caption_dropout > 0 for d in cfg.dataset_configs()) or cfg.train.preservation == "blank_prompt"
    return family.text_sees_controls or (dropout and cfg.validation.split > 0 and not cfg.validation.path)


def artifact_dir(cfg: Any) -> Path:
    return captions_dir(cfg)


def resolved_precision(cfg: Any) -> str:
    """The text encoders' precision as this stage will run them (on cfg.device, not merely any GPU)."""
    from stages.core import memory
    from stages.core.runtime import device_type, resolve_precision
    from stages.families import get_family

    planned = memory.planned_caption_precision(cfg, get_family(cfg.family))  # "auto" under a GPU budget is the planner's choice
    return planned or resolve_precision(cfg.captions.text_encoder_precision, device_type(cfg.device), "text_encoder")


def layout_parts(cfg: Any) -> dict[str, Any]:
    """What every row depends on; a change here rebuilds the store."""
    from stages.families import get_family

    family = get_family(cfg.family)
    src = model_source(cfg)
    return {"family": cfg.family, "model": src.identity(family.text_components),
            "max_sequence_length": cfg.captions.max_sequence_length,
            "precision": resolved_precision(cfg)}


def fingerprint_parts(cfg: Any) -> dict[str, Any]:
    return {**layout_parts(cfg), "captions": sorted(caption_texts(cfg, scan_items(cfg)))}


def describe_change(cfg: Any, manifest: dict[str, Any], key: str, old: Any, new: Any) -> str:
    """A change of the captions, by the images whose caption changed (status names files, not ids)."""
    from stages.core.stage import changed_items, describe_change as plain

    if key != "captions":
        return plain(key, old, new)
    return changed_items(manifest.get("items", {}), {it.key: it.caption_id for it in scan_items(cfg)}, "caption")


EMPTY_CAPTION = ""  # what caption dropout trains on; its row is cached like any other caption's


def dropout_rows(cfg: Any, items: list[dataset.Item]) -> dict[str, str]:
    """item key -> its empty caption's row id, for each training item whose dataset has
    caption_dropout > 0 (every item with train.preservation = "blank_prompt"): one shared row, or one per
    control set for a family whose text encoder sees the controls (held-out items never drop their caption)."""
    blank = cfg.train.preservation == "blank_prompt"
    dropping = {i for i, d in enumerate(cfg.dataset_configs()) if d.caption_dropout > 0 or blank}
    if not dropping:
        return {}
    return {it.key: it.empty_caption_id for it in validation.partition(cfg, items)[0] if it.dataset in dropping}


def caption_texts(cfg: Any, items: list[dataset.Item]) -> dict[str, str]:
    """caption id -> text of every row the run needs: each item's caption variants, and the empty
    caption (dropout_rows) of the items that drop theirs."""
    texts = {cid: text for it in items for cid, text in zip(it.caption_ids, it.texts)}
    texts.update({cid: EMPTY_CAPTION for cid in dropout_rows(cfg, items).values()})
    return texts


def row_controls(items: list[dataset.Item]) -> dict[str, tuple]:
    """caption id -> the control images its row is encoded with (its item's; rows keyed by them)."""
    return {cid: it.controls for it in items for cid in (*it.caption_ids, it.empty_caption_id)}


def row_owners(items: list[dataset.Item]) -> dict[str, str]:
    """caption id -> the key of an item it belongs to, for messages."""
    return {cid: it.key for it in reversed(items) for cid in (it.empty_caption_id, *it.caption_ids)}


def _open_store(path: Path, layout: dict[str, Any]) -> RowStore | None:
    """The existing store if it was made with the same layout (and carries checksums), else None (rebuild)."""
    if not (path / "zarr.json").exists():
        return None
    store = RowStore.open(path, mode="a")
    return store if store.group.attrs.get("layout") == fingerprint(layout) and store.is_current else None


def check(cfg: Any) -> None:
    """Everything this stage needs that a config can get wrong, before it deletes or loads anything:
    the model folder's text components and the encoders' precision on this device."""
    from stages.core.runtime import make_runtime, require_cuda_for_nf4
    from stages.families import get_family

    model_source(cfg).check(get_family(cfg.family).text_components, get_family(cfg.family))
    require_cuda_for_nf4("captions.text_encoder_precision", resolved_precision(cfg), make_runtime(cfg.device, "auto"))


def run(cfg: Any, force: bool = False) -> dict[str, Any]:
    from stages.core import memory
    from stages.core.runtime import install_model_trace, make_runtime
    from stages.families import library_notices
    from stages.families import get_family

    install_model_trace(NAME, library_notices())
    with running_stage(cfg, NAME, beside=conflicts(NAME)) as ctx:
        # the plan the fingerprint asks for, recorded for later checks of this config (memory.recorded_plan)
        planned = memory.recorded_plan(cfg, get_family(cfg.family), NAME)
        cfg, plan = memory.plan_stage(cfg, get_family(cfg.family), NAME, ctx.log)  # the budget's precision and batch size
        check(cfg)
        rt = memory.text_encoder_runtime(plan, make_runtime(cfg.device, "auto"))  # layer offload: placement only
        if force and ctx.dist.is_main:
            remove_dir(artifact_dir(cfg))  # only now that the config is known to work
        items = scan_items(cfg, ctx.log)
        texts = caption_texts(cfg, items)
        layout = layout_parts(cfg)
        out = artifact_dir(cfg)
        index = _index(cfg, items, texts)
        existing = None if force else read_manifest(out)
        if existing is not None and _up_to_date(cfg, existing, index, planned):
            ctx.log.emit("up_to_date", fingerprint=existing["fingerprint"],
                         notes=[f"every caption is encoded with these settings; `{command(cfg, NAME, '--force')}` "
                                f"encodes them again"])
            return {**existing, "encoded_this_run": 0, "up_to_date": True}
        with distributed.main_first(ctx.dist):  # rank 0 grows the store before the others read it
            store = _open_store(out, layout)
            todo_ids = rows_to_encode(store, sorted(texts), grow=ctx.dist.is_main)
        ctx.log.emit("preparing", done=len(texts) - len(todo_ids), total=len(texts), encoded=0)
        encoded = _encode(ctx, cfg, rt, texts, todo_ids, store, layout, row_controls(items), existing, plan)
        if not ctx.dist.is_main:
            return {"stage": NAME, "rank": ctx.dist.rank, "encoded_this_run": len(todo_ids)}
        manifest = _write(ctx, cfg, items, texts, index, encoded, len(todo_ids), planned)
        ctx.log.emit("done", seconds=ctx.elapsed(), encoded=len(todo_ids), total=len(texts))
        return manifest


def _encode(ctx: Any, cfg: Any, rt: Any, texts: dict[str, str], todo_ids: list[str], store: RowStore | None,
            layout: dict[str, Any], controls: dict[str, tuple], earlier_manifest: dict[str, Any] | None,
            plan: Any = None) -> dict[str, Any]:
    """Encode the rows in `todo_ids` (ranks deal out whole batches) with the encoders loaded on `rt`
    (memory.text_encoder_runtime); -> store, truncated, runtime. `earlier_manifest`: the cache's manifest
    before this run (None: none, or --force), whose truncated captions stay listed.
    A family whose text encoder sees the control images (`text_sees_controls`) gets them too: its
    rows are keyed by (caption, controls). Where the family's encoders read a batch at its longest caption,
    the batch size is the largest the memory `plan` allows for the longest caption to encode
    (memory.captions.batch_for_captions)."""
    import torch

    from stages.core.runtime import reset_peak
    from stages.families import get_family

    family, dist, out = get_family(cfg.family), ctx.dist, artifact_dir(cfg)
    # Ranks deal out whole batches, so each batch is encoded exactly as one process would (same
    # composition and padding: byte-identical rows).
    # A batch stays inside one shard of the store, so that each shard has one writer (RowStore).
    rows = store.row_of() if store is not None else {cid: k for k, cid in enumerate(sorted(texts))}
    per_shard = store.rows_per_shard if store is not None else new_rows_per_shard()
    reset_peak(rt)
    # with the same settings, captions truncated by earlier runs stay listed
    earlier = _earlier_truncations(earlier_manifest) if store is not None else {}
    state = {"store": store, "encoder": None,
             "truncated": {cid: n for cid, n in earlier.items() if cid in texts}}

    def load() -> Any:
        if state["encoder"] is None:
            ctx.log.emit("loading", component="text encoders")
            state["encoder"] = family.load_text_encoder(model_source(cfg), cfg.captions, rt)
            ctx.log.emit("loaded", component="text encoders", seconds=ctx.elapsed())
            state["template_tokens"] = template_tokens(family, state["encoder"], cfg.captions.max_sequence_length)
        return state["encoder"]

    counted = _token_counts(family, plan, load, {c: texts[c] for c in todo_ids})  # {} where the batch stays as planned
    size = _batch_size(ctx, cfg, family, plan, max(counted.values(), default=0))
    batches = shard_batches(todo_ids, size, lambda cid: rows[cid] // per_shard)

    def encode_batch(batch: list[str]) -> None:
        load()
        batch_texts = [texts[c] for c in batch]
        with torch.no_grad():
            if family.text_sees_controls:
                images = [[image_io.load_image(p, cfg.data.background) for p in controls[c]] for c in batch]
                encoded = state["encoder"].encode(batch_texts, controls=images)
            else:
                encoded = state["encoder"].encode(batch_texts)
        if state["store"] is None:
            fields = {k: (tuple(v.shape[1:]), _dtype_name(v.dtype)) for k, v in encoded.items()}
            state["store"] = RowStore.create(out, sorted(texts), fields)
            state["store"].group.attrs["layout"] = fingerprint(layout)
        if "row_of" not in state:
            state["row_of"] = state["store"].row_of()
        row_of = state["row_of"]
        for i, cid in enumerate(batch):
            state["store"].journal_row(row_of[cid], {k: v[i] for k, v in encoded.items()})
            faults.hit(NAME)
        for cid, n in zip(batch, [counted[c] for c in batch] if counted else state["encoder"].token_counts(batch_texts)):
            if n > cfg.captions.max_sequence_length:
                state["truncated"][cid] = n

    def reopen() -> None:
        state["store"] = state["store"] or _open_store(out, layout)  # made by rank 0 just now

    def flush() -> None:
        if state["store"] is not None:
            state["store"].flush()

    encode_units(ctx, NAME, "captions", batches, encode_batch, size=len, needs_store=lambda b: state["store"] is None,
                 reopen=reopen, done_before=len(texts) - len(todo_ids), total=len(texts),
                 shard_of=lambda batch: rows[batch[0]] // per_shard, flush=flush)
    truncated = {c: n for part in distributed.all_gather(state["truncated"], dist) for c, n in part.items()}
    state.pop("encoder")
    return {"store": state["store"], "truncated": truncated, "rt": rt, "template_tokens": state.get("template_tokens")}


def _token_counts(family: Any, plan: Any, load: Any, todo: dict[str, str]) -> dict[str, int]:
    """Each caption to encode's tokens (id -> count, counted with the loaded encoder's tokenizer) where the family's
    encoders read a batch at its longest caption, so the batch size can follow them (`_batch_size`); else {}."""
    if plan is None or not todo or not family.text_padded_to_longest or family.text_sees_controls:
        return {}
    return dict(zip(todo, load().token_counts(list(todo.values()))))


def _batch_size(ctx: Any, cfg: Any, family: Any, plan: Any, longest: int) -> int:
    """captions.batch_size as planned, or larger where the longest caption to encode (`longest` tokens; 0: not
    counted) is shorter than the plan assumed (memory.captions.batch_for_captions): said in an info line, and the
    plan it encodes with logged after the first."""
    from stages.core import memory

    planned = cfg.captions.batch_size
    if not longest:
        return planned
    grown = memory.captions.batch_for_captions(cfg, family, model_source(cfg), plan, longest)
    size = grown.settings.get("batch_size", planned)
    if size != planned:
        ctx.log.emit("plan", **grown.to_dict())
        ctx.log.emit("info", message=f"encoding in batches of {size}: the longest caption to encode has {longest} tokens, "
                                     f"and the plan's batch of {planned} is for {cfg.captions.max_sequence_length} "
                                     f"(captions.max_sequence_length)")
    return size


def shard_batches(ids: list[str], size: int, shard_of: Any) -> list[list[str]]:
    """`ids` cut into batches of at most `size`, a new batch wherever `shard_of` changes."""
    batches: list[list[str]] = []
    for cid in ids:
        if not batches or len(batches[-1]) == size or shard_of(batches[-1][0]) != shard_of(cid):
            batches.append([])
        batches[-1].append(cid)
    return batches


def template_tokens(family: Any, encoder: Any, max_length: int) -> int:
    """The tokens the family's prompt template takes before any caption (an empty caption's count);
    a ConfigError where they leave no room for the caption: every caption would be cut away whole and
    the LoRA trained on the template alone (FLUX.2's template holds a 30-word system message before every
    caption, and counts against the limit as the pipeline does)."""
    from stages.core.errors import ConfigError

    if family.text_sees_controls:  # its counts are of the last encode's rows, controls included
        return 0
    n = encoder.token_counts([""])[0]
    if n >= max_length:
        raise ConfigError(f"captions.max_sequence_length = {max_length} leaves no token for the captions: "
                          f"{family.name}'s prompt template alone takes {n}; raise it well above {n} (the "
                          f"family's preset in configs/ has the pipeline's own value)")
    return n


def _index(cfg: Any, items: list[dataset.Item], texts: dict[str, str]) -> dict[str, Any]:
    """What the manifest records of `items` besides their rows: the fingerprint over the layout and the captions,
    each item's caption id, and (only where a dataset has them) caption variants and the dropout rows."""
    parts = {**layout_parts(cfg), "captions": sorted(texts)}
    index: dict[str, Any] = {"fingerprint": fingerprint(parts), "fingerprint_parts": parts,
                             "items": {it.key: it.caption_id for it in items}}
    if any(it.captions for it in items):
        index["variants"] = {it.key: list(it.caption_ids) for it in items if it.captions}
    shared = dataset.caption_id(EMPTY_CAPTION)
    if shared in texts:
        index["empty_caption"] = shared
    own = {key: cid for key, cid in dropout_rows(cfg, items).items() if cid != shared}
    if own:  # a family whose text encoder sees the controls: each item's own (empty, controls) row
        index["empty_captions"] = own
    return index


def _up_to_date(cfg: Any, manifest: dict[str, Any], index: dict[str, Any], planned: dict[str, Any]) -> bool:
    """Whether the complete cache of `manifest` already holds what `index` (and the recorded plan) describe, with
    no row damaged: then the stage loads no encoder and rewrites nothing."""
    wanted = {**{k: v for k, v in index.items() if k != "fingerprint_parts"}, **planned}
    extras = ("variants", "empty_caption", "empty_captions")
    return (manifest.get("complete", True)
            and all(json.loads(json.dumps(v)) == manifest.get(k) for k, v in wanted.items())
            and not any(k in manifest and k not in wanted for k in extras)
            and not damaged_rows(cfg, manifest))


def _write(ctx: Any, cfg: Any, items: list[dataset.Item], texts: dict[str, str], index: dict[str, Any],
           encoded: dict[str, Any], n_encoded: int, planned: dict[str, Any]) -> dict[str, Any]:
    """Warn about truncated captions and write the manifest (rank 0)."""
    from stages.core.runtime import peak_vram_gb

    store, truncated = encoded["store"], encoded["truncated"]
    owners = row_owners(items)
    template = encoded.get("template_tokens") or 0
    with_template = f" with the prompt template ({template} of them)" if template > 2 else ""  # > BOS and EOS
    for cid, n in truncated.items():
        key = owners[cid]
        what, fix = (("the empty caption (caption dropout) of", "smaller control images") if texts[cid] == EMPTY_CAPTION
                     else ("caption of", "shorten it"))
        ctx.log.emit("warning", message=f"{what} '{key}' has {n} tokens{with_template}; truncated to "
                     f"{cfg.captions.max_sequence_length}, the rest is ignored: {fix} or raise "
                     f"captions.max_sequence_length", item=key)
    assert store is not None
    out = artifact_dir(cfg)
    sweep_leftovers(out)  # temp files of killed writers: space only, never read
    row_of = store.row_of()
    return write_manifest(
        out, NAME, family=cfg.family, model=cfg.model, **index,
        rows={cid: row_of[cid] for cid in index["fingerprint_parts"]["captions"]},
        lengths={cid: len(text) for cid, text in texts.items()},
        fields={k: {"shape": list(store.group[k].shape[1:]), "dtype": store.group[k].attrs["logical_dtype"]}
                for k in store.fields},
        encoded_this_run=n_encoded, world_size=ctx.dist.world_size,
        truncated={it.key: max(truncated[c] for c in it.caption_ids if c in truncated) for it in items
                   if any(c in truncated for c in it.caption_ids)}, **planned,
        seconds=ctx.elapsed(), peak_vram_gb=peak_vram_gb(encoded["rt"]))


def damaged_rows(cfg: Any, manifest: dict[str, Any]) -> list[str]:
    """For `status`: rows of the manifest that are damaged (stat only), named, with the command."""
    out = artifact_dir(cfg)
    store = RowStore.open(out) if (out / "zarr.json").exists() else None
    return damage_report(store, manifest["rows"], keys_by_id(manifest["items"]), out.name, command(cfg, NAME))


def _earlier_truncations(manifest: dict[str, Any] | None) -> dict[str, int]:
    """caption id -> token count of captions truncated by earlier runs into this same store (their `manifest`),
    so an incremental run keeps listing them."""
    m = manifest or {"items": {}, "truncated": {}}
    return {m["items"][key]: n for key, n in m["truncated"].items() if key in m["items"]}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")
