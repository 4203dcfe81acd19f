"""What one stage writes and another reads: the folders of a run, the dataset as the caches key it,
the caption and latent caches opened for reading, the complete checkpoints and the exported file.

    from stages.core.caches import load_captions, load_latents, scan_items

A stage never imports another stage (tests/core/test_import_contract.py): the readers of a stage's output
live here, beside the names of the folders (stages/registry.py says which stage writes which).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.core.config import command

CAPTIONS, LATENTS, LORA, EXPORT, SAMPLES = "captions.zarr", "latents.zarr", "lora", "export", "samples"
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"  # export-lora's diffusers file, which sample loads
COMFYUI_SUFFIX = "_comfyui.safetensors"  # the end of export-lora's ComfyUI file names (stages.core.comfyui_file)


def captions_dir(cfg: Any) -> Path:
    return cfg.run_dir / CAPTIONS


def latents_dir(cfg: Any) -> Path:
    return cfg.run_dir / LATENTS


def expert_folder(root: Path, expert: str) -> Path:
    """`root` itself for a one-denoiser family (train.expert ""), `root/<expert>/` for each expert of a two-expert
    family: the one rule of where a run keeps an adapter and its export."""
    if expert == "both":
        raise ValueError(f"'{root}': name the expert whose folder is meant (train.expert = 'both' trains several)")
    return root / expert if expert else root


def lora_dir(cfg: Any, expert: str | None = None) -> Path:
    """The adapter folder (checkpoint-<N>/, final/, .restarted-*/) of the run's `expert` (default: the one
    cfg.train.expert names): lora/ for a one-denoiser family, lora/high/ and lora/low/ for Wan 2.2 A14B."""
    return expert_folder(cfg.run_dir / LORA, cfg.train.expert if expert is None else expert)


def lora_final_dir(cfg: Any, expert: str | None = None) -> Path:
    return lora_dir(cfg, expert) / "final"


def export_dir(cfg: Any, expert: str | None = None) -> Path:
    """export-lora's folder of that adapter: export/, or export/high/ and export/low/ (as `lora_dir`)."""
    return expert_folder(cfg.run_dir / EXPORT, cfg.train.expert if expert is None else expert)


def expert_configs(cfg: Any, experts: tuple[str, ...]) -> list[Any]:
    """The configs the run trains one adapter each with: [cfg], or for train.expert = "both" one copy per expert of
    `experts` (the family's, in training order) with train.expert set to it, which is exactly the config of a run
    that trains that expert alone (so each adapter's fingerprint, folder and files are that run's)."""
    import dataclasses

    if cfg.train.expert != "both":
        return [cfg]
    return [dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, expert=e)) for e in experts]


def samples_dir(cfg: Any) -> Path:
    return cfg.run_dir / SAMPLES


def scan_items(cfg: Any, family: Any, log: Any = None, ids: bool = True) -> list[Any]:
    """The run's items, held-out validation items included (`validation.scan_run`), as `family` (the
    run's) trains them (edit families: ids cover the control images). `ids` False reads no image
    where the item's caption rows do not depend on them (stages.core.dataset.scan_run)."""
    from stages.core import dataset, validation

    warn = None if log is None else (lambda message, item: log.emit("warning", message=message, item=item))
    return dataset.for_family(validation.scan_run(cfg, log, ids), family, warn)  # held-out items too


def load_captions(cfg: Any) -> tuple[Any, dict[str, Any]]:
    """The caption store and its manifest, for train (refuses if missing)."""
    from stages.core.artifacts import require_manifest
    from stages.core.rowstore import RowStore

    out = captions_dir(cfg)
    manifest = require_manifest(out, command(cfg, "encode-captions"))
    return RowStore.open(out), manifest


def load_latents(cfg: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Bucket name -> RowStore, and the manifest (refuses if missing)."""
    from stages.core.artifacts import require_manifest
    from stages.core.rowstore import RowStore

    out = latents_dir(cfg)
    manifest = require_manifest(out, command(cfg, "cache-latents"))
    stores = {name: RowStore.open(out / name) for name in manifest["buckets"] if (out / name / "zarr.json").exists()}
    return stores, manifest


def step_of(folder: Path) -> int:
    return int(folder.name.split("-")[1])


def complete_checkpoints(lora_dir: Path) -> list[Path]:
    """Checkpoint folders with a manifest (complete), by step."""
    from stages.core.artifacts import read_manifest

    found = [p for p in lora_dir.glob("checkpoint-*") if p.name[11:].isdigit() and read_manifest(p) is not None]
    return sorted(found, key=step_of)


def write_diffusers(state: dict[str, Any], lora_cfg: dict[str, Any], manifest: dict[str, Any], out: Path,
                    note: dict[str, str] | None = None) -> Path:
    """The adapter as the family pipeline's diffusers LoRA file (export-lora's file; sample writes its
    checkpoint columns with it too, so every column loads as the export does). Its header also names the
    family and pipeline class (`lorapipe_family`, `lorapipe_pipeline_class`, which `lorapipe lora` reads),
    and `note`'s fields."""
    import diffusers
    from safetensors import safe_open
    from safetensors.torch import load_file

    from stages.core.artifacts import save_safetensors

    pipeline_cls = getattr(diffusers, manifest["pipeline_class"])
    prefix = manifest["lora_prefix"]
    pipeline_cls.save_lora_weights(str(out), **{f"{prefix}_lora_layers": state,
                                                f"{prefix}_lora_adapter_metadata": lora_cfg},
                                   weight_name=DIFFUSERS_FILE, safe_serialization=True)
    path = out / DIFFUSERS_FILE
    with safe_open(str(path), framework="pt") as f:
        header = dict(f.metadata() or {})
    save_safetensors(path, load_file(str(path)), {**header, "lorapipe_family": str(manifest.get("family")),
                                                  "lorapipe_pipeline_class": manifest["pipeline_class"], **(note or {})})
    return path


def scale_folded(state: dict[str, Any], lora_cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The LoRA with each module's scale (alpha / rank, alpha / sqrt(rank) for rsLoRA, patterns included)
    multiplied into lora_B, and a config whose alpha equals every module's rank: the same deltas for
    diffusers, which reads the config from the header, and for loaders that ignore it (scale 1)."""
    from stages.core.kohya import lora_scale

    out = dict(state)
    for key, tensor in state.items():
        if key.endswith(".lora_B.weight"):
            module = key[:-len(".lora_B.weight")]
            out[key] = tensor * lora_scale(lora_cfg, module, state[f"{module}.lora_A.weight"].shape[0])
    ranks = dict(lora_cfg.get("rank_pattern") or {})
    return out, {**lora_cfg, "lora_alpha": lora_cfg["r"], "alpha_pattern": ranks, "use_rslora": False}
