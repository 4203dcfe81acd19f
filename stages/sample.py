"""Stage 5 (optional): render prompts with the base model and with the trained LoRA -> samples/grid.png.

    lorapipe sample --config configs/flux-dev.toml      # its own process, after export-lora
    lorapipe run --config ... --set sample.after_train=true

Loads the whole pipeline (text encoders, VAE, denoiser: the one stage that needs them together, so
it runs alone, after training has freed the GPU), renders every `sample.prompts` x `sample.seeds`
with the base model, then with the exported LoRA (export/pytorch_lora_weights.safetensors, the file
users ship) and, with `sample.every_n_checkpoints`, with kept checkpoints too. The same seed gives
the same starting noise in every column, so a column differs from the base only by the adapter. A
two-expert family (Wan 2.2 A14B) renders through both experts, each LoRA the run trains on its own
expert (export/high/ on `transformer`, export/low/ on `transformer_2`), together in one column.

Rows are prompt x seed, columns base | checkpoints... | final; edit families (flux-kontext,
qwen-image-edit; flux2-klein and flux2 on items with reference images) render the first dataset
items' instructions with their control images, and the grid starts with a control column:
control | base | ... | final. Written with its manifest (prompts, seeds, adapters, settings) to
artifacts/<run>/samples/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from stages.core import faults
from stages.core.artifacts import ArtifactError, atomic_dir, fingerprint, read_manifest, write_manifest
from stages.core.caches import DIFFUSERS_FILE, export_dir, lora_dir, samples_dir, scan_items, write_diffusers
from stages.core.config import command
from stages.core.errors import ConfigError
from stages.core.model_source import model_source

NAME = "sample"
GRID = "grid.png"
MIN_CELL = 128  # tiny demo images (64 px) are upscaled so a grid stays readable


def artifact_dir(cfg: Any) -> Path:
    return samples_dir(cfg)


def edit_items(cfg: Any) -> list[Any] | None:
    """Edit families: the first 3 dataset items, whose instructions and controls the grid renders;
    None for text-to-image families and for a family with optional references (FLUX.2) whose items
    have none."""
    from stages.families import get_family

    if not get_family(cfg.family).control_range[1]:  # a family that takes no controls
        return None
    items = scan_items(cfg, get_family(cfg.family))[:3]
    if not any(it.controls for it in items):  # a family whose controls are optional, trained text-to-image
        return None
    return items


def rows_of(cfg: Any, items: list[Any] | None) -> list[tuple[str, tuple[Path, ...]]] | None:
    """(instruction, control images) per edit item, a prompt of sample.prompts replacing the caption
    of the item in its place."""
    if items is None:
        return None
    prompts = list(cfg.sample.prompts) + [it.caption for it in items[len(cfg.sample.prompts):]]
    return [(prompt, it.controls) for prompt, it in zip(prompts, items)]


def edit_rows(cfg: Any) -> list[tuple[str, tuple[Path, ...]]] | None:
    """Edit families: (instruction, control images) of the first 3 dataset items; None otherwise."""
    return rows_of(cfg, edit_items(cfg))


Rows = list[tuple[str, tuple[Path, ...]]] | None  # edit_rows: (instruction, controls), or None


def planned_rows(cfg: Any) -> tuple[Rows, list[str], list[Path] | None]:
    """(edit_rows, the prompts rendered, the edit rows' target images): read from the dataset once
    per sample run (an edit family's rows scan and hash it)."""
    items = edit_items(cfg)
    rows = rows_of(cfg, items)
    return rows, prompts_of(cfg, rows), None if items is None else [it.image_path for it in items]


def prompts_of(cfg: Any, rows: Rows) -> list[str]:
    if rows is not None:
        return [prompt for prompt, _ in rows]
    if cfg.sample.prompts:
        return list(cfg.sample.prompts)
    from stages.core import dataset

    return sorted({it.caption for it in dataset.scan_run(cfg, ids=False)})[:3]  # captions only: no image read


def fingerprint_parts(cfg: Any, planned: tuple[Rows, list[str], list[Path] | None] | None = None) -> dict[str, Any]:
    """`planned`: `planned_rows(cfg)` when the caller has it (read from the dataset otherwise)."""
    from stages.families import get_family

    rows, prompts, targets = planned or planned_rows(cfg)
    family = get_family(cfg.family)
    components = family.text_components + family.vae_components + family.denoiser_components
    exports = [(read_manifest(export_dir(unit)) or {}).get("fingerprint") for unit in each_expert(cfg)]
    settings = {k: v for k, v in dataclasses.asdict(cfg.sample).items() if k not in ("after_train", "cpu_offload")}
    return {"family": cfg.family, "model": model_source(cfg).identity(components),
            "export": exports[0] if len(exports) == 1 else exports, "sample": settings, "prompts": prompts,
            "checkpoints": [name for name, _ in checkpoint_columns(cfg)], "resolution": cfg.data.resolution,
            **({"controls": [[dataset_id(p) for p in controls] for _, controls in rows],
                "targets": [dataset_id(p) for p in targets]} if rows is not None else {})}


def dataset_id(path: Path) -> str:
    from stages.core import dataset

    return dataset.content_id(path.read_bytes())


def check_settings(cfg: Any, prompts: list[str]) -> None:
    from stages.core.errors import UserError

    s = cfg.sample
    problems = [msg for bad, msg in [
        (s.steps <= 0, f"'sample.steps' must be > 0, got {s.steps}"),
        (not s.seeds, "'sample.seeds' is empty: give at least one seed"),
        (s.width < 0 or s.height < 0, "'sample.width'/'sample.height' must be >= 0 (0: data.resolution)"),
        (s.every_n_checkpoints < 0, "'sample.every_n_checkpoints' must be >= 0"),
    ] if bad]
    if not prompts:
        problems.append(f"no prompts: set sample.prompts, or give the dataset at '{cfg.data.path}' captions")
    if s.steps == 1 and (terminal := _shift_terminal(cfg)) is not None:
        problems.append(f"'sample.steps' = 1: the model's scheduler stretches its sigmas to shift_terminal = "
                        f"{terminal:g} (scheduler/scheduler_config.json), which divides by zero at one step and "
                        "renders NaN images (diffusers' FlowMatchEulerDiscreteScheduler); use 2 or more steps")
    if problems:
        raise UserError("sample: " + "; ".join(problems))


def _shift_terminal(cfg: Any) -> float | None:
    """The scheduler's `shift_terminal` (Qwen-Image, Qwen-Image-Edit-Plus: 0.02), None where it has none or
    its config cannot be read here (the pipeline's load then says why)."""
    from stages.core.errors import UserError

    try:
        value = model_source(cfg).component_config("scheduler", "scheduler_config.json").get("shift_terminal")
    except UserError:
        return None
    return float(value) if value else None


def chosen_checkpoints(cfg: Any) -> list[Path]:
    """Kept checkpoints (of one adapter's config) whose step is a multiple of every_n_checkpoints x
    runtime.checkpoint_every, except the one at the final step (the exported LoRA is that column already)."""
    n, every = cfg.sample.every_n_checkpoints, cfg.runtime.checkpoint_every
    folder = lora_dir(cfg)
    if n <= 0 or every <= 0 or not folder.is_dir():
        return []
    final = read_manifest(folder / "final")
    found = [p for p in folder.glob("checkpoint-*") if p.name[11:].isdigit() and read_manifest(p) is not None]
    steps = sorted((int(p.name[11:]), p) for p in found)
    return [p for step, p in steps if step % (n * every) == 0 and step != (final or {}).get("step")]


def checkpoint_columns(cfg: Any) -> list[tuple[str, list[tuple[Any, Path]]]]:
    """(checkpoint-N, [(expert's config, its lora/<expert>/checkpoint-N)]) for each chosen step that every
    adapter of the run has (`chosen_checkpoints`); one adapter: its chosen checkpoints."""
    units = each_expert(cfg)
    chosen = [{p.name: p for p in chosen_checkpoints(unit)} for unit in units]
    return [(name, [(unit, found[name]) for unit, found in zip(units, chosen)])
            for name in chosen[0] if all(name in found for found in chosen)]


Column = tuple[str, list[tuple[Path, dict[str, Any]]]]  # label, [(diffusers LoRA file, load_lora_weights kwargs)]


def adapters(cfg: Any, tmp: Path) -> list[Column]:
    """(column label, [(diffusers LoRA file, its load_lora_weights arguments)]) for each column after the
    base: checkpoints, then final; a column holds one file per adapter the run trains (each expert's, put on
    its own expert by the family's `lora_load_kwargs`).

    Checkpoints are written to `tmp` with export-lora's own writer (stages.core.caches), so every column loads through
    the same `load_lora_weights` call the exported file does."""
    from stages.core import lora
    from stages.families import get_family

    family, finals = get_family(cfg.family), []
    for unit in each_expert(cfg):
        final = export_dir(unit)
        export = read_manifest(final)
        if export is None:
            raise ArtifactError(f"'{final}' has no exported LoRA: run `{command(cfg, 'export-lora')}` first")
        if DIFFUSERS_FILE not in export.get("files", [DIFFUSERS_FILE]):
            raise ArtifactError(f"'{final}' holds no diffusers LoRA file (a {export.get('adapter', 'LyCORIS')} adapter "
                                f"is exported for ComfyUI only), and sample loads that file: sample a lora or dora run")
        finals.append((unit, export, final / DIFFUSERS_FILE))
    out: list[Column] = []
    for name, found in checkpoint_columns(cfg):
        files = []
        for unit, ckpt in found:
            state, lora_cfg = lora.load_adapter_files(ckpt)
            folder = tmp / "-".join(filter(None, (ckpt.name, unit.train.expert)))
            folder.mkdir()
            files.append((write_diffusers(state, lora_cfg, read_manifest(ckpt), folder), family.lora_load_kwargs(unit.train)))
        out.append((name, files))
    steps = sorted({str(export.get("step")) for _, export, _ in finals})
    out.append((f"LoRA (step {'/'.join(steps)})", [(file, family.lora_load_kwargs(unit.train)) for unit, _, file in finals]))
    return out


def each_expert(cfg: Any) -> list[Any]:
    from stages.registry import each_expert as units

    return units(cfg)


def load_pipeline(cfg: Any, log: Any, swapped_blocks: int = 0) -> tuple[Any, Any, dict[str, Any]]:
    """The pipeline as cfg.sample says (`render_planned` plans those settings first): (pipeline, runtime,
    what was loaded: precision, cpu_offload and the plan's swapped_blocks). A plan that swaps blocks of the
    denoiser loads it for swapping (stages/core/pipeline_swap.py); `render_columns` installs the swap."""
    import time

    import torch

    from stages.core import pipeline_swap
    from stages.core.runtime import make_runtime
    from stages.families import get_family, pipeline_class

    family = get_family(cfg.family)
    src = model_source(cfg)
    rt = make_runtime(cfg.device, cfg.sample.precision)
    if cfg.sample.precision == "nf4" and not rt.is_cuda:
        raise ConfigError("sample.precision = 'nf4' needs a CUDA GPU (bitsandbytes 4-bit); use 'auto' or 'fp32' on CPU")
    log.emit("loading", component="pipeline", **{"class": family.pipeline_class})
    t = time.time()
    swapped = family.denoiser_components[0] if swapped_blocks else None  # loaded apart, for swapping
    kwargs: dict[str, Any] = ({"quantization_config": nf4_config(family, src, leave_out=swapped)}
                              if cfg.sample.precision == "nf4" else {})
    offload = cfg.sample.cpu_offload and rt.is_cuda
    straight = rt.is_cuda and not offload and not src.is_single_file  # a single-file denoiser is read on the host first
    if swapped:
        pipe = pipeline_swap.load(cfg, family, src, rt, pipeline_class(family), **kwargs)
    else:
        if straight:  # each component read to the GPU shard by shard, never whole in host memory (memory.plan_sample)
            kwargs["device_map"] = "cuda"
        pipe = src.load_pipeline(pipeline_class(family), torch_dtype=rt.dtype, **kwargs)
        if offload:
            pipe.enable_model_cpu_offload()
        elif not straight:  # a device-mapped pipeline refuses .to()
            pipe.to(rt.device)
    pipe.set_progress_bar_config(disable=True)
    log.emit("loaded", component="pipeline", seconds=round(time.time() - t, 3))
    dense = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(rt.dtype, str(rt.dtype))
    return pipe, rt, {"precision": "nf4" if cfg.sample.precision == "nf4" else dense, "cpu_offload": bool(offload),
                      **({"swapped_blocks": swapped_blocks} if swapped_blocks else {})}


def nf4_config(family: Any, src: Any, leave_out: str | None = None) -> Any:
    """The denoiser and the text encoders in bitsandbytes nf4 with bf16 compute (as train and encode-captions
    load them), the VAE as it is: diffusers' and transformers' own 4-bit loaders, shard by shard. `leave_out`:
    a component loaded apart (a denoiser loaded for swapping, quantized block by block)."""
    import torch
    from diffusers.quantizers import PipelineQuantizationConfig

    from stages.core.memory import module_components

    components = family.text_components + family.denoiser_components + family.sample_components
    names = [n for n in module_components(src, components) if n != leave_out]  # no tokenizer or scheduler
    return PipelineQuantizationConfig(quant_backend="bitsandbytes_4bit", components_to_quantize=names, quant_kwargs={
        "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.bfloat16})


def render_column(pipe: Any, cfg: Any, prompts: list[str], size: tuple[int, int], bar: Any,
                  controls: list[list[Any]] | None = None) -> list[Any]:
    """One image per (prompt, seed), in row order. Noise is drawn on the CPU so a seed gives the same
    image on any device. Edit families get each row's control images as the family passes them."""
    import torch

    from stages.families import get_family

    s, family = cfg.sample, get_family(cfg.family)
    kwargs: dict[str, Any] = {"height": size[1], "width": size[0], "num_inference_steps": s.steps, "output_type": "pil",
                              **(family.sample_kwargs(pipe, prompts, s.guidance_scale, s.steps)
                                 or guidance_kwargs(pipe, family, s.guidance_scale)),
                              **({"num_frames": sample_frames(cfg)} if family.trains_video else {})}
    images = []
    for r, prompt in enumerate(prompts):
        extra = family.sample_image_kwargs(controls[r], size) if controls is not None else {}
        for seed in s.seeds:
            context = family.sample_context(size)
            with torch.no_grad(), context:
                out = pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed), **kwargs, **extra)
                images.append(out.frames[0] if family.trains_video else out.images[0])  # a clip: its frames
            faults.hit(NAME)
            bar.advance(1)
    return images


def rendered_unit(cfg: Any) -> str:
    """What sample renders, as its progress and summary count them: "clips" for a video family, else "images"."""
    from stages.families import get_family

    return "clips" if get_family(cfg.family).trains_video else "images"


def sample_frames(cfg: Any) -> int:
    """Frames of each sample clip (video families): sample.frames, else the first dataset's data.frames."""
    return cfg.sample.frames or cfg.dataset_configs()[0].frames


def ignores_guidance(pipe: Any, family: Any) -> bool:
    """The pipeline is step-distilled (`is_distilled` in its model_index.json) and its family's pipeline
    then turns guidance off (`distilled_ignores_guidance`: FLUX.2 klein 4B/9B); it logs so for every image
    handed a scale above 1, its own default 4.0 included."""
    return family.distilled_ignores_guidance and bool(getattr(pipe.config, "is_distilled", False))


def guidance_kwargs(pipe: Any, family: Any, scale: float) -> dict[str, float]:
    """The pipeline call's guidance_scale: `sample.guidance_scale` where set (>= 0), else the pipeline's
    default; 1.0 where the pipeline ignores guidance (the same image at any scale), without its notice
    for every image (`guidance_note` says it once)."""
    if ignores_guidance(pipe, family):
        return {"guidance_scale": 1.0}
    return {"guidance_scale": scale} if scale >= 0 else {}


def guidance_note(pipe: Any, family: Any, scale: float) -> str | None:
    """The stage's one warning when the user set a guidance scale the pipeline ignores."""
    if ignores_guidance(pipe, family) and scale > 1.0:
        return (f"sample.guidance_scale = {scale:g} is ignored: {type(pipe).__name__} is step-distilled "
                "(is_distilled in model_index.json) and samples without guidance")
    return None


def load_controls(cfg: Any, rows: Rows) -> list[list[Any]] | None:
    """Each edit row's control images, read once per sample run for the grid and `edit_errors`."""
    from stages.core import image_io

    return None if rows is None else [[image_io.load_image(p, cfg.data.background) for p in c] for _, c in rows]


def render_columns(pipe: Any, cfg: Any, columns: list[Column], prompts: list[str],
                   size: tuple[int, int], controls: list[list[Any]] | None,
                   after_adapters: Any = None) -> tuple[list[str], list[list[Any]], list[Any]]:
    """The base column, then one per column of `adapters` (its files loaded under one adapter name), each made
    the only active adapter in turn. With `after_adapters` (a pipeline whose denoiser swaps blocks:
    `pipeline_swap.install`), every column's files load first, then it runs, and the base column renders with the
    adapters disabled.
    Edit families (`controls`: `load_controls`): a first column shows each row's (first) control
    image, the edit's input; the latents the pipeline decoded, in render order, come back for
    `edit_error` (text-to-image: [])."""
    from stages.core.events import Progress
    from stages.edit_error import decoded_latents
    from stages.families import get_family

    labels, cells = ["base"], []
    record = decoded_latents(pipe.vae) if controls is not None else contextlib.nullcontext([])
    with Progress("sample", (len(columns) + 1) * len(prompts) * len(cfg.sample.seeds), rendered_unit(cfg)) as bar, \
            record as decoded:
        def load(i: int, files: list[tuple[Path, dict[str, Any]]]) -> None:
            for file, load_kwargs in files:  # one name for the column: each expert's file sits on its own expert
                pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=f"col{i}", **load_kwargs)

        if after_adapters is not None:
            for i, (_, files) in enumerate(columns):
                load(i, files)
            after_adapters()
            if columns:
                pipe.disable_lora()
        cells.append(render_column(pipe, cfg, prompts, size, bar, controls))
        for i, (label, files) in enumerate(columns):
            if after_adapters is None:
                load(i, files)
            else:
                pipe.enable_lora()
            pipe.set_adapters([f"col{i}"], [cfg.sample.lora_scale])
            cells.append(render_column(pipe, cfg, prompts, size, bar, controls))
            labels.append(label)
    if controls is not None:
        labels.insert(0, "control")
        cells.insert(0, [c[0].resize(cells[0][0].size) for c in controls for _ in cfg.sample.seeds])
    return labels, cells, decoded


def edit_errors(pipe: Any, cfg: Any, labels: list[str], decoded: list[Any], targets: list[Path] | None,
                controls: list[list[Any]] | None, size: tuple[int, int]) -> dict[str, Any]:
    """Edit families: the columns' latent error to the targets and the LoRA's gain over the base
    (manifest keys `edit_error`, `edit_closer_percent`); {} for text-to-image families."""
    from stages import edit_error
    from stages.families import get_family

    if controls is None or targets is None:
        return {}
    rendered = [label for label in labels if label != "control"]
    errors = edit_error.column_errors(pipe, get_family(cfg.family), rendered, decoded, targets, controls, size,
                                      cfg.data.background, len(cfg.sample.seeds))
    return {"edit_error": errors, "edit_closer_percent": edit_error.closer_percent(errors, rendered[-1]),
            "edit_summary": edit_error.summary(errors, rendered[-1])}


def render_planned(cfg: Any, log: Any, columns: list[Column], prompts: list[str], size: tuple[int, int],
                   edits: Any, targets: list[Path] | None) -> dict[str, Any]:
    """Plan, load and render every column (and score an edit grid). The plan's activations are estimates: a
    CUDA out-of-memory error frees the pipeline and goes on with the next smaller plan (bf16 offloaded, nf4,
    nf4 offloaded), with a warning, until none is left; then the error stands (the stage names it)."""
    import gc

    import torch

    from stages.core import memory
    from stages.families import get_family

    family = get_family(cfg.family)
    model_source(cfg).check(family.text_components + family.vae_components + family.denoiser_components, family)
    controls = load_controls(cfg, edits)
    below = None
    while True:
        planned, plan = memory.plan_stage(cfg, family, NAME, log, below)
        try:
            return _render(planned, plan, log, columns, prompts, size, controls, targets)
        except torch.cuda.OutOfMemoryError:
            below = plan.predicted_peak_gb * memory.FRAGMENTATION * 0.999
            if plan.budget.gb is None or not any(t["predicted_peak_gb"] * memory.FRAGMENTATION <= below for t in plan.tried):
                raise
            log.emit("warning", message=f"sample ran out of GPU memory with {plan.settings} (predicted "
                                        f"{plan.predicted_peak_gb:.2f} GB): going on with the next smaller plan")
        # out of the except block, the error's traceback (whose frames hold the failed pipeline) is gone
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _render(cfg: Any, plan: Any, log: Any, columns: list[Column], prompts: list[str], size: tuple[int, int],
            controls: list[list[Any]] | None, targets: list[Path] | None) -> dict[str, Any]:
    """One attempt of `render_planned` with `cfg` as planned: the pipeline lives in this frame only."""
    from stages.core import blockswap, pipeline_swap
    from stages.core.runtime import reset_peak
    from stages.families import get_family

    family, swapped = get_family(cfg.family), plan.settings.get("swapped_blocks", 0)
    pipe, rt, loaded_as = load_pipeline(cfg, log, swapped)
    if note := guidance_note(pipe, family, cfg.sample.guidance_scale):
        log.emit("warning", message=note)
    reset_peak(rt)
    install = (lambda: pipeline_swap.install(pipe, family, swapped, rt.device, loaded_as["cpu_offload"])) if swapped else None
    labels, cells, decoded = render_columns(pipe, cfg, columns, prompts, size, controls, install)
    if swapped:  # how many block copies the swap made (the manifest's loaded_as)
        loaded_as["block_copies"] = blockswap.installed_swap(getattr(pipe, family.denoiser_components[0])).copies
    return {"labels": labels, "cells": cells, "rt": rt, "scores": edit_errors(pipe, cfg, labels, decoded, targets, controls, size),
            "loaded_as": {**loaded_as, "predicted_peak_gb": round(plan.predicted_peak_gb, 3)}}


def run(cfg: Any, force: bool = False) -> dict[str, Any]:
    from stages.core.runtime import install_model_trace, peak_vram_gb
    from stages.families import library_notices
    from stages.core.stage import running_stage
    from stages.registry import conflicts

    install_model_trace(NAME, library_notices())
    planned = planned_rows(cfg)
    check_settings(cfg, planned[1])
    with running_stage(cfg, NAME, beside=conflicts(NAME)) as ctx:
        (edits, prompts, targets), parts = planned, fingerprint_parts(cfg, planned)
        size = (cfg.sample.width or cfg.data.resolution, cfg.sample.height or cfg.data.resolution)
        out = artifact_dir(cfg)
        existing = None if force else read_manifest(out)
        if existing is not None and existing.get("fingerprint") == fingerprint(parts):
            ctx.log.emit("up_to_date", fingerprint=existing["fingerprint"],
                         notes=[f"the samples are rendered with these settings; `{command(cfg, NAME, '--force')}` "
                                f"renders them again"])
            return {**existing, "up_to_date": True}
        with atomic_dir(out) as tmp, tempfile.TemporaryDirectory(dir=cfg.run_dir) as scratch:
            columns = adapters(cfg, Path(scratch))
            done = render_planned(cfg, ctx.log, columns, prompts, size, edits, targets)
            labels, cells, scores, rt, loaded_as = (done[k] for k in ("labels", "cells", "scores", "rt", "loaded_as"))
            rows = [(p, seed) for p in prompts for seed in cfg.sample.seeds]
            grid, files = draw_outputs(cfg, labels, rows, cells, tmp)
            ctx.log.emit("sample", path=str(out / GRID), prompts=prompts, seeds=list(cfg.sample.seeds),
                         adapter=", ".join(str(f.relative_to(cfg.run_dir)) for f, _ in columns[-1][1]), seconds=ctx.elapsed(),
                         **{k: v for k, v in scores.items() if k != "edit_summary"})
            manifest = write_manifest(tmp, NAME, family=cfg.family, model=cfg.model, files=files, columns=labels,
                                      prompts=prompts, seeds=list(cfg.sample.seeds), size=list(size),
                                      settings=dataclasses.asdict(cfg.sample), loaded_as=loaded_as, grid_size=list(grid),
                                      fingerprint=fingerprint(parts), fingerprint_parts=parts, seconds=ctx.elapsed(),
                                      peak_vram_gb=peak_vram_gb(rt), **scores)
        rendered = [label for label in labels if label != "control"]  # an edit grid's first column is the input
        ctx.log.emit("done", seconds=ctx.elapsed(), images=len(rows) * len(rendered), files=[str(out / f) for f in files],
                     unit=rendered_unit(cfg),
                     **{k: v for k, v in scores.items() if k == "edit_closer_percent"})
        return manifest


# ---- the grid ------------------------------------------------------------------------------------


def _wrap(draw: Any, text: str, font: Any, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        trial = f"{line} {word}".strip()
        if draw.textlength(trial, font=font) <= width or not line:
            line = trial
        else:
            lines.append(line)
            line = word
    return lines + ([line] if line else [])


CLIP_GRID, CLIP_VIDEO = "grid.webp", "grid.mp4"


def draw_outputs(cfg: Any, labels: list[str], rows: list[tuple[str, int]], cells: list[list[Any]],
                 out: Path) -> tuple[tuple[int, int], list[str]]:
    """The grid's files in `out` -> (grid.png's size, their names). Images: grid.png. Clips (cells of frame
    lists): grid.png of each clip's middle frame, the whole grid animated as grid.webp (Pillow), and as
    grid.mp4 where PyAV has an H.264 or MPEG-4 encoder, both at `clip_fps`."""
    from stages.core import video

    if not isinstance(cells[0][0], list):
        return draw_grid(labels, rows, cells, out / GRID), [GRID]
    n = len(cells[0][0])
    size = draw_grid(labels, rows, [[clip[n // 2] for clip in column] for column in cells], out / GRID)
    frames = [compose_grid(labels, rows, [[clip[k] for clip in column] for column in cells]) for k in range(n)]
    fps = clip_fps(cfg)
    video.write_animation(out / CLIP_GRID, frames, fps)
    return size, [GRID, CLIP_GRID] + ([CLIP_VIDEO] if video.write_mp4(out / CLIP_VIDEO, frames, fps) else [])


def clip_fps(cfg: Any) -> float:
    """The rate the sample clips play at: data.fps, the rate the LoRA trained at; at 0 (each clip's own frames)
    the rate the family's model generates at (`frame_rate`: Wan 2.2 TI2V-5B and LTX-2 24, T2V-A14B 16), at
    which the base model's clips play at real speed."""
    from stages.families import get_family

    return cfg.dataset_configs()[0].fps or get_family(cfg.family).frame_rate


def draw_grid(labels: list[str], rows: list[tuple[str, int]], cells: list[list[Any]], out: Path) -> tuple[int, int]:
    """Columns `labels`, rows (prompt, seed); cells[column][row] are PIL images, saved to `out`. Returns (w, h)."""
    grid = compose_grid(labels, rows, cells)
    grid.save(out, optimize=True)
    return grid.size


def compose_grid(labels: list[str], rows: list[tuple[str, int]], cells: list[list[Any]]) -> Any:
    """The grid as a PIL image (draw_grid's, unsaved)."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=13)
    w, h = cells[0][0].size
    scale = max(1, -(-MIN_CELL // max(w, h)))  # integer upscale, NEAREST keeps pixels honest
    cw, ch, left, top, pad = w * scale, h * scale, 200, 28, 4
    grid = Image.new("RGB", (left + len(labels) * (cw + pad), top + len(rows) * (ch + pad)), "white")
    draw = ImageDraw.Draw(grid)
    for c, label in enumerate(labels):
        draw.text((left + c * (cw + pad) + cw // 2, top // 2), label, fill="#222222", font=font, anchor="mm")
    for r, (prompt, seed) in enumerate(rows):
        y = top + r * (ch + pad)
        lines = _wrap(draw, prompt, font, left - 12)[: max(1, ch // 16 - 1)] + [f"seed {seed}"]
        for i, line in enumerate(lines):
            draw.text((6, y + 4 + i * 16), line, fill="#555555" if i == len(lines) - 1 else "#222222", font=font)
        for c, column in enumerate(cells):
            grid.paste(column[r].convert("RGB").resize((cw, ch), Image.Resampling.NEAREST), (left + c * (cw + pad), y))
    return grid
