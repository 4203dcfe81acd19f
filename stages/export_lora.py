"""Stage 4: lora/final -> export/pytorch_lora_weights.safetensors and export/<run>_comfyui.safetensors.

    lorapipe export-lora <run> [--format kohya] [--verify] [--checkpoint N] [--ema] [--force]

The diffusers file is written by the family's own `<Pipeline>.save_lora_weights`, each module's scale
multiplied into lora_B, so diffusers and loaders that ignore its metadata apply the trained delta. The
ComfyUI file is the family's `ComfyLayout` (stages.core.comfyui_file). No base weights are read, except
a DoRA adapter's for its ComfyUI file.
Everything it needs (family, pipeline class, LoRA config) is read from lora/final/manifest.json;
if that is missing it refuses and names the command that makes it. `--checkpoint N` exports
lora/checkpoint-N to export/checkpoint-N/, beside the final export, which it leaves as it is. An
export of the same adapter that holds every format asked for is up to date: skipped, and it says so,
unless forced. A file of another format the folder holds (an earlier `--format kohya`) is kept while
it is of the same adapter; once the adapter changed, the export removes it and names the command that
writes it again. `--ema` exports the EMA of the adapter weights (train.ema_decay > 0) in the same
files instead. A two-expert family's adapter lora/<expert>/
exports to export/<expert>/ (its ComfyUI and kohya files named for the expert); train.expert = "both" exports each.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from stages.core.artifacts import ArtifactError, atomic_dir, fingerprint, read_manifest, write_manifest
# DIFFUSERS_FILE and scale_folded stay importable from here
from stages.core.caches import (DIFFUSERS_FILE, complete_checkpoints, export_dir as export_root, lora_dir,  # noqa: F401
                                 lora_final_dir, scale_folded, write_diffusers)
from stages.core.config import command

NAME = "export-lora"
LYCORIS_ONLY = ("lokr", "loha")  # adapter types diffusers' loader cannot read: their ComfyUI file is LyCORIS
EXPORT_LAYOUT = 3  # the version of the files' contents: an export of another version is rewritten


def artifact_dir(cfg: Any) -> Path:
    return export_root(cfg)


def export_dir(cfg: Any, checkpoint: int | None) -> Path:
    """export/ for lora/final, export/checkpoint-N/ for lora/checkpoint-N."""
    return artifact_dir(cfg) if checkpoint is None else artifact_dir(cfg) / f"checkpoint-{checkpoint}"


def fingerprint_parts(cfg: Any, checkpoint: int | None = None) -> dict[str, Any]:
    if checkpoint is not None:
        source = read_manifest(lora_dir(cfg) / f"checkpoint-{checkpoint}")
        return {"checkpoint": checkpoint, "lora": source and source.get("fingerprint"),
                "lineage": source and source.get("lineage"), **_file_parts(cfg)}
    if cfg.train.expert == "both":
        from stages.registry import each_expert

        return {unit.train.expert: fingerprint_parts(unit) for unit in each_expert(cfg)}
    final = read_manifest(lora_final_dir(cfg))
    return {"lora": final and final.get("fingerprint"), "lora_step": final and final.get("step"), **_file_parts(cfg)}


def _file_parts(cfg: Any) -> dict[str, Any]:
    """What decides the files' contents besides the adapter: EMA or not, and the contents' version. Which
    formats are written is not part of it (`lacks`): each file is the same adapter in its reader's terms."""
    return {"ema": cfg.export.ema, "layout": EXPORT_LAYOUT}


def asked_formats(cfg: Any) -> set[str]:
    """The formats besides the diffusers file that the config asks for: "comfyui" (export.comfyui) and
    "kohya" (export.format = "kohya"). LoKr and LoHa always get their ComfyUI file."""
    return {f for f, asked in (("comfyui", cfg.export.comfyui), ("kohya", cfg.export.format == "kohya")) if asked}


