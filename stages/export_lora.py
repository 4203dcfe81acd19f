"""Stage 4: lora/final -> export/pytorch_lora_weights.safetensors and export/<run>_comfyui.safetensors.

    lorapipe export-lora <run> [--format kohya] [--verify] [--checkpoint N] [--ema] [--force]

The diffusers file is written by the family's own `<Pipeline>.save_lora_weights`, each module's scale
multiplied into lora_B, so diffusers and loaders that ignore its metadata apply the trained delta. The
ComfyUI file is the family's `ComfyLayout` (stages.core.comfyui_file). No base weights are read, except
a DoRA adapter's for its ComfyUI file.
Everything it needs (family, pipeline class, LoRA config) is read from lora/final/manifest.json;
if that is missing it refuses and names the command that makes it. `--checkpoint N` exports
lora/checkpoint-N to export/checkpoint-N/, beside the final export, which it leaves as it is. An
export that is up to date is not rewritten unless forced. `--ema` exports the EMA of the adapter
weights (train.ema_decay > 0) in the same files instead. A two-expert family's adapter lora/<expert>/
exports to export/<expert>/ (its ComfyUI file named for the expert); train.expert = "both" exports each.
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
    """What decides the files besides the adapter: the formats written, EMA or not, and the contents' version."""
    return {"format": cfg.export.format, "ema": cfg.export.ema, "comfyui": cfg.export.comfyui,
            "layout": EXPORT_LAYOUT}


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
    """One adapter's export (the run's, or one expert's) into its folder, unless it is up to date."""
    out, parts = export_dir(cfg, checkpoint), fingerprint_parts(cfg, checkpoint)
    current = read_manifest(out)
    if not force and current is not None and current.get("fingerprint") == fingerprint(parts):
        checks = verify(cfg, folder, manifest, [out / f for f in current["files"]]) if cfg.export.verify else {}
        ctx.log.emit("up_to_date", fingerprint=current["fingerprint"], notes=notes(checks),
                     **({"expert": cfg.train.expert} if cfg.train.expert else {}))
        return current
    with atomic_dir(out) as tmp:
        fields = write_export(cfg, folder, manifest, parts, tmp, complete=checkpoint is not None,
                              checkpoint=checkpoint)
        result = write_manifest(tmp, NAME, **fields, seconds=ctx.elapsed())
        if checkpoint is None:
            keep_checkpoint_exports(out, tmp)
    ctx.log.emit("done", seconds=ctx.elapsed(), files=[str(out / f) for f in result["files"]],
                 notes=notes(result.get("checks", {})))
    return result


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
        files.append(writer(state, lora_cfg, manifest, tmp, family.kohya_layout, src))
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
