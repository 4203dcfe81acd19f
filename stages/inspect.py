"""Offline report of a run's artifacts; no GPU and no model weights needed.

    lorapipe inspect demo                     # rich tables
    lorapipe inspect demo --json              # the same report for machines
    lorapipe inspect demo --decode shapes/03.png --variant 2 [--sample --seed 1] --out x.png

Reads the manifests and zarr stores of artifacts/<run>/: items, buckets, variants, shapes and
dtypes, bytes on disk, per-channel latent statistics beside the family's normalization (after which
a well-matched VAE gives mean ~0 and std ~1 per channel), NaN/Inf counts, orphaned rows (in a store,
referenced by no manifest: left behind by edited captions or removed images) and missing ones, stale
stages and why, the caption text of each caption row, the train manifest's hyper-parameters.
Statistics read at most `--rows` rows per store (evenly spaced) so a large cache reports quickly.

`--decode` is the one part that loads weights: the VAE alone (on CPU if no GPU), to turn one cached
variant (its posterior mean, or with --sample a draw mean + exp(logvar/2) * eps) back into pixels.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from stages.core.errors import UserError
from stages.core.runspec import command_for
from stages.core.artifacts import dir_bytes, read_json, read_manifest
from stages.core.rowstore import DamagedRows, RowStore
from stages.core.schema import control_count
from stages.core.events import read_events



class InspectError(UserError):
    """A run, item or variant the user named does not exist; the message lists what does."""


def run_config(run_dir: Path, config: Any = None) -> Any:
    """The run's resolved config: as given, or as saved beside the artifacts (config.json)."""
    if config is not None:
        return config
    saved = run_dir / "config.json"
    if not saved.is_file():
        return None
    from stages.core.config import build_config
    from stages.core.runspec import read_saved

    return build_config(read_saved(saved), str(saved))


def sample_rows(n: int, limit: int) -> list[int]:
    """At most `limit` row indices, evenly spaced over n (all of them when n <= limit)."""
    if n <= limit:
        return list(range(n))
    if limit == 1:
        return [0]
    return sorted({int(round(i * (n - 1) / (limit - 1))) for i in range(limit)})


def verified_rows(store: RowStore, limit: int, names: list[str]) -> tuple[list[int], dict[str, np.ndarray], list[str]]:
    """Up to `limit` rows (evenly spaced), each checked against its checksum: (rows read, their
    arrays of `names`, ids of every damaged row: not intact anywhere, or failing its checksum here)."""
    ids, intact = store.ids, store.intact_mask()
    damaged = [ids[r] for r in np.flatnonzero(~intact & store.written_mask())]
    candidates = [int(r) for r in np.flatnonzero(intact)]
    rows, read = [], []
    for r in [candidates[k] for k in sample_rows(len(candidates), limit)]:
        try:
            read.append(store.read_row(r, names))
            rows.append(r)
        except DamagedRows:
            damaged.append(ids[r])
    data = {name: np.stack([row[name] for row in read]) for name in names} if read else {}
    return rows, data, sorted(damaged)


def nonfinite(array: np.ndarray) -> dict[str, int]:
    return {"nan": int(np.isnan(array).sum()), "inf": int(np.isinf(array).sum())}


# ---- sections ------------------------------------------------------------------------------------


def stages_section(cfg: Any) -> dict[str, Any]:
    """Each stage up to date, stale or blocked, and why: the states `status` shows (registry.states)."""
    from stages import registry

    out = {}
    for name, rows in registry.states(cfg).items():
        reasons = list(rows[0].reasons) if len(rows) == 1 else [
            f"expert {row.expert}: {reason}" for row in rows for reason in row.reasons]
        out[name] = {"up_to_date": all(row.up_to_date for row in rows), "blocked": any(row.blocked for row in rows),
                     "reasons": reasons}
    return out