def file_format(name: str) -> str:
    """The format of an export file, by its name."""
    from stages.core.caches import COMFYUI_SUFFIX
    from stages.core.kohya import is_kohya_file

    if name.endswith(COMFYUI_SUFFIX):
        return "comfyui"
    return "kohya" if is_kohya_file(name) else "diffusers"


def held_files(out: Path, manifest: dict[str, Any]) -> dict[str, str]:
    """format -> file name of the manifest's files that are there."""
    return {file_format(name): name for name in manifest.get("files", []) if (out / name).is_file()}


def lacks(cfg: Any, manifest: dict[str, Any], out: Path | None = None) -> list[str]:
    """What an export whose fingerprint matches lacks of what `cfg` asks (its files gone, a format not
    written), as reasons it is stale; `out`: its folder (default: the final export's)."""
    out = export_dir(cfg, None) if out is None else out
    where = out.relative_to(cfg.run_dir).as_posix() if out.is_relative_to(cfg.run_dir) else str(out)
    held = held_files(out, manifest)
    gone = [name for name in manifest.get("files", []) if not (out / name).is_file()]
    return ([f"{where}/{name} is gone" for name in gone]
            + [f"no {fmt} file in {where} (export.{'comfyui' if fmt == 'comfyui' else 'format'} asks for one)"
               for fmt in sorted(asked_formats(cfg) - set(held))])


def adapter_weights(cfg: Any, folder: Path) -> str:
    """The weights file export-lora reads: the adapter, or with export.ema its EMA (refused, with the
    fix, when the run was trained without one)."""
    from stages.core import lora

    if not cfg.export.ema:
        return lora.ADAPTER_WEIGHTS
    if not (folder / lora.EMA_WEIGHTS).is_file():
        from stages.core.runspec import save_then

        raise ArtifactError(f"'{folder}' holds no EMA of the adapter ({lora.EMA_WEIGHTS}): it was trained with "
                            f"train.ema_decay = 0; train one with {save_then(cfg.run_dir, 'train', '--restart', sets=('train.ema_decay=0.999',))}, "
                            f"or export without --ema")
    return lora.EMA_WEIGHTS


def source_manifest(cfg: Any, checkpoint: int | None = None) -> tuple[Path, dict[str, Any]]:
    folder = lora_final_dir(cfg) if checkpoint is None else lora_dir(cfg) / f"checkpoint-{checkpoint}"
    manifest = read_manifest(folder)
    if manifest is not None:
        return folder, manifest
    where = lora_dir(cfg).relative_to(cfg.run_dir).as_posix()
    if checkpoint is None:
        raise ArtifactError(f"'{folder}' has no complete adapter ({where}/final missing or unfinished): run "
                            f"`{command(cfg, 'train')}` first")
    steps = [p.name[11:] for p in complete_checkpoints(lora_dir(cfg))]
    there = (f"the checkpoints there are: {', '.join(steps)} (e.g. `{command(cfg, NAME, '--checkpoint', steps[-1])}`)"
             if steps else "there are none (runtime.checkpoint_every and runtime.keep_checkpoints decide which are kept)")
    raise ArtifactError(f"run '{cfg.run}' has no complete {where}/checkpoint-{checkpoint}: {there}")


def run(cfg: Any, checkpoint: int | None = None, force: bool = False) -> dict[str, Any]:
    """Export the run's adapter (each expert's, for train.expert = "both"); returns the manifest, the last
    expert's with `experts` holding each one's when there are several."""
    from stages.core.runtime import install_model_trace
    from stages.families import library_notices
    from stages.core.stage import running_stage
    from stages.registry import conflicts, each_expert

    install_model_trace(NAME, library_notices())
    with running_stage(cfg, NAME, beside=conflicts(NAME)) as ctx:
        units = each_expert(cfg)
        sources = [source_manifest(unit, checkpoint) for unit in units]  # every adapter is there before one is written
        done = {unit.train.expert: export_one(unit, ctx, folder, manifest, checkpoint, force)
                for unit, (folder, manifest) in zip(units, sources)}
        result = done[units[-1].train.expert]
        return result if len(units) == 1 else {**result, "experts": done}


