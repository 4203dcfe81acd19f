"""Stage 3: train a LoRA on the cached latents and captions. Loads only the denoiser.

    python pipeline.py train --config configs/flux-dev.toml [--resume]

Each step: draw a batch from one bucket, pick a random cached variant per item, draw a fresh latent
sample mean + exp(logvar/2) * eps, normalize it as the family's VAE does, and take one denoiser
forward over the whole batch. Writes lora/checkpoint-<step>/ (resumable) and lora/final/.
Stop with Ctrl-C, SIGTERM or `pipeline.py stop <run> [--no-save]`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from stages import cache_latents, encode_captions
from stages.core.artifacts import ArtifactError, fingerprint, read_manifest
from stages.core.model_source import ModelSource

NAME = "train"
# Settings that change how a run is logged or saved, not what it learns: not in the fingerprint.
NOT_FINGERPRINTED = {"log_every", "checkpoint_every", "keep_checkpoints", "resume", "warmup_steps_excluded",
                     "compile_transformer", "enable_tf32", "cudnn_benchmark"}


def artifact_dir(cfg: Any) -> Path:
    return cfg.run_dir / "lora" / "final"


def stop_file(run_dir: Path) -> Path:
    return run_dir / "train.stop"


def fingerprint_parts(cfg: Any) -> dict[str, Any]:
    from stages.families import get_family

    family = get_family(cfg.family)
    train = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in NOT_FINGERPRINTED}
    cap, lat = read_manifest(encode_captions.artifact_dir(cfg)), read_manifest(cache_latents.artifact_dir(cfg))
    return {"family": cfg.family, "model": ModelSource(cfg.model, cfg.revision).identity(family.denoiser_components),
            "train": train, "seed": cfg.seed, "captions": cap and cap["fingerprint"], "latents": lat and lat["fingerprint"]}


def check_upstream(cfg: Any) -> None:
    """Refuse to train on missing or stale caches, saying which stage to rerun and why."""
    from stages.core.stage import staleness

    for module in (encode_captions, cache_latents):
        ok, reasons = staleness(module, cfg)
        if not ok:
            raise ArtifactError(f"{module.artifact_dir(cfg).name} is not up to date for this config "
                                f"({'; '.join(reasons)[:400]}): run `python pipeline.py {module.NAME} "
                                f"--config <your config>` first (run '{cfg.run}')")


def run(cfg: Any, resume: bool = False) -> dict[str, Any]:
    from stages.core.runtime import install_model_trace
    from stages.core.stage import running_stage
    from stages.core.trainer import Trainer

    install_model_trace()
    with running_stage(cfg, NAME) as ctx:
        check_upstream(cfg)
        trainer = Trainer(cfg, ctx.log)
        stop_file(cfg.run_dir).unlink(missing_ok=True)
        handler = _StopRequests(stop_file(cfg.run_dir))
        return trainer.fit(resume=resume or cfg.train.resume == "auto", stop=handler, t0=ctx.t0)


class _StopRequests:
    """SIGINT/SIGTERM or a stop file (from `pipeline.py stop`) ask the loop to stop after this step."""

    def __init__(self, path: Path):
        self.path, self.requested, self.save = path, False, True
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True  # a second signal while saving changes nothing: the save completes

    def poll(self) -> bool:
        if not self.requested and self.path.exists():
            try:
                self.save = bool(json.loads(self.path.read_text() or "{}").get("save", True))
            except json.JSONDecodeError:
                self.save = True
            self.requested = True
        return self.requested


def request_stop(run_dir: Path, save: bool) -> int | None:
    """Ask a running train stage to stop; returns its pid or None when no train is running."""
    from stages.core.artifacts import atomic_write_json, lock_holder_pid

    pid = lock_holder_pid(run_dir, NAME)
    if pid is None:
        return None
    atomic_write_json(stop_file(run_dir), {"save": save, "requested_at": time.time(), "by": os.getpid()})
    return pid
