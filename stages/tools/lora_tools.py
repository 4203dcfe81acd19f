"""`lorapipe lora merge|resize|extract`: new LoRA files from finished ones, on the CPU, without base weights.

    lorapipe lora merge a.safetensors b.safetensors --weights 0.7,0.3 --rank 32 -o ab.safetensors
    lorapipe lora resize my_comfyui.safetensors --energy 0.99 -o small_comfyui.safetensors
    lorapipe lora extract --base base-folder --tuned tuned-folder --family flux --rank 32 -o diff.safetensors

Per module: merge sums the weighted deltas (delta = alpha / rank * up @ down, each file's own scale) and
factors the sum exactly (stages.tools.lowrank); resize does the same for one file; extract factors the
difference of the two models' linear weights. Each then keeps the best rank-r part (or, with --energy E,
the fewest singular values holding the fraction E of the squared ones) and reports the relative error
||D - D_r|| / ||D|| per module (worst, median) and over all modules. The file is written in the input's
format (or --format), checked as `export-lora --verify` checks exports (stages.tools.lora_checks), and only
then moved into place.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from stages.tools.lora_files import FORMATS, LoraFile, LoraFileError, read_lora, write_lora
from stages.tools.lowrank import Truncated, overall_error, svd_of_matrix, svd_of_sum, truncate


def merge(files: list[str], weights: list[float] | None, rank: int | None, energy: float | None, out: str,
          fmt: str | None = None, family: str | None = None, model: str | None = None) -> dict[str, Any]:
    """Sum the weighted deltas of `files` per module and factor the sum back to `rank` (None and no
    `energy`: every singular value, lossless); write it to `out` and return the report."""
    sources = [read_lora(f, family) for f in files]
    weights = list(weights) if weights is not None else [1.0] * len(sources)
    if len(weights) != len(sources):
        raise LoraFileError(f"--weights has {len(weights)} value(s) for {len(sources)} file(s); give one per file, "
                            f"e.g. --weights {','.join(['0.5'] * len(sources))}")
    first = _same_kind(sources)
    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for src in sources:
        for name, f in src.modules.items():
            seen = shapes.setdefault(name, (f.shape, src.path))
            if seen[0] != f.shape:
                raise LoraFileError(f"module '{name}' has shape {f.shape} in '{src.path}' but {seen[0]} in "
                                    f"'{seen[1]}'; merge LoRAs of one model")
    results = _factor_each("merge", sorted(shapes), lambda name: svd_of_sum(
        [(w, src.modules[name]) for w, src in zip(weights, sources) if name in src.modules]), rank, energy)
    note = {"lorapipe_tool": "merge " + " + ".join(f"{w:g} x {Path(p).name}" for w, p in zip(weights, files))}
    return finish(results, first, out, fmt, _denoiser(first, model), note)


def resize(file: str, rank: int | None, energy: float | None, out: str, fmt: str | None = None,
           family: str | None = None, model: str | None = None) -> dict[str, Any]:
    """One file's modules factored again at `rank` (or by `energy`), written to `out`."""
    if rank is None and energy is None:
        raise LoraFileError("resize needs --rank R or --energy E (e.g. --energy 0.99)")
    src = read_lora(file, family)
    results = _factor_each("resize", sorted(src.modules), lambda name: svd_of_sum([(1.0, src.modules[name])]),
                           rank, energy)
    return finish(results, src, out, fmt, _denoiser(src, model), {"lorapipe_tool": f"resize {Path(file).name}"})


def _denoiser(like: LoraFile, model: str | None) -> Any:
    """The denoiser the output is checked against: `model`'s, else the family's released one; None without a family."""
    from stages.tools.lora_checks import denoiser

    if like.family is None and model is not None:
        raise LoraFileError(f"--model needs the family, which '{like.path}' does not name: give --family too")
    return denoiser(like.family, model) if like.family else None