def captions_section(run_dir: Path, limit: int, cfg: Any = None) -> dict[str, Any]:
    path = run_dir / "captions.zarr"
    manifest = read_manifest(path)
    if manifest is None:
        return {"present": path.exists(), "complete": False, "hint": f"run `{command_for(run_dir, 'encode-captions')}`"}
    store = RowStore.open(path)
    ids, written = store.ids, store.written_mask()
    rows = manifest["rows"]
    of_item = {k: manifest.get("variants", {}).get(k, [c]) for k, c in manifest["items"].items()}
    used = {cid: sorted(k for k, cids in of_item.items() if cid in cids) for cid in rows}
    checked, data, damaged = verified_rows(store, limit, store.fields)
    fields = {}
    for name in store.fields:
        values = data.get(name, np.zeros(0))
        info = manifest["fields"].get(name, {})
        fields[name] = {"shape": info.get("shape"), "dtype": info.get("dtype"), "stored_dtype": str(store.group[name].dtype),
                        **nonfinite(values.astype(np.float32) if values.dtype.kind == "f" else values)}
    texts = caption_texts(cfg)
    empty, own = manifest.get("empty_caption"), manifest.get("empty_captions", {})
    texts.update({cid: "" for cid in [empty, *own.values()] if cid})
    for key, cid in own.items():  # each item's (empty, controls) row of caption dropout
        used.setdefault(cid, []).append(key)
    return {
        "present": True, "complete": True, "family": manifest["family"], "rows": len(ids),
        "written": int(written.sum()), "referenced": len(rows), "items": len(manifest["items"]),
        "orphaned_rows": sorted(set(ids) - set(rows)),
        "missing_rows": sorted(cid for cid, r in rows.items() if r >= len(written) or not written[r]),
        "damaged_rows": damaged,
        "fields": fields, "rows_checked": len(checked), "bytes_on_disk": dir_bytes(path),
        "truncated": manifest.get("truncated", {}),
        "captions": [{"caption_id": cid, "row": rows[cid], "items": used[cid], "length": manifest["lengths"].get(cid),
                      "text": texts.get(cid, CAPTION_GONE)} for cid in sorted(rows, key=rows.get)],
        # items with several captions (variants), each drawn per step; the empty caption of dropout
        "variants": {key: [{"caption_id": cid, "text": texts.get(cid, CAPTION_GONE)} for cid in cids]
                     for key, cids in sorted(manifest.get("variants", {}).items())},
        "empty_caption": empty,
        "empty_captions": own,
    }


CAPTION_GONE = "(caption file changed or removed since it was encoded)"


def caption_texts(cfg: Any) -> dict[str, str]:
    """caption id -> text, read from the dataset now (manifests keep only ids and lengths)."""
    from stages.core.caches import scan_items  # the family's ids: an edit family's cover the controls
    from stages.families import get_family

    if cfg is None:
        return {}
    try:
        return {cid: text for it in scan_items(cfg, get_family(cfg.family)) for cid, text in zip(it.caption_ids, it.texts)}
    except (UserError, OSError):  # a moved dataset must not hide the rest of the report
        return {}


def channel_stats(mean: np.ndarray, logvar: np.ndarray, family: Any, norm: dict[str, Any]) -> dict[str, Any]:
    """Per-channel statistics of cached posteriors (N, variants, C, [frames,] h, w), raw and normalized."""
    import torch

    c = mean.shape[2]
    z = mean.reshape(-1, *mean.shape[2:]).astype(np.float32)
    per_channel = np.moveaxis(z, 1, 0).reshape(c, -1)
    normed = np.moveaxis(family.normalize_latents(torch.from_numpy(z), norm).numpy(), 1, 0).reshape(c, -1)
    std = np.moveaxis(np.exp(0.5 * logvar.astype(np.float32)), 2, 0).reshape(c, -1)
    return {"mean": per_channel.mean(1).tolist(), "std": per_channel.std(1).tolist(),
            "min": per_channel.min(1).tolist(), "max": per_channel.max(1).tolist(),
            "normalized_mean": normed.mean(1).tolist(), "normalized_std": normed.std(1).tolist(),
            "posterior_std": std.mean(1).tolist()}


