"""Stage 4: lora/final -> export/pytorch_lora_weights.safetensors. Loads no base weights.

    python pipeline.py export-lora --config configs/flux-dev.toml [--format kohya] [--verify]

The diffusers file is written by the family's own `<Pipeline>.save_lora_weights` with the adapter
config in the header metadata, so `load_lora_weights()` restores lora_alpha != rank correctly.
Everything it needs (family, pipeline class, LoRA config) is read from lora/final/manifest.json;
if that is missing it refuses and names the command that makes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages import train
from stages.core.artifacts import ArtifactError, fingerprint, read_manifest, replace_dir, write_manifest

NAME = "export-lora"
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"


def artifact_dir(cfg: Any) -> Path:
    return cfg.run_dir / "export"


def fingerprint_parts(cfg: Any) -> dict[str, Any]:
    final = read_manifest(train.artifact_dir(cfg))
    return {"lora": final and final.get("fingerprint"), "lora_step": final and final.get("step"),
            "format": cfg.export.format}


def source_manifest(cfg: Any, checkpoint: int | None = None) -> tuple[Path, dict[str, Any]]:
    folder = train.artifact_dir(cfg) if checkpoint is None else cfg.run_dir / "lora" / f"checkpoint-{checkpoint}"
    manifest = read_manifest(folder)
    if manifest is None:
        what = "lora/final" if checkpoint is None else f"lora/checkpoint-{checkpoint}"
        raise ArtifactError(f"'{folder}' has no complete adapter ({what} missing or unfinished): run "
                            f"`python pipeline.py train --config <your config>` for run '{cfg.run}' first")
    return folder, manifest


def write_diffusers(state: dict[str, Any], lora_cfg: dict[str, Any], manifest: dict[str, Any], out: Path) -> Path:
    import diffusers

    pipeline_cls = getattr(diffusers, manifest["pipeline_class"])
    prefix = manifest["lora_prefix"]
    pipeline_cls.save_lora_weights(str(out), **{f"{prefix}_lora_layers": state,
                                                f"{prefix}_lora_adapter_metadata": lora_cfg},
                                   weight_name=DIFFUSERS_FILE, safe_serialization=True)
    return out / DIFFUSERS_FILE


def run(cfg: Any, checkpoint: int | None = None) -> dict[str, Any]:
    import shutil

    from stages.core import lora
    from stages.core.runtime import install_model_trace
    from stages.core.stage import running_stage

    install_model_trace(NAME)

    with running_stage(cfg, NAME) as ctx:
        folder, manifest = source_manifest(cfg, checkpoint)
        state, lora_cfg = lora.load_adapter_files(folder)
        out = artifact_dir(cfg)
        tmp = out.with_name(".export.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        files = [write_diffusers(state, lora_cfg, manifest, tmp)]
        if cfg.export.format == "kohya":
            from stages.core.kohya import write_kohya
            from stages.core.model_source import ModelSource
            from stages.families import get_family

            layout = get_family(manifest["family"]).kohya_layout
            files.append(write_kohya(state, lora_cfg, manifest, tmp, layout, ModelSource(cfg.model, cfg.revision)))
        if cfg.export.verify:
            from stages.core.verify import verify_export

            verify_export(cfg, manifest, files[0])
        parts = fingerprint_parts(cfg) if checkpoint is None else {"checkpoint": checkpoint, "format": cfg.export.format}
        result = write_manifest(tmp, NAME, family=manifest["family"], pipeline_class=manifest["pipeline_class"],
                                files=[f.name for f in files], source=str(folder), step=manifest.get("step"),
                                complete=manifest.get("complete", True) if checkpoint is None else True,
                                lora_config=lora_cfg, fingerprint=fingerprint(parts), fingerprint_parts=parts,
                                tensors=len(state), seconds=ctx.elapsed())
        replace_dir(tmp, out)
        ctx.log.emit("done", seconds=ctx.elapsed(), files=[str(out / f.name) for f in files])
        return result