def _same_kind(sources: list[LoraFile]) -> LoraFile:
    """The first file, once every file has its format and family (the names of one must be the other's)."""
    first = sources[0]
    for src in sources[1:]:
        if src.format != first.format:
            raise LoraFileError(f"'{src.path}' is a {src.format} file and '{first.path}' a {first.format} one: their "
                                f"module names differ; merge files of one format (export-lora writes each format)")
        if src.family != first.family and None not in (src.family, first.family):
            raise LoraFileError(f"'{src.path}' is for family '{src.family}' and '{first.path}' for '{first.family}'; "
                                f"merge LoRAs of one model")
    family = next((s.family for s in sources if s.family), None)
    return LoraFile(first.path, first.format, {}, family, first.prefix, first.metadata)


def _factor_each(label: str, names: list[str], svd_of: Any, rank: int | None, energy: float | None) -> dict[str, Truncated]:
    from stages.core.events import Progress

    _check_target(rank, energy)
    results: dict[str, Truncated] = {}
    with Progress(label, len(names), "modules") as bar:
        for name in names:
            results[name] = truncate(svd_of(name), rank, energy)
            bar.advance()
    return results


def _check_target(rank: int | None, energy: float | None) -> None:
    if rank is not None and energy is not None:
        raise LoraFileError("give --rank or --energy, not both")
    if rank is not None and rank < 1:
        raise LoraFileError(f"--rank {rank}: the rank must be at least 1")
    if energy is not None and not 0.0 < energy <= 1.0:
        raise LoraFileError(f"--energy {energy}: give a fraction in (0, 1], e.g. 0.99")