def latents_section(run_dir: Path, limit: int) -> dict[str, Any]:
    from stages.families import get_family

    path = run_dir / "latents.zarr"
    manifest = read_manifest(path)
    if manifest is None:
        return {"present": path.exists(), "complete": False, "hint": f"run `{command_for(run_dir, 'cache-latents')}`"}
    family = get_family(manifest["family"])
    index = manifest["index"]
    buckets, means, logvars = {}, [], []
    for name in manifest["buckets"]:
        if not (path / name / "zarr.json").exists():
            buckets[name] = {"rows": 0, "missing_store": True}
            continue
        store = RowStore.open(path / name)
        ids, written = store.ids, store.written_mask()
        referenced = {i for i, v in index.items() if v["bucket"] == name}
        row_of = store.row_of()
        controls = [f"control_{k}" for k in range(control_count(store.fields))]  # beside the targets' posteriors
        parts = [f"{c}_{part}" for c in controls for part in ("mean", "logvar")]
        checked, data, damaged = verified_rows(store, limit, ["mean", "logvar", *parts])
        if checked:
            means.append(data["mean"])
            logvars.append(data["logvar"])
        buckets[name] = {
            "rows": len(ids), "written": int(written.sum()), "items": len(referenced),
            "shape": list(store.group["mean"].shape[1:]), "dtype": store.group["mean"].attrs.get("logical_dtype"),
            "stored_dtype": str(store.group["mean"].dtype), "bytes_on_disk": dir_bytes(path / name),
            "orphaned_rows": sorted(set(ids) - referenced),
            "missing_rows": sorted(i for i in referenced if i not in row_of or not written[row_of[i]]),
            "damaged_rows": damaged,
            "mean": nonfinite(data["mean"]) if checked else {}, "logvar": nonfinite(data["logvar"]) if checked else {},
            "controls": [{"name": c, "shape": list(store.group[f"{c}_mean"].shape[1:]),
                          **{part: nonfinite(data[f"{c}_{part}"]) if checked else {} for part in ("mean", "logvar")}}
                         for c in controls],
            "rows_checked": len(checked)}
    stats = None
    if means:  # buckets differ in h, w but share C: pool per channel over every checked pixel
        pooled = [channel_stats(m, lv, family, manifest["normalization"]) for m, lv in zip(means, logvars)]
        weights = np.array([m.size for m in means], dtype=np.float64)
        stats = {k: np.average(np.array([p[k] for p in pooled]), axis=0, weights=weights).round(4).tolist() for k in pooled[0]}
    return {"present": True, "complete": True, "family": manifest["family"], "images": len(index),
            "clips": sum("clip" in entry for entry in index.values()),  # of `images`: the contents that are clips
            "items": len(manifest["items"]), "variants": manifest["variants"],
            "variants_of": manifest.get("variants_of", {}), "buckets": buckets,
            "normalization": manifest["normalization"], "channel_stats": stats,
            "expected_after_normalization": {"mean": 0.0, "std": 1.0},
            "skipped": manifest.get("skipped", []), "duplicates": manifest.get("duplicates", {}),
            "bytes_on_disk": dir_bytes(path)}


def lora_section(folder: Path, name: str = "lora") -> dict[str, Any]:
    """One adapter folder (lora/, or lora/<expert>/ of a two-expert family, `name` as the report shows it):
    checkpoints, final, profile."""
    checkpoints = []
    for p in sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]) if p.name[11:].isdigit() else -1):
        m = read_manifest(p)
        checkpoints.append({"name": p.name, "step": m and m.get("step"), "complete": m is not None,
                            "bytes_on_disk": dir_bytes(p)})
    final = read_manifest(folder / "final")
    out: dict[str, Any] = {"folder": name, "checkpoints": checkpoints, "final": None}
    if final is not None:
        keys = ("step", "complete", "incomplete_reason", "loss_first", "loss_last", "samples_per_second", "seconds",
                "precision", "device", "peak_vram_gb", "pipeline_class")
        out["final"] = {k: final.get(k) for k in keys if k in final}
        out["final"]["lora_config"] = {k: final.get("lora_config", {}).get(k) for k in ("r", "lora_alpha", "target_modules")}
        out["final"]["hyper_parameters"] = final.get("fingerprint_parts", {}).get("train", {})
        out["final"]["bytes_on_disk"] = dir_bytes(folder / "final")
    out["profile"] = profile_section(folder / "profile.json")
    return out


def profile_section(path: Path, top: int = 10) -> dict[str, Any] | None:
    """The last `runtime.profile_steps` table (stages/core/profiling.py): its longest entries; None if absent
    or unreadable (a profile is a report, never an input: a damaged one is named, not raised)."""
    if not path.exists():
        return None
    try:
        table = json.loads(path.read_text())
        return {"path": str(path), "device": table["device"], "steps": table["steps"], "ms_per_step": table["ms_per_step"],
                "host_to_device_ms_per_step": table.get("host_to_device_ms_per_step"), "top": table["top"][:top]}
    except (ValueError, KeyError, TypeError) as e:
        return {"path": str(path), "error": f"unreadable ({type(e).__name__}: {e}); rerun train with runtime.profile_steps"}