def export_one(cfg: Any, ctx: Any, folder: Path, manifest: dict[str, Any], checkpoint: int | None,
               force: bool) -> dict[str, Any]:
    """One adapter's export (the run's, or one expert's) into its folder, unless it is up to date. The
    folder's files of formats not asked for are kept when they are of this adapter, else removed by name."""
    out, parts = export_dir(cfg, checkpoint), fingerprint_parts(cfg, checkpoint)
    current = read_manifest(out) or {}
    same = current.get("fingerprint") == fingerprint(parts)
    if not force and same and not lacks(cfg, current, out):
        return up_to_date(cfg, ctx, folder, manifest, current, out, checkpoint)
    held = held_files(out, current)
    with atomic_dir(out) as tmp:
        fields = write_export(cfg, folder, manifest, parts, tmp, complete=checkpoint is not None,
                              checkpoint=checkpoint)
        written = {file_format(name): name for name in fields["files"]}
        kept = [name for fmt, name in held.items() if same and fmt not in written]
        for name in kept:  # just before the swap, as the checkpoint exports below
            os.replace(out / name, tmp / name)
        fields["files"] += kept
        fields["checks"].update({name: c for name, c in current.get("checks", {}).items() if name in kept})
        result = write_manifest(tmp, NAME, **fields, seconds=ctx.elapsed())
        if checkpoint is None:
            keep_checkpoint_exports(out, tmp)
    removed = {fmt: name for fmt, name in held.items() if name not in result["files"]}
    say_removed(cfg, ctx, out, checkpoint, removed, written)
    ctx.log.emit("done", seconds=ctx.elapsed(), files=[str(out / f) for f in result["files"]],
                 notes=notes(result.get("checks", {})))
    return result


def say_removed(cfg: Any, ctx: Any, out: Path, checkpoint: int | None, removed: dict[str, str],
                written: dict[str, str]) -> None:
    """A line per file of the replaced export that is gone: the command that writes its format again, or
    the file of that format that replaces it (the run's folder was renamed: a ComfyUI file's name changed)."""
    where = out.relative_to(cfg.run_dir).as_posix()
    for fmt, name in removed.items():
        if fmt in written:
            ctx.log.emit("info", message=f"{where}/{name} replaced by {where}/{written[fmt]}")
            continue
        again = command(cfg, NAME, *again_flags(cfg, checkpoint), *(("--format", "kohya") if fmt == "kohya" else ()),
                        *(("--set", "export.comfyui=true") if fmt == "comfyui" else ()))
        ctx.log.emit("warning", message=f"removed {where}/{name}, the {fmt} file of the adapter this export "
                                        f"replaces; `{again}` writes this adapter's")


def again_flags(cfg: Any, checkpoint: int | None) -> tuple[str, ...]:
    """The command flags that export the same adapter again: --checkpoint N, --ema."""
    return (*(("--checkpoint", str(checkpoint)) if checkpoint is not None else ()),
            *(("--ema",) if cfg.export.ema else ()))


def up_to_date(cfg: Any, ctx: Any, folder: Path, manifest: dict[str, Any], current: dict[str, Any], out: Path,
               checkpoint: int | None) -> dict[str, Any]:
    """The up-to-date export, skipped and said so (with --verify, its asked-for files checked first)."""
    held = held_files(out, current)
    asked = [name for fmt, name in held.items() if fmt == "diffusers" or fmt in asked_formats(cfg) or
             fmt == "comfyui" and current.get("adapter") in LYCORIS_ONLY]
    checks = verify(cfg, folder, manifest, [out / name for name in asked]) if cfg.export.verify else {}
    where, source = out.relative_to(cfg.run_dir).as_posix(), folder.relative_to(cfg.run_dir).as_posix()
    step = f" (step {current['step']})" if current.get("step") is not None else ""
    others = sorted(set(held.values()) - set(asked))
    skipped = (f"{where}/ holds {source}{step} in every format asked for, with these settings"
               + (f" (and {', '.join(others)}, of the same adapter)" if others else "")
               + f"; skipped, `{command(cfg, NAME, *again_flags(cfg, checkpoint), '--force')}` writes it again")
    ctx.log.emit("up_to_date", fingerprint=current["fingerprint"], notes=[skipped] + notes(checks),
                 **({"expert": cfg.train.expert} if cfg.train.expert else {}))
    return current


