"""What the tiled VAE encode that cache-latents falls back to changes in the posterior.

    python bench/tiling.py --out $OUT/tiling.json                  # H200: every distinct full-size VAE (--budget-s 140)
    python bench/tiling.py --tiny --out /tmp/tiling-tiny.json      # CPU plumbing: the tiny VAEs, 64 px tiles
    python bench/tiling.py --families wan2.2-5b,wan2.2-14b,ltx2 --sizes 640,960 --frames 33 --out $OUT/t.json  # clips

For each distinct VAE of the registered families (FLUX.1 = Z-Image = Kontext's AutoencoderKL, SDXL's,
Qwen-Image = Krea 2 = Qwen-Image-Edit's, FLUX.2's, Qwen-Image 2.1's; duplicates by class and config
are measured once) it encodes one smooth synthetic image (gradients and soft shapes, not noise) at
1024 and 2048 px in fp32 (the default latents.vae_precision) three ways, each through the product's
own path: `family.encode_posterior` on the VAE after `memory.apply_vae_plan`:
  - untiled: the reference posterior;
  - tiled: the plan cache-latents takes when nothing else fits (sliced + tiled; VAE_TILE_PIXELS
    tiles, a quarter overlap);
  - bf16 untiled: the step the planner takes *before* tiling, for scale.
Per VAE and size: the posterior mean's max-abs and relative RMS error, the same in units of the
posterior's own std (a training step samples mean + std * eps, so an error well under 1 std is
buried in that noise), the logvar's errors (and how much of it sits at the [-30, 20] clamp), the
peak GPU memory (measured, and what the cache-latents planner predicts for that mode), the seconds
of each encode, and the encoder calls (tiles). FLUX.2's and Qwen-Image 2.1's VAE classes have no
memory.VAE_TILE_PIXELS entry, so the planner never tiles them (`planner_tiles_this_class`: false);
they are measured with apply_vae_plan's tiling all the same (512 / 256 px tiles).

The weights are random (bench/full_configs.py, each class's own init), not a trained VAE: the
error's size depends on the weights (a trained encoder's GroupNorm statistics and mid-block
attention react to the tile's content differently), so these numbers show the mechanism and its
order of magnitude, not a released model's exact figure. `--tiny` forces 64 px tiles so the tiny
VAEs' 128/256 px images really tile.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ORDER = ("flux", "sdxl", "qwen-image", "flux2-klein")  # the four first families; the rest (deduplicated) after
GB = 2**30


def synthetic_image(side: int, seed: int = 0) -> Any:
    """A smooth RGB test image of side x side: colour gradients, a soft sinusoid and blurred shapes."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    y, x = np.mgrid[0:side, 0:side].astype(np.float32) / side
    r = 40 + 170 * x
    g = 30 + 160 * y + 20 * np.sin(2 * math.pi * 3 * x) * np.cos(2 * math.pi * 2 * y)
    b = 200 - 150 * np.hypot(x - 0.5, y - 0.5)
    image = Image.fromarray(np.clip(np.stack([r, g, b], -1), 0, 255).astype(np.uint8))
    draw, rng = ImageDraw.Draw(image), np.random.default_rng(seed)
    for k in range(9):
        cx, cy, rad = rng.uniform(0.1, 0.9), rng.uniform(0.1, 0.9), rng.uniform(0.04, 0.18)
        box = [int((cx - rad) * side), int((cy - rad) * side), int((cx + rad) * side), int((cy + rad) * side)]
        fill = tuple(int(c) for c in rng.integers(20, 236, 3))
        (draw.ellipse if k % 3 else draw.rectangle)(box, fill=fill)
    return image.filter(ImageFilter.GaussianBlur(max(1, side // 512)))


def synthetic_clip(side: int, frames: int) -> list[Any]:
    """`frames` frames of the synthetic image, its content sliding right by side/64 px a frame (wrapping)."""
    import numpy as np
    from PIL import Image

    first = np.asarray(synthetic_image(side))
    return [Image.fromarray(np.roll(first, k * max(1, side // 64), axis=1)) for k in range(frames)]


def vae_builders(families: list[str], tiny: bool) -> list[tuple[list[str], Callable[[str], torch.nn.Module]]]:
    """[(families sharing it, build(device) -> fp32 VAE)] for each distinct VAE (class + config)."""
    from stages.families import get_family

    def builder(name: str) -> Callable[[str], torch.nn.Module]:
        if tiny:
            from stages.families import demo_variant
            from stages.tiny.models import build_tiny_components

            return lambda device: build_tiny_components(demo_variant(name))["vae"].float().to(device).eval()
        from bench.full_configs import FULL, default_dtype

        def build(device: str) -> torch.nn.Module:  # as build_module, without the tiny pipeline it only needs for tokenizers
            with torch.device(device), default_dtype(torch.float32):
                return FULL[name][get_family(name).vae_components[0]]({}).eval()
        return build

    seen: dict[str, int] = {}
    out: list[tuple[list[str], Callable[[str], torch.nn.Module]]] = []
    for name in families:
        build = builder(name)
        meta = build("cpu" if tiny else "meta")
        key = json.dumps([type(meta).__name__, {k: v for k, v in dict(meta.config).items() if not k.startswith("_")}],
                         sort_keys=True, default=str)
        if key in seen:
            out[seen[key]][0].append(name)
            continue
        seen[key] = len(out)
        out.append(([name], build))
    return out


def _plan(precision: str, tiled: bool) -> Any:
    from stages.core import memory

    settings = {"vae_precision": precision, "sliced": tiled, "tiled": tiled}  # the planner tiles only sliced
    return memory.StagePlan("cache-latents", memory.Budget(None, "bench"), settings, 0.0, True)


def _encode(family: Any, vae: torch.nn.Module, pixels: torch.Tensor, repeats: int) -> dict[str, Any]:
    """family.encode_posterior, timed (best of `repeats` after one warm-up) with its peak GPU memory
    above what was allocated before, and how many times the encoder ran (tiles)."""
    cuda = pixels.device.type == "cuda"
    calls = [0]
    hook = vae.encoder.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    seconds = []
    try:
        for k in range(1 + repeats):
            calls[0] = 0
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            mean, logvar = family.encode_posterior(vae, pixels)
            if cuda:
                torch.cuda.synchronize()
            if k:
                seconds.append(time.perf_counter() - start)
    finally:
        hook.remove()
    peak = (torch.cuda.max_memory_allocated() - base) / GB if cuda else None
    weights = sum(p.numel() * p.element_size() for p in vae.parameters()) / GB
    return {"mean": mean.float(), "logvar": logvar.float(), "seconds": round(min(seconds), 4), "encoder_calls": calls[0],
            "peak_above_weights_gb": None if peak is None else round(peak, 3),
            "peak_gb": None if peak is None else round(peak + weights, 3)}  # what the planner predicts


def _errors(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, float]:
    mean, logvar = ref["mean"], ref["logvar"]
    d_mean, d_logvar = got["mean"] - mean, got["logvar"] - logvar
    in_std = d_mean / torch.exp(0.5 * logvar)
    rms = lambda t: float(t.double().pow(2).mean().sqrt())  # noqa: E731
    return {"mean_max_abs": float(d_mean.abs().max()), "mean_rms": rms(d_mean),
            "mean_rel_rms": rms(d_mean) / max(rms(mean), 1e-30),
            "mean_err_in_std_max": float(in_std.abs().max()), "mean_err_in_std_rms": rms(in_std),
            "logvar_max_abs": float(d_logvar.abs().max()), "logvar_rms": rms(d_logvar),
            "finite": bool(torch.isfinite(got["mean"]).all() and torch.isfinite(got["logvar"]).all())}


class _BuiltSource:
    """A model source answering from a built VAE's config, for memory.plan_latents (meta sizes)."""

    def __init__(self, vae: torch.nn.Module) -> None:
        self.vae = vae

    def component_config(self, subfolder: str, file: str = "config.json") -> dict[str, Any]:
        if file == "model_index.json":
            return {"vae": ["diffusers", type(self.vae).__name__]}
        return dict(self.vae.config)


def predicted_peaks(family: Any, vae: torch.nn.Module, side: int, frames: int = 1) -> dict[str, float]:
    """The cache-latents planner's predicted peak (GB) for each mode measured here: one image (or clip of
    `frames`) of `side`."""
    from types import SimpleNamespace

    from stages.core import memory

    cfg = SimpleNamespace(latents=SimpleNamespace(vae_precision="fp32"),
                          dataset_configs=lambda: [SimpleNamespace(cache_variants=1, resolution=side, frames=frames)])
    tried = memory.plan_latents(cfg, family, _BuiltSource(vae), memory.Budget(None, "bench")).tried
    modes = {"untiled": ("fp32", False, False), "tiled": ("fp32", True, True), "bf16": ("bf16", True, False)}
    return {name: round(t["predicted_peak_gb"], 3) for name, mode in modes.items() for t in tried
            if (t["vae_precision"], t["sliced"], t["tiled"]) == mode}


def summary_line(name: str, side: int, e: dict[str, Any]) -> str:
    t, b = e["tiled_vs_untiled"] or {}, e["bf16_vs_fp32_untiled"]
    gb = lambda k: "-" if e[k] is None else f"{e[k]:.2f}"  # noqa: E731
    return (f"{name:>14} {side:>5}px tiles {e['encoder_calls_tiled']:>3} | tiled: mean rel.rms {t.get('mean_rel_rms', math.nan):.2e} "
            f"max {t.get('mean_max_abs', math.nan):.2e} ({t.get('mean_err_in_std_rms', math.nan):.2e} std rms), logvar rms "
            f"{t.get('logvar_rms', math.nan):.2e} | bf16: mean rel.rms {b['mean_rel_rms']:.2e} | peak GB untiled/tiled/bf16 "
            f"{gb('peak_gb_untiled')}/{gb('peak_gb_tiled')}/{gb('peak_gb_bf16')} | s {e['seconds_untiled']:.3f}/"
            f"{e['seconds_tiled']:.3f}/{e['seconds_bf16']:.3f}")


def measure(names: list[str], build: Callable[[str], torch.nn.Module], sizes: list[int], device: str,
            tile_px: int | None, repeats: int, deadline: float, frames: int = 1) -> dict[str, Any]:
    """One VAE's posterior untiled, tiled and bf16 at each size: of one image, or for a video family of one clip of
    `frames` frames (the cache's (1, 3, F, H, W) pixels; the planner's prediction counts them)."""
    from stages import cache_latents
    from stages.core import memory
    from stages.families import get_family

    family = get_family(names[0])
    frames = frames if family.trains_video else 1
    vae = build(device)
    tiled = copy.deepcopy(vae)
    memory.apply_vae_plan(tiled, _plan("fp32", True), tile_px)
    bf16 = copy.deepcopy(vae).to(torch.bfloat16)
    cls = type(vae).__name__
    row: dict[str, Any] = {
        "families": names, "vae_class": cls, "params_m": round(sum(p.numel() for p in vae.parameters()) / 1e6, 2),
        "weights_fp32_gb": round(memory.weight_bytes(vae, "fp32") / GB, 3),
        # the planner offers tiling only for classes with a tile size (memory.plan_latents)
        "planner_tiles_this_class": cls in memory.VAE_TILE_PIXELS,
        "tile_px": tile_px or memory.VAE_TILE_PIXELS.get(cls, 512), "frames": frames, "sizes": {}}
    for side in sizes:
        if time.perf_counter() > deadline:
            row["sizes"][str(side)] = {"skipped": "out of time (--budget-s)"}
            continue
        if frames > 1:  # (1, 3, F, H, W), as cache-latents feeds a clip
            pixels = cache_latents._to_pixels(synthetic_clip(side, frames)).transpose(0, 1)[None].to(device)
        else:
            pixels = cache_latents._to_pixels([synthetic_image(side)]).to(device)  # [-1, 1], as cache-latents feeds it
        ref = _encode(family, vae, pixels, repeats)
        til = _encode(family, tiled, pixels, repeats)
        low = _encode(family, bf16, pixels, repeats)
        lv = ref["logvar"]
        entry = {
            "latent_shape": list(ref["mean"].shape), "shapes_equal": list(til["mean"].shape) == list(ref["mean"].shape),
            "logvar_at_clamp_fraction": float(((lv <= -30 + 1e-3) | (lv >= 20 - 1e-3)).float().mean()),
            "posterior_std_median": float(torch.exp(0.5 * lv).median()), "mean_rms": float(ref["mean"].pow(2).mean().sqrt()),
            "tiled_vs_untiled": _errors(ref, til) if til["mean"].shape == ref["mean"].shape else None,
            "bf16_vs_fp32_untiled": _errors(ref, low),
            **{f"{k}_{name}": v[k] for name, v in (("untiled", ref), ("tiled", til), ("bf16", low))
               for k in ("seconds", "peak_gb", "peak_above_weights_gb", "encoder_calls")},
            **{f"predicted_peak_gb_{k}": v for k, v in predicted_peaks(family, vae, side, frames).items()}}
        row["sizes"][str(side)] = entry
        print(summary_line(names[0], side, entry), flush=True)
        del ref, til, low, pixels
        if device == "cuda":
            torch.cuda.empty_cache()
    del vae, tiled, bf16
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    from stages.families import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="all", help="comma-separated, or 'all' (duplicate VAEs measured once)")
    ap.add_argument("--sizes", default=None, help="image sides in px (default 1024,2048; --tiny 128,256)")
    ap.add_argument("--frames", type=int, default=33,
                    help="a video family's clip length, 8k+1 for every video VAE (default 33; --tiny 9)")
    ap.add_argument("--repeats", type=int, default=None, help="timed encodes after one warm-up (default 2; --tiny 1)")
    ap.add_argument("--budget-s", type=float, default=140.0, help="sizes not started by then are skipped")
    ap.add_argument("--tiny", action="store_true", help="CPU, the tiny VAEs, 64 px tiles")
    ap.add_argument("--device", default=None, help="default cuda (--tiny: cpu); cpu runs the full-size path slowly")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    start = time.perf_counter()
    names = list(FAMILIES) if a.families == "all" else a.families.split(",")
    names = [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]
    sizes = [int(s) for s in (a.sizes or ("128,256" if a.tiny else "1024,2048")).split(",")]
    if any(s % 64 for s in sizes):
        ap.error(f"--sizes {a.sizes}: each side must be a multiple of 64 (every VAE's latent multiple divides it)")
    device = a.device or ("cpu" if a.tiny else "cuda")
    repeats = a.repeats or (1 if a.tiny else 2)
    torch.manual_seed(0)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
        "weights": "random (each class's own init), not a trained VAE", "precision": "fp32 (tiled and untiled); bf16 untiled for scale",
        "image": "synthetic: gradients, a sinusoid, 9 blurred shapes (a video family's clip: that image sliding right)",
        "sizes": sizes,
        "flags": {"cudnn_tf32": torch.backends.cudnn.allow_tf32, "matmul_tf32": torch.backends.cuda.matmul.allow_tf32},
        "vaes": []}
    for shared, build in vae_builders(names, a.tiny):
        if time.perf_counter() > start + a.budget_s:
            out["vaes"].append({"families": shared, "skipped": "out of time (--budget-s)"})
            continue
        print(f"== {shared[0]} (also {', '.join(shared[1:]) or '-'})", flush=True)
        try:
            out["vaes"].append(measure(shared, build, sizes, device, 64 if a.tiny else None, repeats, start + a.budget_s,
                                       9 if a.tiny and a.frames == 33 else a.frames))
        except Exception as e:  # noqa: BLE001 - one VAE failing (out of memory, a diffusers change) keeps the others
            out["vaes"].append({"families": shared, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"   failed: {type(e).__name__}: {e}", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
        Path(a.out).write_text(json.dumps(out, indent=1))  # each VAE as it finishes
    out["seconds"] = round(time.perf_counter() - start, 1)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"done in {out['seconds']} s -> {a.out}")


if __name__ == "__main__":
    main()
