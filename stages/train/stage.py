"""Stage 3: train a LoRA on the cached latents and captions. Loads only the denoiser.

    lorapipe train <run> [--resume | --restart]

Each step: draw a batch from one bucket, pick a random cached variant per item, draw a fresh latent
sample mean + exp(logvar/2) * eps, normalize it as the family's VAE does, and take one denoiser
forward over the whole batch. Writes lora/checkpoint-<step>/ (resumable) and lora/final/; a two-expert
family's run writes lora/<expert>/..., and with train.expert = "both" trains each expert in turn (high,
then low), each as a run of that expert alone would (one model in memory at a time), skipping one
that is up to date.
Stop with Ctrl-C, SIGTERM or `lorapipe stop <run> [--no-save]`; `--resume` continues. Nothing starts
over unasked: a finished run of these settings is up to date (skipped); a plain `train` over an
unfinished one refuses and names `--resume` and `--restart`; over a training of other settings, plain
and `--resume` alike refuse, naming what differs. `--restart` starts over and sets the old
checkpoints aside (stages/train/checkpoints.py), which `status` lists until they are removed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from stages.core.artifacts import ArtifactError, fingerprint, manifest_damage, read_manifest
from stages.core.caches import captions_dir, complete_checkpoints, latents_dir, lora_dir, lora_final_dir, step_of
from stages.core.config import command
from stages.core.runspec import save_then
from stages.core.model_source import model_source

NAME = "train"


def artifact_dir(cfg: Any) -> Path:
    return lora_final_dir(cfg)


def stop_file(run_dir: Path) -> Path:
    return run_dir / "train.stop"


def folder_name(cfg: Any) -> str:
    """The adapter folder of one expert's (or a one-denoiser run's) config, as messages name it: lora, lora/high."""
    return lora_dir(cfg).relative_to(cfg.run_dir).as_posix()


def fingerprint_parts(cfg: Any) -> dict[str, Any]:
    """What the adapter is made from; for train.expert = "both", each expert's adapter's, by expert."""
    from stages.registry import each_expert

    if cfg.train.expert == "both":
        return {unit.train.expert: fingerprint_parts(unit) for unit in each_expert(cfg)}
    return _fingerprint_parts(cfg)


def _fingerprint_parts(cfg: Any) -> dict[str, Any]:
    from stages.core import lora
    from stages.families import get_family

    family = get_family(cfg.family)
    cap, lat = read_manifest(captions_dir(cfg)), read_manifest(latents_dir(cfg))
    # what each dataset trains (repeats, weights, caption dropout) and the held-out split change what is
    # learned, not the caches; [runtime] changes neither, so it is not here
    sampling = [{k: getattr(d, k) for k in ("repeats", "weight", "caption_dropout")} for d in cfg.dataset_configs()]
    for part, d in zip(sampling, cfg.dataset_configs()):
        if d.role != "train":
            part["role"] = d.role
    # train.assistant_adapter by content: a changed file at the same path is another base
    assistant = lora.assistant_identity(cfg.train.assistant_adapter)
    return {"family": cfg.family, "model": model_source(cfg).identity(family.denoiser_components),
            "train": dataclasses.asdict(cfg.train), "seed": cfg.seed, "captions": cap and cap["fingerprint"],
            "latents": lat and lat["fingerprint"], "sampling": sampling, "validation_split": cfg.validation.split,
            **({"assistant": assistant} if assistant else {})}


def partial_state(cfg: Any) -> str | None:
    """For `status`: a run killed before lora/final was written, and what continues it."""
    found = complete_checkpoints(lora_dir(cfg))
    if not found:
        return None
    return other_settings(cfg) or (f"interrupted: no {folder_name(cfg)}/final yet, newest complete checkpoint is {found[-1].name}; "
                                   f"`{command(cfg, NAME, '--resume')}` (or `run`) continues from it")


def describe_change(cfg: Any, manifest: dict[str, Any], key: str, old: Any, new: Any) -> str:
    """A fingerprint part as a user reads it: the caches by name, not by hash."""
    from stages.core.stage import describe_change as plain, model_change

    if key == "model":  # a content hash: said as the path and what happened to it
        return model_change(cfg.model, old, new)
    if key in ("captions", "latents"):
        folder = (captions_dir if key == "captions" else latents_dir)(cfg)
        gone = "cannot be read (its manifest is damaged)" if manifest_damage(folder) else "is missing"
        return f"{key}.zarr {'was rebuilt since' if old and new else gone if not new else 'was built since'}"
    return plain(key, old, new)


def trained_with(cfg: Any) -> tuple[str, dict[str, Any]] | None:
    """The newest training of the run ('lora/final' or a checkpoint) and its manifest, if any."""
    from stages.core.artifacts import read_manifest

    final = read_manifest(lora_final_dir(cfg))
    if final is not None:
        return f"{folder_name(cfg)}/final (step {final.get('step')})", final
    found = complete_checkpoints(lora_dir(cfg))
    return (f"{folder_name(cfg)}/{found[-1].name}", read_manifest(found[-1])) if found else None


def other_settings(cfg: Any) -> str | None:
    """When the run's newest training was made with other settings than `cfg` (and no checkpoint of
    `cfg` continues it): what differs, and the commands that train again or go back; else None. For
    train.expert = "both": the first expert's of which that holds."""
    from stages.registry import each_expert
    from stages.train.checkpoints import Checkpoints

    if cfg.train.expert == "both":
        return next(filter(None, (other_settings(unit) for unit in each_expert(cfg))), None)
    parts = fingerprint_parts(cfg)
    newest = trained_with(cfg)
    if newest is None or newest[1].get("fingerprint") == fingerprint(parts):
        return None
    if Checkpoints(lora_dir(cfg), fingerprint(parts), 0, None).matching():
        return None
    where, manifest = newest
    old = manifest.get("fingerprint_parts", {})
    what = [describe_change(cfg, manifest, k, old.get(k), parts.get(k)) for k in sorted(set(old) | set(parts)) if old.get(k) != parts.get(k)]
    return (f"{where} was trained with other settings ({'; '.join(what)[:400] or 'fingerprint changed'}), and no "
            f"checkpoint of these settings continues it: {save_then(cfg.run_dir, NAME, '--restart')} trains again from "
            f"step 0 (the earlier checkpoints and adapter are set aside in {folder_name(cfg)}/.restarted-<time>/, nothing "
            f"is deleted)")


