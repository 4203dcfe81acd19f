"""`lorapipe lora posthoc-ema <run> --sigma-rel 0.05`: an EMA of the adapter chosen after training, from
the run's saved checkpoints.

Karras et al. (2024, "Analyzing and Improving the Training Dynamics of Diffusion Models") average the
weights with a power-function EMA, ema_t = beta_t ema_{t-1} + (1 - beta_t) theta_t with
beta_t = (1 - 1/t)^(gamma + 1), whose width relative to the training length is sigma_rel (gamma solves
their Algorithm 2's cubic). Their post-hoc method needs two such EMAs saved at every checkpoint; a run
here saves the adapter itself (and at most one constant-decay EMA), so this computes the practical
version: the power-function EMA at the last checkpoint step T of the trajectory that holds each saved
adapter from the step after the previous checkpoint to its own. Exactly:

    theta_ema = sum_k w_k theta_k,   w_k = (t_k / T)^(gamma + 1) - (t_{k-1} / T)^(gamma + 1),   t_0 = 0

over the checkpoints t_1 < ... < t_n = T (lora/final too when it is newer than the last checkpoint); this
is what the step-by-step update above gives on that trajectory, since the weight it gives step s is
(s^(gamma+1) - (s-1)^(gamma+1)) / T^(gamma+1). The oldest kept checkpoint stands for all steps before it.
Every adapter tensor (lora_A and lora_B, DoRA's magnitude, LoKr/LoHa factors) is averaged, as the
training's own EMA (train.ema_decay) averages the parameters. The result is written like an export (the
diffusers file and the ComfyUI-ready file) and checked as `export-lora --verify` checks one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from stages.core.artifacts import ArtifactError

RECIPE = "posthoc_ema.json"  # beside the files: sigma_rel, gamma, the steps averaged and their weights


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The power-function exponent of a relative EMA width: the positive root of
    gamma^3 + 7 gamma^2 + (16 - sigma_rel^-2) gamma + (12 - sigma_rel^-2) = 0 (Karras et al., Algorithm 2)."""
    if not 0.0 < sigma_rel < 12 ** -0.5:  # gamma > 0 needs 12 - sigma_rel^-2 < 0
        raise ArtifactError(f"--sigma-rel {sigma_rel}: give a value in (0, 0.288), e.g. 0.05 (short) to 0.2 (long)")
    t = sigma_rel ** -2
    roots = np.roots([1.0, 7.0, 16.0 - t, 12.0 - t])
    return float(max(r.real for r in roots if abs(r.imag) < 1e-9 and r.real > 0))


def ema_weights(steps: list[int], gamma: float) -> list[float]:
    """w_k = (t_k / T)^(gamma+1) - (t_{k-1} / T)^(gamma+1), t_0 = 0, T = the last step (they sum to 1)."""
    total = float(steps[-1])
    edges = [0.0] + [s / total for s in steps]
    return [edges[i + 1] ** (gamma + 1) - edges[i] ** (gamma + 1) for i in range(len(steps))]


def saved_adapters(lora_dir: Path) -> list[tuple[int, Path, dict[str, Any]]]:
    """(step, folder, manifest) of the complete checkpoints of the newest training, by step; lora/final
    added when it is newer than its last checkpoint and of the same training."""
    from stages.core.artifacts import read_manifest
    from stages.core.caches import complete_checkpoints, step_of

    found = [(step_of(p), p, read_manifest(p) or {}) for p in complete_checkpoints(lora_dir)]
    if found:
        newest = found[-1][2].get("fingerprint")
        found = [f for f in found if f[2].get("fingerprint") == newest]
    final = read_manifest(lora_dir / "final")
    if final and final.get("step") and (not found or (final.get("fingerprint") == found[-1][2].get("fingerprint")
                                                      and final["step"] > found[-1][0])):
        found.append((int(final["step"]), lora_dir / "final", final))
    return found


