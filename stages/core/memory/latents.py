"""cache-latents' plan: the VAE's precision, slicing and tiling within a budget."""

from __future__ import annotations

import dataclasses
from typing import Any

from stages.core.memory import calibration as cal
from stages.core.memory.budget import Budget
from stages.core.memory.sizes import meta_component, planned_frames, weight_bytes
from stages.core.memory.stage_plan import Planner, StagePlan, data_sides, fitting


def plan(cfg: Any, family: Any, src: Any, budget: Budget) -> StagePlan:
    vae = meta_component(src, family.vae_components[0])
    configured = configured_vae_precision(cfg)
    tile = tile_pixels(vae)
    options = [(configured, False, False), (configured, True, False), ("bf16", True, False),
               (configured, True, True), ("bf16", True, True)]
    candidates, seen = [], set()
    frames = planned_frames(cfg, family)
    in_flight = min(frames, family.vae_frames_in_flight)  # Wan's causal encoder: the first frame, then 4 at a time
    for precision, sliced, tiled in options:
        if (precision, sliced, tiled) in seen or (tiled and tile is None):
            continue
        seen.add((precision, sliced, tiled))
        images = 1 if sliced else max(d.cache_variants for d in cfg.dataset_configs())
        resolution = max(d.resolution for d in cfg.dataset_configs())  # the largest of several datasets
        side = min(tile, resolution) if tiled else resolution
        size = 4 if precision == "fp32" else 2
        work = images * side * side * vae_elements_per_pixel(vae) * in_flight * size
        # a clip's frames are on the device whole (fp32 pixels and their cast) while the VAE walks them
        work += images * resolution * resolution * 3 * frames * (4 + size) if frames > 1 else 0
        candidates.append(({"vae_precision": precision, "sliced": sliced, "tiled": tiled},
                           (weight_bytes(vae, precision) + work) / cal.GB))
    return fitting(budget, candidates, "cache-latents", data_sides(cfg, family))


def tile_pixels(vae: Any) -> int | None:
    """The side in pixels of the VAE's tiles when the plan tiles its encode (None: its class is never tiled).
    Wan's VAE cuts its tiles after patchifying the pixels, so its tiles (counted in patches) cover patch_size
    times as many pixels a side: 512 px at Wan 2.2 TI2V-5B's patch 2, measured (bench/results/tiling-video/)."""
    name = type(vae).__name__
    tile = cal.VAE_TILE_PIXELS.get(name)
    patch = _patch_size(vae) if name in cal.VAE_TILES_IN_PATCHES else None
    return tile * patch if tile and patch else tile


def vae_elements_per_pixel(vae: Any) -> int:
    """The VAE's work per pixel of one image (calibration.VAE_ELEMENTS_PER_PIXEL: its class's with its patch size
    where one is listed, else its class's, else the largest)."""
    name, table = type(vae).__name__, cal.VAE_ELEMENTS_PER_PIXEL
    return table.get(f"{name}/patch{_patch_size(vae)}", table.get(name, max(table.values())))


def _patch_size(vae: Any) -> int | None:
    """The pixels a side the VAE folds into channels before its encoder (its config's patch_size; None: none)."""
    return getattr(getattr(vae, "config", None), "patch_size", None)


def configured_vae_precision(cfg: Any) -> str:
    """The VAE precision `cfg` asks for ("auto": bf16, the planner's first choice)."""
    return "bf16" if cfg.latents.vae_precision == "auto" else cfg.latents.vae_precision


def _forced_only(cfg: Any, plan: StagePlan) -> bool:
    """A plan with a lower VAE precision than configured, or a tiled encode: other numbers, which "auto"
    stores only when the free memory forces them (FLUX.2 klein at 1024 px cached bf16 latents on a free
    H200 for a 3 GB train stage before this rule)."""
    return plan.settings["vae_precision"] != configured_vae_precision(cfg) or plan.settings["tiled"]


PLANNER = Planner(
    "cache-latents", plan,
    configured=lambda cfg: {"vae_precision": cfg.latents.vae_precision, "sliced": False, "tiled": False},
    apply=lambda cfg, s: dataclasses.replace(cfg, latents=dataclasses.replace(cfg.latents, vae_precision=s["vae_precision"])),
    to_change="latents.vae_precision = 'bf16' or data.resolution", under_train_peak=True, forced_only=_forced_only,
    keys={"vae_precision": "latents.vae_precision"}, last_resort=data_sides)