def refuse_unfinished(cfg: Any, resume: bool) -> None:
    """A plain `train` never starts at step 0 over an earlier training, and `--resume` never starts over:
    an unfinished run of this config needs --resume, one of other settings --restart."""
    from stages.train.checkpoints import Checkpoints

    found = Checkpoints(lora_dir(cfg), fingerprint(fingerprint_parts(cfg)), 0, None).unfinished()
    if found is not None and not resume:
        raise ArtifactError(
            f"run '{cfg.run}' has an unfinished training made with this config ({found}, step {step_of(found)} of "
            f"{cfg.train.steps}): continue it with `{command(cfg, NAME, '--resume')}`, or start over with "
            f"`{command(cfg, NAME, '--restart')}` (the old checkpoints are moved to {folder_name(cfg)}/.restarted-<time>/, "
            f"nothing is deleted)")
    changed = other_settings(cfg)
    if changed is not None:
        raise ArtifactError(f"run '{cfg.run}': {changed}")


def up_to_date(cfg: Any, log: Any) -> dict[str, Any] | None:
    """The finished training's manifest when it matches `cfg` (then there is nothing to train), else None."""
    from stages import registry
    from stages.core.stage import staleness

    if not staleness(registry.get(NAME), cfg)[0]:
        return None
    manifest = read_manifest(artifact_dir(cfg))
    log.emit("up_to_date", fingerprint=manifest["fingerprint"], **({"expert": cfg.train.expert} if cfg.train.expert else {}))
    return {**manifest, "up_to_date": True}


def check_upstream(cfg: Any, log: Any = None) -> None:
    """Refuse to train on missing or stale caches, saying which stage to rerun and why. A cache that
    differs only by what the free GPU memory forced on it (tiled latents under "auto") is used, with
    a warning saying so and what re-encodes it as configured."""
    from stages import registry
    from stages.core.stage import freshness

    stale = []
    for stage in registry.reads_of(NAME):
        ok, reasons, forced, _ = freshness(stage, cfg)
        if forced and log is not None:
            log.emit("warning", message=f"training on {stage.artifact_dir(cfg).name} as it is: {forced} "
                                        f"(`{command(cfg, stage.name)}`)")
        if not ok and not forced:
            stale.append((stage, reasons))
    if stale:
        why = "; ".join(f"{s.artifact_dir(cfg).name}: {_cut('; '.join(r), 300)}" for s, r in stale)
        rerun = " and ".join(f"`{command(cfg, s.name)}`" for s, _ in stale)
        raise ArtifactError(f"the caches of run '{cfg.run}' are not ready for this config ({why}): run {rerun} "
                            f"first (or `{command(cfg, 'run')}`, which reruns exactly the stale stages)")