def write_export(cfg: Any, folder: Path, manifest: dict[str, Any], parts: dict[str, Any], tmp: Path,
                 complete: bool, checkpoint: int | None = None) -> dict[str, Any]:
    """Write the export files into `tmp` (and verify them if asked); returns the manifest fields.
    A checkpoint is complete by construction; lora/final says itself whether it is.

    Files: the diffusers file (LoRA, DoRA), the ComfyUI-ready file (export.comfyui; always for LoKr
    and LoHa, which have no other), and with export.format = "kohya" the kohya/LyCORIS copy."""
    from stages.core import lora
    from stages.core.model_source import model_source
    from stages.families import get_family

    state, lora_cfg = lora.load_adapter_files(folder, adapter_weights(cfg, folder))
    kind, family, src = lora.adapter_type(lora_cfg), get_family(manifest["family"]), model_source(cfg)
    files = []
    if kind not in LYCORIS_ONLY:
        files.append(write_diffusers(*scale_folded(state, lora_cfg), manifest, tmp))
    if cfg.export.comfyui or kind in LYCORIS_ONLY:
        from stages.core.comfyui_file import comfyui_file_name, write_comfyui

        files.append(write_comfyui(state, lora_cfg, manifest, tmp / comfyui_file_name(cfg.run, checkpoint, family.file_tag(cfg.train)),
                                   family.comfyui_layout, src))
    if cfg.export.format == "kohya":
        from stages.core.kohya import write_kohya, write_lycoris

        writer = write_lycoris if kind in LYCORIS_ONLY else write_kohya
        files.append(writer(state, lora_cfg, manifest, tmp, family.kohya_layout, src, family.file_tag(cfg.train)))
    checks = verify(cfg, folder, manifest, files) if cfg.export.verify else {}
    if cfg.export.format == "kohya" and not cfg.export.verify:  # say whether the kohya file also suits ComfyUI
        from stages.core.comfyui_file import TrainedDeltas
        from stages.core.verify import comfyui_readiness

        checks[files[-1].name] = comfyui_readiness(cfg, manifest, files[-1], list(TrainedDeltas(state, lora_cfg)))
    return dict(family=manifest["family"], pipeline_class=manifest["pipeline_class"], files=[f.name for f in files],
                source=str(folder), step=manifest.get("step"), complete=complete or manifest.get("complete", True),
                lora_config=lora_cfg, fingerprint=fingerprint(parts), fingerprint_parts=parts, tensors=len(state),
                ema=cfg.export.ema, adapter=kind, checks=checks)


def notes(checks: dict[str, Any]) -> list[str]:
    """The one-line results of the checks that have one (how each file loads in ComfyUI)."""
    return [c["note"] for c in checks.values() if c.get("note")]


def verify(cfg: Any, folder: Path, manifest: dict[str, Any], files: list[Path]) -> dict[str, Any]:
    """Every file checked against the trained adapter, each in its reader's terms (stages.core.verify)."""
    from stages.core import lora
    from stages.core.verify import verify_export

    state, lora_cfg = lora.load_adapter_files(folder, adapter_weights(cfg, folder))
    return verify_export(cfg, manifest, files, state, lora_cfg)


def keep_checkpoint_exports(out: Path, tmp: Path) -> None:
    """The final export replaces export/ as a whole: carry its export/checkpoint-N/ folders over
    (renames, just before the swap) so a new final export never drops them."""
    for sub in out.glob("checkpoint-*") if out.is_dir() else []:
        os.replace(sub, tmp / sub.name)
