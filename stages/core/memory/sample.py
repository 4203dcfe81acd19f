"""sample's plan: the whole pipeline's precision and CPU offload, and block swap of its denoiser, within a budget."""

from __future__ import annotations

import dataclasses
from typing import Any

from stages.core.memory import budget as budgets
from stages.core.memory import calibration as cal
from stages.core.memory.budget import Budget
from stages.core.memory.latents import vae_elements_per_pixel
from stages.core.memory.sizes import (meta_component, module_components, planned_frames, sample_tokens, weight_bytes,
                                       with_named_blocks, work_width)
from stages.core.memory.stage_plan import Planner, StagePlan, fitting, planned_controls


def plan(cfg: Any, family: Any, src: Any, budget: Budget) -> StagePlan:
    """The whole pipeline the sample stage renders with: bf16 on the GPU, then bf16 under diffusers' model
    CPU offload (one component on the GPU at a time), then the denoiser and text encoders in nf4 on the GPU
    (bitsandbytes through diffusers' PipelineQuantizationConfig; the VAE stays bf16), then nf4 offloaded.
    `sample.precision` other than "auto" fixes the precision, `sample.cpu_offload = true` the offload.
    A pipeline on the GPU whole is read there shard by shard (`device_map="cuda"`), but an offloaded one
    lives in host memory, so bf16 offload is left out where its weights exceed the host memory available
    (FLUX.2 dev: 112.6 GB), as is bf16 whole from a single-file checkpoint (read on the host first).
    Activations are ESTIMATES, not measured: the denoiser's inference work at the sample size (the
    text encoders' rule: calibration.BLOCK_WORK_UNITS per token and width, calibration.CFG_BATCH rows) and the VAE's decode of one
    image (cache-latents' encode rule), the larger of the two, since they never run together. Below nf4 offloaded,
    the denoiser swaps blocks (`swap_candidates`): the plan's `swapped_blocks`, which no config key sets."""
    s = cfg.sample
    models = {c: meta_component(src, c) for c in module_components(src, family.text_components + family.vae_components
                                                                     + family.denoiser_components + family.sample_components)}
    quantized = set(models) - set(family.vae_components)  # what nf4 quantizes: the text encoders and the denoiser
    width, height = s.width or cfg.data.resolution, s.height or cfg.data.resolution
    frames = (s.frames or planned_frames(cfg, family)) if family.trains_video else 1
    text_tokens = cfg.captions.max_sequence_length + family.text_tokens_beyond_max
    tokens = sample_tokens(family, width, height, frames) * (1 + planned_controls(cfg, family)) + text_tokens
    denoisers = set(family.denoiser_components) | set(family.sample_components)
    # the denoiser works over the image and caption tokens, the text side (encoders, LTX-2's connectors) over the
    # caption's alone, each at the width its blocks run at
    work = {c: cal.CFG_BATCH * (tokens if c in denoisers else text_tokens) * work_width(models[c]) * 2 * cal.BLOCK_WORK_UNITS
            for c in quantized}
    # the VAE decodes a clip a latent frame at a time (cached features) into every frame's fp32 pixels
    in_flight = min(frames, family.vae_frames_in_flight)
    work.update({c: width * height * (vae_elements_per_pixel(models[c]) * in_flight * 2 + (3 * 4 * frames if frames > 1 else 0))
                 for c in family.vae_components})
    fixed_gb, per_sample_gb = family.outside_block_gb  # SDXL's ResNets (train's figure: an upper bound)
    work[family.denoiser_components[0]] += (fixed_gb + per_sample_gb * cal.CFG_BATCH * width * height / 512**2) * cal.GB
    precisions = ["bf16", "nf4"] if s.precision == "auto" else [s.precision]
    offloads = [True] if s.cpu_offload else [False, True]
    host, notes, candidates = budgets.host_available_bytes(), [], []
    sizes_of = {p: {c: weight_bytes(m, p if (p != "nf4" or c in quantized) else "bf16") for c, m in models.items()}
                for p in precisions}  # each component's weights per precision: nf4 leaves the VAE as it is
    for precision, sizes in sizes_of.items():
        for offload in offloads:
            on_host = precision != "nf4" and (offload or src.is_single_file)
            if on_host and host is not None and sum(sizes.values()) > host and len(precisions) * len(offloads) > 1:
                notes.append(f"{precision}{' offloaded' if offload else ''} left out: its {sum(sizes.values()) / cal.GB:.1f} GB "
                             f"of weights exceed the {host / cal.GB:.1f} GB of host memory available")
                continue
            peak = (max(sizes[c] + work[c] for c in models) if offload
                    else sum(sizes.values()) + max(work.values()))
            candidates.append(({"precision": precision, "cpu_offload": offload}, peak / cal.GB))
    if not src.is_single_file and "nf4" in sizes_of:  # a single-file denoiser is read whole on the host first
        candidates += swap_candidates(family, models, work, sizes_of["nf4"], offloads)
    plan = fitting(budget, candidates, "sample", "lower sample.width and sample.height")
    plan.note = "; ".join([*notes, plan.note] if plan.note else notes)
    return plan


def swap_candidates(family: Any, models: dict[str, Any], work: dict[str, float], sizes: dict[str, int],
                    offloads: list[bool]) -> list[tuple[dict[str, Any], float]]:
    """After nf4 offloaded: the same with the last k of the denoiser's repeated blocks in host memory, copied to
    the GPU as each runs (train's block swap: two GPU slots of the largest), k in eighths of the blocks up to all,
    fewest first; the rest of the denoiser and its slots' memory are given up while another component runs, as
    each of those is offloaded (stages/core/pipeline_swap.py). For a family of one denoiser, where nf4 and
    offload are allowed. `sizes`: each component's weights in the nf4 pipeline."""
    from stages.core import blockswap
    from stages.core.blockswap import SLOTS

    if True not in offloads or family.sample_components or len(family.denoiser_components) != 1:
        return []
    name = family.denoiser_components[0]
    blocks = blockswap.repeated_blocks(with_named_blocks(models[name], family))
    if len(blocks) <= SLOTS:  # the two slots would hold every swapped block: nothing saved
        return []
    codes = [weight_bytes(b, "nf4", codes_only=True) for b in blocks]
    n, step = len(blocks), max(1, len(blocks) // 8)
    others = max((sizes[c] + work[c] for c in models if c != name), default=0.0)
    out = []
    for k in sorted({*range(step, n, step), n} - set(range(SLOTS + 1))):
        host = [codes[i] for i in blockswap.swapped_positions(n, k, "last")]
        slots = SLOTS * max(host) + cal.SWAP_EXTRA_GB * cal.GB
        out.append(({"precision": "nf4", "cpu_offload": True, "swapped_blocks": k},
                    max(slots + sizes[name] - sum(host) + work[name], others) / cal.GB))
    return out


PLANNER = Planner(
    "sample", plan,
    configured=lambda cfg: {"precision": cfg.sample.precision, "cpu_offload": cfg.sample.cpu_offload},
    apply=lambda cfg, s: dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample, precision=s["precision"],
                                                                             cpu_offload=s["cpu_offload"])),
    to_change="sample.width and sample.height, or set sample.precision = 'nf4' and sample.cpu_offload = true",
    keys={"precision": "sample.precision", "cpu_offload": "sample.cpu_offload"},
    last_resort=lambda cfg, family: "lower sample.width and sample.height")