def _cut(text: str, n: int) -> str:
    """`text` cut to about `n` characters of prose; a command in backticks is kept whole (it must paste)."""
    prose, tick, rest = text.partition("`")
    return text if len(text) <= n else prose[:n] + ("… `" + rest if tick else "…")


def run(cfg: Any, resume: bool = False, restart: bool = False) -> dict[str, Any]:
    """Train; `resume` continues the newest checkpoint of this config (also with runtime.resume =
    'auto'), `restart` starts at step 0 over an unfinished run (its checkpoints are set aside). With
    train.expert = "both" each expert in turn, as `train_expert`; a stop ends the stage in the expert it
    stopped (the manifest says which), and the returned manifest is the last expert's with `experts`
    holding each one's."""
    from stages.core.runtime import install_model_trace
    from stages.families import library_notices
    from stages.core.stage import running_stage
    from stages.registry import conflicts, each_expert

    install_model_trace(NAME, library_notices())
    resume = (resume or cfg.runtime.resume == "auto") and not restart
    with running_stage(cfg, NAME, rerun=("--resume",), own_signals=True, beside=conflicts(NAME)) as ctx, _StopRequests(stop_file(cfg.run_dir), since=ctx.t0) as stop:
        check_upstream(cfg, ctx.log)
        units, done = each_expert(cfg), {}
        for unit in units:  # each expert's summary counts its own seconds
            t0 = ctx.t0 if unit is units[0] else time.time()
            done[unit.train.expert] = result = train_expert(unit, ctx, stop, resume, restart, t0)
            if result.get("stopped"):
                break
        if len(units) == 1:
            return result
        return {**result, "up_to_date": all(r.get("up_to_date") for r in done.values()), "experts": done}


def train_expert(cfg: Any, ctx: Any, stop: Any, resume: bool, restart: bool, t0: float) -> dict[str, Any]:
    """One adapter's training (the run's, or one expert's of a "both" run): skipped when up to date, else
    trained, then its model and optimizer freed (and CUDA's cached blocks) before the next one loads."""
    import gc

    from stages.train.trainer import Trainer

    if not restart:
        done = up_to_date(cfg, ctx.log)
        if done is not None:
            return {**done, **({"expert": cfg.train.expert} if cfg.train.expert else {})}
        refuse_unfinished(cfg, resume)
    trainer = Trainer(cfg, ctx.log, ctx.dist)
    try:
        result = trainer.fit(resume=resume, stop=stop, t0=t0)
    finally:
        trainer.release()
        del trainer
        gc.collect()
    return {**result, **({"expert": cfg.train.expert} if cfg.train.expert else {})}


class _StopRequests:
    """SIGINT/SIGTERM or a stop file (from `pipeline.py stop`) ask the loop to stop after this step.

    Signals only set a flag, which the loop reads between steps, so a signal can never cut a step
    or a save in half; a second signal during the save changes nothing (SIGKILL still kills, and
    the temp-folder-then-rename saves make that safe too). The previous handlers come back on exit.
    """

    def __init__(self, path: Path, since: float):
        self.path, self.since, self.requested, self.save, self.signals = path, since, False, True, 0

    def __enter__(self) -> "_StopRequests":
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self.path.unlink(missing_ok=True)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested, self.signals = True, self.signals + 1

    def poll(self) -> bool:
        if not self.requested and self.path.exists():
            try:
                request = json.loads(self.path.read_text() or "{}")
            except json.JSONDecodeError:
                request = {}
            # a stop file left from an earlier run (older than this one) is not a request to this run
            if request.get("requested_at", self.since) >= self.since:
                self.save, self.requested = bool(request.get("save", True)), True
        return self.requested


def request_stop(run_dir: Path, save: bool) -> int | None:
    """Ask a running train stage to stop; returns its pid or None when no train is running."""
    from stages.core.artifacts import atomic_write_json, lock_holder_pid

    pid = lock_holder_pid(run_dir, NAME)
    if pid is None:
        return None
    atomic_write_json(stop_file(run_dir), {"save": save, "requested_at": time.time(), "by": os.getpid()})
    return pid