def export_section(folder: Path) -> dict[str, Any] | None:
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    files = {f: (folder / f).stat().st_size for f in manifest.get("files", []) if (folder / f).exists()}
    return {"files": files, **{k: manifest[k] for k in ("step", "columns", "prompts", "seeds") if k in manifest}}


def events_section(run_dir: Path) -> dict[str, Any]:
    events = read_events(run_dir)
    counts: dict[str, int] = {}
    for e in events:
        counts[e["event"]] = counts.get(e["event"], 0) + 1
    errors = [e for e in events if e["event"] == "error"]
    return {"lines": len(events), "counts": counts,
            "last_error": {k: errors[-1].get(k) for k in ("stage", "message", "item")} if errors else None}


def inspect_run(run_dir: Path, config: Any = None, rows: int = 64) -> dict[str, Any]:
    """The whole report as one JSON-able dict."""
    if not run_dir.is_dir():
        known = sorted(p.name for p in run_dir.parent.iterdir()  # .index, .model-cache: not runs
                       if p.is_dir() and not p.name.startswith(".")) if run_dir.parent.is_dir() else []
        raise InspectError(f"no run folder '{run_dir}' (runs under {run_dir.parent}: {', '.join(known) or 'none'})")
    cfg = run_config(run_dir, config)
    return {
        "run": run_dir.name, "path": str(run_dir), "bytes_on_disk": dir_bytes(run_dir),
        "config": None if cfg is None else {"family": cfg.family, "model": cfg.model, "data": [d.path for d in cfg.dataset_configs()] if cfg.datasets else cfg.data.path},
        "stages": None if cfg is None else stages_section(cfg),
        "captions": captions_section(run_dir, rows, cfg), "latents": latents_section(run_dir, rows),
        **adapter_sections(run_dir, cfg), "samples": export_section(run_dir / "samples"),
        "events": events_section(run_dir),
    }


def adapter_sections(run_dir: Path, cfg: Any) -> dict[str, Any]:
    """"lora" and "export": the run's adapter folder and export, or for a two-expert family
    {expert: section} of each of its experts (trained or not)."""
    from stages.core.caches import EXPORT, LORA, export_dir, lora_dir

    if cfg is None:  # no config.json: the one-denoiser layout
        return {"lora": lora_section(run_dir / LORA), "export": export_section(run_dir / EXPORT)}
    experts = experts_of(cfg)
    if not experts:
        return {"lora": lora_section(lora_dir(cfg)), "export": export_section(export_dir(cfg))}
    return {"lora": {e: lora_section(lora_dir(cfg, e), lora_dir(cfg, e).relative_to(run_dir).as_posix()) for e in experts},
            "export": {e: export_section(export_dir(cfg, e)) for e in experts}}


def experts_of(cfg: Any) -> tuple[str, ...]:
    """The family's experts where the run picks one (train.expert set), else ()."""
    from stages.families import get_family

    return get_family(cfg.family).experts if cfg.train.expert else ()


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, default=str)


# ---- decode ----------------------------------------------------------------------------------------


def find_image(manifest: dict[str, Any], item: str) -> str:
    """An image id from a dataset key ("cats/01.png"), an image id, or a unique prefix of one."""
    if item in manifest["items"]:
        return manifest["items"][item]
    matches = [i for i in manifest["index"] if i.startswith(item)]
    if len(matches) == 1:
        return matches[0]
    keys = sorted(manifest["items"])
    raise InspectError(f"item '{item}' is not in the latent cache ({len(matches)} image ids match); "
                       f"known items: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}")


def cached_variant(run_dir: Path, item: str, variant: int, control: int | None = None) -> dict[str, Any]:
    """mean, logvar (C, h, w) and the crop/flip/size of one cached variant: of the item's target, or
    with `control` = k of its k-th control image (edit families, references), cached with that crop/flip."""
    path = run_dir / "latents.zarr"
    manifest = read_manifest(path)
    if manifest is None:
        raise InspectError(f"run '{run_dir.name}' has no complete latent cache: run `{command_for(run_dir, 'cache-latents')}` first")
    image_id = find_image(manifest, item)
    where = manifest["index"][image_id]
    if not 0 <= variant < manifest["variants"]:
        raise InspectError(f"variant {variant} does not exist: item '{item}' has variants 0..{manifest['variants'] - 1}")
    store = RowStore.open(path / where["bucket"])
    row, field = where["row"], "" if control is None else f"control_{control}_"
    if control is not None and f"{field}mean" not in store.fields:
        have = control_count(store.fields)
        raise InspectError(f"item '{item}' has no cached control {control}: "
                           + (f"its controls are 0..{have - 1}" if have else "its run caches no control images"))
    return {"image_id": image_id, "bucket": where["bucket"], "mean": store.read(f"{field}mean", (row, variant)),
            "logvar": store.read(f"{field}logvar", (row, variant)), "control": control,
            "crop_top_left": store.read("crop_top_left", (row, variant)).tolist(),
            "flip": bool(store.read("flip", (row, variant))), "original_size": store.read("original_size", row).tolist(),
            "family": manifest["family"], "clip": where.get("clip"),
            "start_frame": int(store.read("start_frame", (row, variant))) if "start_frame" in store.fields else None}