def averaged(points: list[tuple[int, Path, dict[str, Any]]], weights: list[float]) -> tuple[dict[str, Any], dict[str, Any]]:
    """sum_k w_k state_k over the adapters (float64 sums, stored as float32), and their shared LoRA config."""
    import torch

    from stages.core import lora

    total: dict[str, torch.Tensor] = {}
    config: dict[str, Any] | None = None
    for (step, folder, _), w in zip(points, weights):
        state, cfg = lora.load_adapter_files(folder)
        if config is None:
            config, keys = cfg, set(state)
        elif cfg != config or set(state) != keys:
            raise ArtifactError(f"'{folder}' holds another adapter (its config or keys) than '{points[0][1]}' although "
                                f"both name one training; remove the odd one, or export the checkpoints one by one")
        for k, v in state.items():
            total[k] = total.get(k, 0) + v.double() * w
    return {k: v.float().contiguous() for k, v in total.items()}, config or {}


def run(cfg: Any, sigma_rel: float, out: Path | None) -> dict[str, Any]:
    """Write the post-hoc EMA of `cfg`'s run at `sigma_rel` into `out` (default
    artifacts/<run>/posthoc-ema/sigma-<sigma_rel>/; a two-expert family's into its <expert>/ there, for each
    expert the run trains); returns its summary (the last expert's, with `experts` holding each one's)."""
    from stages.core.caches import expert_configs, expert_folder
    from stages.families import get_family

    family = get_family(cfg.family)
    target = out or cfg.run_dir / "posthoc-ema" / f"sigma-{sigma_rel:g}"
    done = [run_one(unit, sigma_rel, expert_folder(target, unit.train.expert), family.file_tag(unit.train))
            for unit in expert_configs(cfg, family.experts)]
    return done[0] if len(done) == 1 else {**done[-1], "experts": done}


def run_one(cfg: Any, sigma_rel: float, target: Path, tag: str) -> dict[str, Any]:
    """One adapter's post-hoc EMA (the run's, or one expert's) into `target`; `tag`: its ComfyUI file's."""
    from stages.core.artifacts import atomic_dir, atomic_write_json
    from stages.core.caches import lora_dir

    gamma = sigma_rel_to_gamma(sigma_rel)
    points = saved_adapters(lora_dir(cfg))
    if len(points) < 2:
        raise ArtifactError(f"run '{cfg.run}' has {len(points)} saved adapter(s) in '{lora_dir(cfg)}'; a "
                            f"post-hoc EMA averages several checkpoints: train with more of them kept (`lorapipe "
                            f"keys | grep checkpoint` lists the settings)")
    steps = [p[0] for p in points]
    weights = ema_weights(steps, gamma)
    state, lora_cfg = averaged(points, weights)
    manifest = points[-1][2]
    recipe = {"sigma_rel": sigma_rel, "gamma": gamma, "steps": steps, "weights": weights}
    with atomic_dir(target) as tmp:
        files, checks = write_files(cfg, manifest, state, lora_cfg, tmp, "_".join(filter(None, (f"{cfg.run}-ema{sigma_rel:g}", tag))),
                                    {"lorapipe_posthoc_ema": json.dumps(recipe)})
        atomic_write_json(tmp / RECIPE, {**recipe, "family": manifest["family"], "files": [f.name for f in files],
                                         "sources": [str(p[1]) for p in points], "checks": checks})
    return {"folder": str(target), "files": [str(target / f.name) for f in files], **recipe,
            "notes": [c["note"] for c in checks.values() if c.get("note")]}


def write_files(cfg: Any, manifest: dict[str, Any], state: dict[str, Any], lora_cfg: dict[str, Any], tmp: Path,
                name: str, note: dict[str, str]) -> tuple[list[Path], dict[str, Any]]:
    """The export's files of an adapter state (diffusers, except for LoKr and LoHa, with `note` in its
    header; and the ComfyUI-ready file), checked as `export-lora --verify` checks them."""
    from stages.core.caches import scale_folded, write_diffusers
    from stages.core.comfyui_file import COMFYUI_SUFFIX, write_comfyui
    from stages.core.lora import adapter_type
    from stages.core.model_source import model_source
    from stages.core.verify import verify_export
    from stages.families import get_family

    files = []
    if adapter_type(lora_cfg) not in ("lokr", "loha"):
        files.append(write_diffusers(*scale_folded(state, lora_cfg), manifest, tmp, note))
    files.append(write_comfyui(state, lora_cfg, manifest, tmp / f"{name}{COMFYUI_SUFFIX}",
                               get_family(manifest["family"]).comfyui_layout, model_source(cfg)))
    return files, verify_export(cfg, manifest, files, state, lora_cfg)