def finish(results: dict[str, Truncated], like: LoraFile, out: str, fmt: str | None, den: Any,
           note: dict[str, str]) -> dict[str, Any]:
    """Write the factored modules in `fmt` (default: `like`'s format) at `out`, check the file there against
    `den` (a lora_checks.Denoiser, or None: no family), then move it into place; returns the report."""
    from stages.tools.lora_checks import check_output

    fmt = fmt or like.format
    if fmt not in FORMATS:
        raise LoraFileError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    path = Path(out)
    if path.suffix != ".safetensors":
        raise LoraFileError(f"-o '{out}': the output is a .safetensors file; give a name ending in .safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    table = LoraFile(path, like.format, {m: t.factors for m, t in results.items()}, like.family, like.prefix,
                     like.metadata)
    staging = path.parent / f".{path.name}.{os.getpid()}.partial"
    staging.mkdir(exist_ok=True)
    try:
        written = write_lora(staging / path.name, fmt, table, den, note)
        summary = check_output(written, fmt, table, den)
        os.replace(written, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    ranks = sorted({t.factors.rank for t in results.values()})
    return {"file": str(path), "format": fmt, "family": like.family, "modules": len(results),
            "ranks": [ranks[0], ranks[-1]] if ranks else [], "error": overall_error(results),
            "note": summary.get("note")}


def describe(report: dict[str, Any]) -> str:
    """The report as two lines: what was written, and the errors."""
    lo, hi = report["ranks"] or (0, 0)
    ranks = f"rank {hi}" if lo == hi else f"ranks {lo}-{hi}"
    e = report["error"]
    head = (f"wrote {report['file']} ({report['format']}{', ' + report['family'] if report['family'] else ''}): "
            f"{report['modules']} modules at {ranks}")
    if e["worst"] is None:
        return head
    errors = (f"relative error ||D - D_r|| / ||D||: overall {e['overall']:.3g}, median {e['median']:.3g}, worst "
              f"{e['worst']:.3g} ({e['worst_module']})")
    return "\n".join([head, errors] + ([report["note"]] if report.get("note") else []))


# ---- extract ---------------------------------------------------------------------------------------------


def extract(base: str, tuned: str, family: str, rank: int | None, energy: float | None, out: str,
            fmt: str | None = None, min_change: float = 0.0) -> dict[str, Any]:
    """The LoRA of the difference between two models of `family`: per linear layer of the denoiser whose
    weight differs (relative change ||W_t - W_b|| / ||W_b|| above `min_change`), the SVD of the difference
    at `rank` (or `energy`). Weights are read one module at a time."""
    import torch

    from stages.families import get_family
    from stages.tools.lora_checks import denoiser

    if rank is None and energy is None:
        raise LoraFileError("extract needs --rank R or --energy E (e.g. --rank 32)")
    _check_target(rank, energy)
    prefix = get_family(family).lora_prefix
    config = denoiser_config(base, prefix)
    den = denoiser(family, base if config else None, config)
    left, right = WeightFiles(base, prefix), WeightFiles(tuned, prefix)
    linears = [m for m in den.shapes((torch.nn.Linear,)) if f"{m}.weight" in left.where]
    missing = [m for m in linears if f"{m}.weight" not in right.where]
    if missing:
        raise LoraFileError(f"'{tuned}' has no '{missing[0]}.weight' that '{base}' has ({len(missing)} such layers); "
                            f"extract between two models of one architecture")
    if not linears:
        raise LoraFileError(f"'{base}' holds none of the {family} denoiser's linear weights (e.g. "
                            f"'{next(iter(den.shapes((torch.nn.Linear,))), '?')}.weight'); give the {family} model")
    results = _extract_each(left, right, linears, rank, energy, min_change)
    if not results:
        raise LoraFileError(f"the {len(linears)} linear weights of '{base}' and '{tuned}' are the same"
                            f"{f' (within --min-change {min_change})' if min_change else ''}: nothing to extract")
    like = LoraFile(Path(out), "diffusers", {}, family, prefix, {})
    note = {"lorapipe_tool": f"extract {Path(tuned).name} - {Path(base).name}"}
    report = finish(results, like, out, fmt, den, note)
    return {**report, "unchanged": len(linears) - len(results)}


def _extract_each(left: "WeightFiles", right: "WeightFiles", modules: list[str], rank: int | None,
                  energy: float | None, min_change: float) -> dict[str, Truncated]:
    from stages.core.events import Progress

    results: dict[str, Truncated] = {}
    with Progress("extract", len(modules), "modules") as bar:
        for module in modules:
            w0, w1 = left.get(f"{module}.weight"), right.get(f"{module}.weight")
            bar.advance()
            if w0.shape != w1.shape:
                raise LoraFileError(f"'{module}.weight' is {tuple(w0.shape)} in '{left.ref}' but {tuple(w1.shape)} in "
                                    f"'{right.ref}'; extract between two models of one architecture")
            d = w1.float() - w0.float()
            change = float(d.norm()) / max(float(w0.float().norm()), 1e-30)
            if change == 0.0 or change <= min_change:
                continue
            results[module] = truncate(svd_of_matrix(d, rank if energy is None else None), rank, energy)
    return results


def denoiser_config(ref: str, prefix: str) -> dict[str, Any] | None:
    """The denoiser's config.json: the pipeline folder's `<prefix>/config.json`, or the one beside a single
    denoiser file (a diffusers component folder); None when there is none."""
    import json

    path = Path(ref)
    candidates = [path.parent / "config.json"] if path.is_file() else [path / prefix / "config.json", path / "config.json"]
    for c in candidates:
        if c.is_file():
            return json.loads(c.read_text())
    return None


class WeightFiles:
    """A denoiser's safetensors weights, read one tensor at a time: a diffusers pipeline folder (its
    `<prefix>/` shards) or one diffusers-keyed denoiser file."""

    def __init__(self, ref: str, prefix: str) -> None:
        from safetensors import safe_open

        from stages.core.model_source import ModelSource

        self.ref, path = ref, Path(ref)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = ModelSource(ref).weight_files(prefix) or _component_files(path)
        else:
            raise LoraFileError(f"'{ref}' does not exist; give a diffusers pipeline folder or a denoiser .safetensors file")
        if not files:
            raise LoraFileError(f"'{ref}' has no {prefix}/diffusion_pytorch_model*.safetensors; give a diffusers "
                                f"pipeline folder or the denoiser's .safetensors file")
        self.where: dict[str, Path] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as handle:
                    self.where.update({k: f for k in handle.keys()})
            except Exception as e:  # noqa: BLE001 - a damaged or non-safetensors file
                raise LoraFileError(f"'{f}' is not a readable safetensors file ({type(e).__name__})") from e

    def get(self, key: str) -> Any:
        from safetensors import safe_open

        with safe_open(str(self.where[key]), framework="pt") as handle:
            return handle.get_tensor(key)


def _component_files(folder: Path) -> list[Path]:
    """A component folder's own weights (`folder/diffusion_pytorch_model*.safetensors`)."""
    return sorted(folder.glob("diffusion_pytorch_model*.safetensors"))