def decode(cfg: Any, item: str, variant: int, out: Path, sample: bool = False, seed: int = 0,
           control: int | None = None) -> tuple[Path, dict[str, Any]]:
    """Decode one cached variant to a PNG with the VAE alone (the cache holds raw posterior
    latents, before the family's normalization, which is what `vae.decode` takes); `control` = k:
    the item's k-th control image as cached for that variant."""
    import torch
    from PIL import Image

    from stages.core.model_source import model_source
    from stages.core.runtime import make_runtime, quiet_libraries
    from stages.families import library_notices
    from stages.families import get_family

    check_decode_out(out)
    quiet_libraries(notices=library_notices())  # loads the VAE as a stage does: no library notices
    info = cached_variant(cfg.run_dir, item, variant, control)
    z = torch.from_numpy(info["mean"].astype(np.float32))[None]
    if sample:
        eps = torch.randn(z.shape, generator=torch.Generator().manual_seed(seed))
        z = z + torch.exp(0.5 * torch.from_numpy(info["logvar"].astype(np.float32))[None]) * eps
    family = get_family(info["family"])
    rt = make_runtime(cfg.device, cfg.latents.vae_precision)
    src = model_source(cfg)
    src.check(family.vae_components)
    vae = family.load_vae(src, rt)
    # Qwen-Image's (Wan) VAEs decode (B, C, T, H, W); Qwen-Image 2.1's has 2-D conv weights but a temporal config.
    video = any(p.dim() == 5 for p in vae.decoder.parameters()) or "temperal_downsample" in vae.config
    clip = z.dim() == 5  # a video family's row, (1, C, frames, h, w): an image is a 1-frame clip there
    with torch.no_grad():
        z = z.to(rt.device, vae.dtype)
        pixels = vae.decode(z.unsqueeze(2) if video and not clip else z).sample
    frames = pixels[0].transpose(0, 1) if clip else (pixels.squeeze(2) if video else pixels)  # (F, 3, H, W)
    images = [Image.fromarray(((f.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy())
              for f in frames]
    # A clip plays at the rate it trains at: data.fps, else (0) the clip's own rate.
    fps = cfg.data.fps if cfg.data.fps > 0 else (info["clip"][1] if info.get("clip") else 8.0)
    out.parent.mkdir(parents=True, exist_ok=True)
    _save_frames(images, out, fps)
    meta = {k: info[k] for k in ("image_id", "bucket", "control", "crop_top_left", "flip", "original_size", "start_frame")}
    return out, {**meta, "variant": variant, "latent_shape": list(info["mean"].shape), "sampled": sample,
                 "size": list(images[0].size), "frames": len(images), **({"fps": fps} if len(images) > 1 else {})}


def check_decode_out(out: Path) -> None:
    """Refuse an --out that no writer takes, before the VAE loads."""
    from PIL import Image

    suffix = out.suffix.lower()
    if suffix != ".mp4" and suffix not in Image.registered_extensions():
        raise UserError(f"--out '{out}': cannot write a '{suffix or 'suffixless'}' file; name a .png (a clip's frames "
                        f"side by side), .webp or .gif (animated) or .mp4")


def _save_frames(images: list[Any], out: Path, fps: float = 8.0) -> None:
    """One decoded image as PNG (or whatever `out` names); a clip's frames as an animation when `out` ends in
    .webp or .gif, an mp4 when .mp4 (PyAV), else side by side in one image."""
    from PIL import Image

    from stages.core import video

    suffix = out.suffix.lower()
    if len(images) > 1 and suffix in (".webp", ".gif"):
        return video.write_animation(out, images, fps)
    if suffix == ".mp4":  # a still as a 1-frame clip
        if not video.write_mp4(out, images, fps):
            raise UserError(f"this PyAV build has no H.264 or MPEG-4 encoder to write '{out}': use --out with .webp or .png")
        return None
    w, h = images[0].size
    strip = Image.new("RGB", (w * len(images), h))
    for k, im in enumerate(images):
        strip.paste(im, (k * w, 0))
    strip.save(out)


# ---- rich rendering -----------------------------------------------------------------------------------


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def render(report: dict[str, Any], console: Any) -> None:
    """Print the report as rich tables (plain text when not a terminal)."""
    from rich.table import Table

    console.print(f"[bold]run {report['run']}[/bold]  {report['path']}  {_mb(report['bytes_on_disk'])}"
                  + (f"  family {report['config']['family']}, model {report['config']['model']}" if report["config"] else ""))
    if report["stages"]:
        t = Table("stage", "state", "why", title="stages")
        for name, s in report["stages"].items():
            t.add_row(name, "[red]blocked[/red]" if s["blocked"] else "[green]up to date[/green]" if s["up_to_date"]
                      else "[yellow]stale[/yellow]",
                      "; ".join(s["reasons"])[:120])
        console.print(t)
    _render_captions(report["captions"], console)
    _render_latents(report["latents"], console)
    if "checkpoints" in report["lora"]:
        _render_lora(report["lora"], report["export"], console)
    else:  # a two-expert run: each expert's adapter and export
        for expert, section in report["lora"].items():
            console.print(f"[bold]{expert} expert[/bold]")
            _render_lora(section, report["export"][expert], console)
    console.print(f"samples: {report['samples']['files'] if report['samples'] else 'none'}")
    ev = report["events"]
    console.print(f"events: {ev['lines']} lines " + ", ".join(f"{k} {v}" for k, v in sorted(ev["counts"].items()))
                  + (f"; last error ({ev['last_error']['stage']}): {ev['last_error']['message']}" if ev["last_error"] else ""))


def _damaged(ids: list[str]) -> str:
    return f"[red]{len(ids)} damaged ({', '.join(i[:12] for i in ids[:4])})[/red]" if ids else "0 damaged"


def _render_captions(c: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    if not c.get("complete"):
        console.print(f"captions.zarr: [yellow]missing or incomplete[/yellow] ({c.get('hint')})")
        return
    console.print(f"captions.zarr: {c['rows']} rows ({c['written']} written, {c['referenced']} referenced by "
                  f"{c['items']} items), {len(c['orphaned_rows'])} orphaned, {len(c['missing_rows'])} missing, "
                  f"{_damaged(c['damaged_rows'])}, "
                  f"{_mb(c['bytes_on_disk'])}")
    t = Table("field", "shape", "dtype (stored)", "NaN", "Inf", title=f"caption fields ({c['rows_checked']} rows checked)")
    for name, f in c["fields"].items():
        t.add_row(name, str(f["shape"]), f"{f['dtype']} ({f['stored_dtype']})", str(f["nan"]), str(f["inf"]))
    console.print(t)
    t = Table("row", "caption id", "items", "text", title="captions")
    for row in c["captions"][:40]:
        t.add_row(str(row["row"]), row["caption_id"][:12], str(len(row["items"])), row["text"][:90])
    console.print(t)
    if len(c["captions"]) > 40:
        console.print(f"  ... {len(c['captions']) - 40} more (--json lists all)")
    variants = c.get("variants") or {}
    if variants:
        t = Table("item", "variants", "caption ids", "texts", title="caption variants per item (one drawn per step)")
        for key, vs in list(variants.items())[:40]:
            t.add_row(key, str(len(vs)), " ".join(v["caption_id"][:8] for v in vs),
                      " | ".join(v["text"][:40] for v in vs)[:120])
        console.print(t)
    if c.get("empty_caption"):
        row = next((r["row"] for r in c["captions"] if r["caption_id"] == c["empty_caption"]), "?")
        console.print(f"caption dropout trains on the empty caption, row {row}")
    if c.get("empty_captions"):
        rows = sorted({r["row"] for r in c["captions"] if r["caption_id"] in set(c["empty_captions"].values())})
        console.print(f"caption dropout trains each item on the empty caption with its own control images: "
                      f"{len(rows)} rows ({', '.join(map(str, rows[:20]))}{' ...' if len(rows) > 20 else ''})")


def _nonfinite(counts: dict[str, int]) -> str:
    return f"{counts.get('nan', 0)}/{counts.get('inf', 0)}"


def _render_latents(lat: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    if not lat.get("complete"):
        console.print(f"latents.zarr: [yellow]missing or incomplete[/yellow] ({lat.get('hint')})")
        return
    fewer = Counter(lat.get("variants_of", {}).values())
    clips, stills = lat["clips"], lat["images"] - lat["clips"]
    contents = ", ".join(f"{n} {noun}{'s' * (n != 1)}" for n, noun in ((clips, "clip"), (stills, "image")) if n) or "0 images"
    each = f"{lat['variants']} variants each" + "".join(f" ({n} of them cache {k}: their dataset's cache_variants)"
                                                        for k, n in sorted(fewer.items()))
    console.print(f"latents.zarr: {contents}, {lat['items']} items, {each}, "
                  f"{len(lat['skipped'])} skipped, {len(lat['duplicates'])} duplicated, {_mb(lat['bytes_on_disk'])}; "
                  f"normalization {lat['normalization']}")
    with_controls = any(b.get("controls") for b in lat["buckets"].values())
    t = Table("bucket WxH", "rows", "variants, C, h, w", "dtype (stored)", "orphaned", "missing", "damaged",
              "NaN/Inf mean", "NaN/Inf logvar", *(["controls (NaN/Inf)"] if with_controls else []),
              "size", title="buckets")
    for name, b in lat["buckets"].items():
        if b.get("missing_store"):
            t.add_row(name, "0", "[red]store missing[/red]", *[""] * (8 if with_controls else 7))
            continue
        controls = ["; ".join(f"{c['shape']} ({_nonfinite(Counter(c['mean']) + Counter(c['logvar']))})"
                              for c in b["controls"])]
        t.add_row(name, str(b["rows"]), str(b["shape"]), f"{b['dtype']} ({b['stored_dtype']})",
                  str(len(b["orphaned_rows"])), str(len(b["missing_rows"])), _damaged(b["damaged_rows"]),
                  _nonfinite(b["mean"]), _nonfinite(b["logvar"]), *(controls if with_controls else []),
                  _mb(b["bytes_on_disk"]))
    console.print(t)
    s = lat["channel_stats"]
    if s:
        t = Table("ch", "mean", "std", "min", "max", "posterior std", "normalized mean (~0)", "normalized std (~1)",
                  title="per-channel latent statistics (posterior means)")
        for ch in range(len(s["mean"])):
            t.add_row(str(ch), *(f"{s[k][ch]:.3f}" for k in ("mean", "std", "min", "max", "posterior_std",
                                                           "normalized_mean", "normalized_std")))
        console.print(t)


def _render_lora(lora: dict[str, Any], export: dict[str, Any] | None, console: Any) -> None:
    ckpts = ", ".join(f"{c['name']}{'' if c['complete'] else ' (incomplete)'}" for c in lora["checkpoints"]) or "none"
    where = lora.get("folder", "lora")
    console.print(f"{where}: checkpoints {ckpts}")
    final = lora["final"]
    if final:
        lc = final["lora_config"]
        console.print(f"{where}/final: step {final.get('step')}, complete {final.get('complete')}, rank {lc['r']}, alpha "
                      f"{lc['lora_alpha']}, targets {lc['target_modules']}; loss {_num(final.get('loss_first'))} -> "
                      f"{_num(final.get('loss_last'))}; {_num(final.get('samples_per_second'))} samples/s on "
                      f"{final.get('device')}")
        hp = final["hyper_parameters"]
        console.print("  hyper-parameters: " + ", ".join(f"{k}={v}" for k, v in sorted(hp.items()) if k != "target_modules"))
    prof = lora.get("profile")
    if prof and "error" in prof:
        console.print(f"{where}/profile.json: {prof['error']}")
    elif prof:
        console.print(f"{where}/profile.json: {prof['steps']} profiled step(s), {_num(prof['ms_per_step'])} ms per step on "
                      f"{prof['device']} (host-to-device copies {_num(prof['host_to_device_ms_per_step'])} ms); longest:")
        for r in prof["top"]:
            console.print(f"  {r['ms']:9.2f} ms {r['pct']:5.1f}% x{r['calls']:<5} {r['name'][:100]}")
    console.print(f"export: {export['files'] if export else 'none'}")
