"""How the pipeline scales with the dataset's size, on the CPU with the tiny FLUX model and small images.

    python bench/scale.py --sizes 1000,10000,100000 --full-up-to 10000 --out bench/results/scale

For each N it draws N distinct 32-48 px images (three aspect buckets) with captions in one
metadata.jsonl, then times each command as the user runs it (`pipeline.py <command>`, its own process):
encode-captions and cache-latents (their images/s and the files their caches hold), train to its first
step (start-up time and peak host RAM), export-lora, then `status` and a no-op `run`, and the dataset
scan in-process (first scan hashing every image, then the stat-keyed index). Sizes above --full-up-to
encode a tenth of their captions' text variety (captions repeat, so encode-captions has fewer rows; the
latents, the scan, the joins and the sampler still see N items) to keep the run within minutes on 2 cores.
`--repo DIR` measures another checkout's code (e.g. the main branch) with this same script.
Writes <out>/scale-<N>.json per size and prints a table.

    python bench/scale.py --gpu-latents 400 --px 1024 --device cuda --out $OUT/scale-gpu.json   # suite `scale-gpu`

measures cache-latents alone on the GPU with the full-size FLUX.1 VAE instead (`gpu_latents`): images/s, the
encoder's busy share and the GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SIZES = ((32, 32), (48, 32), (32, 48))
STAGES = ("encode-captions", "cache-latents", "train", "export-lora")  # a plain `run`'s
# runs the CLI in a child and writes its peak RSS (KiB) and its start time (before any import) to a file
CHILD = ("import atexit, json, resource, sys, time; t0 = time.time(); out = sys.argv.pop(1)\n"
         "atexit.register(lambda: open(out, 'w').write(json.dumps({'t0': t0, 'maxrss_kib': "
         "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, 'torch_imported': 'torch' in sys.modules})))\n"
         "sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[1:]; sys.argv[0] = 'pipeline.py'\n"
         "from pipeline import cli; cli()")


def draw(folder: Path, first: int, last: int) -> None:
    """Images first..last-1: a flat colour and a first row of pixels spelling the index (distinct bytes)."""
    import numpy as np
    from PIL import Image

    for i in range(first, last):
        w, h = SIZES[i % len(SIZES)]
        pixels = np.full((h, w, 3), (i * 37 % 256, i * 91 % 256, i * 13 % 256), dtype=np.uint8)
        pixels[0, :8] = np.frombuffer(i.to_bytes(24, "little"), dtype=np.uint8).reshape(8, 3)
        Image.fromarray(pixels).save(folder / f"img_{i:06d}.png", compress_level=1)


def make_dataset(folder: Path, n: int, distinct_captions: int) -> Path:
    """n images with distinct bytes and captions (`distinct_captions` different texts) in metadata.jsonl."""
    from concurrent.futures import ProcessPoolExecutor

    if (folder / "metadata.jsonl").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    step = 5000
    with ProcessPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(draw, [folder] * len(range(0, n, step)), range(0, n, step), [min(n, k + step) for k in range(0, n, step)]))
    lines = [json.dumps({"file_name": f"img_{i:06d}.png", "text": f"a picture number {c} of colour {c % 97}"})
             for i, c in ((i, i % distinct_captions) for i in range(n))]
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def cli(repo: Path, args: list[str], stats: Path) -> tuple[float, dict, str]:
    """(wall seconds, {'t0', 'maxrss_kib'}, output) of one `pipeline.py` command in its own process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LORAPIPE_PLAIN": "1", "PYTHONPATH": python_path(repo)}
    t = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(stats), str(repo), *args], cwd=repo, env=env,
                          capture_output=True, text=True)
    wall = time.time() - t
    if proc.returncode != 0:
        raise SystemExit(f"`pipeline.py {' '.join(args)}` failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return wall, json.loads(stats.read_text()), proc.stdout + proc.stderr


def python_path(repo: Path) -> str:
    """`repo` first, then what PYTHONPATH held (the GPU machine's wheels)."""
    return os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])])


def count_files(folder: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(folder)) if folder.exists() else 0


def events(run_dir: Path, stage: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["stage"] == stage]


def measure(repo: Path, work: Path, n: int, full: bool, model: Path, device: str, out_file: Path,
            checks_only: bool = False) -> dict:
    data = make_dataset(work / f"data-{n}", n, n if full else max(1, n // 10))
    run, artifacts = f"scale-{n}", work / "artifacts"
    sets = {"model": str(model), "data.path": str(data), "artifacts": str(artifacts), "device": device,
            "data.resolution": 32, "data.cache_variants": 1, "captions.batch_size": 64, "train.steps": 2,
            "train.batch_size": 4, "runtime.checkpoint_every": 0, "sample.every_n_checkpoints": 0}
    base = ["--config", str(repo / "configs" / "demo.toml"), "--run", run,
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    stats, run_dir = work / "child.json", artifacts / run
    out = {"n": n, "repo": str(repo), "full": full, "device": device, "cpus": os.cpu_count(),
           "omp_threads": os.environ.get("OMP_NUM_THREADS")}

    def keep() -> None:  # after each step: a run stopped midway keeps what it measured
        out_file.write_text(json.dumps(out, indent=2) + "\n")

    if checks_only:  # the run built before, its figures kept: status, the no-op run and the scan again
        out = {**json.loads(out_file.read_text()), "checks_repo": str(repo)}
        return checks(repo, run_dir, base, sets, n, out, keep)

    earlier = json.loads(out_file.read_text()) if out_file.exists() else {}
    for stage in ("encode-captions", "cache-latents"):
        wall, _, _ = cli(repo, [stage, *base], stats)
        done = events(run_dir, stage)[-1]
        rebuilt_nothing = done["event"] == "up_to_date" or done.get("encoded") == 0
        if rebuilt_nothing and earlier.get(stage, {}).get("encoded"):
            out[stage] = {**earlier[stage], "from_earlier_run": True}  # a size measured again after a stop
        else:  # a stopped cache continues: `encoded` counts the rows of this run
            out[stage] = {"seconds": round(wall, 2), "stage_seconds": done.get("seconds"),
                          "encoded": done.get("encoded"), "images_per_second": done.get("images_per_second")}
        keep()
    for cache in ("captions.zarr", "latents.zarr"):
        files = count_files(run_dir / cache)
        out[cache] = {"files": files, "files_per_10k_items": round(files * 10_000 / n)}
    wall, child, _ = cli(repo, ["train", *base], stats)
    first = next(e for e in events(run_dir, "train") if e["event"] == "step")
    out["train"] = {"seconds": round(wall, 2), "start_to_first_step_s": round(first["ts"] - child["t0"], 2),
                    "peak_rss_mib": round(child["maxrss_kib"] / 1024)}
    keep()
    cli(repo, ["export-lora", *base], stats)
    return checks(repo, run_dir, base, sets, n, out, keep)


def checks(repo: Path, run_dir: Path, base: list[str], sets: dict, n: int, out: dict, keep: Any) -> dict:
    """`status` and a no-op `run` (the best of two, each its own process; every stage must be up to date), and the
    dataset scan in a child."""
    for name, args in (("status", ["status", *base]), ("noop_run", ["run", *base])):
        results = [cli(repo, args, run_dir.parent / "child.json") for _ in range(2)]
        text = results[-1][2]
        lines = [line for line in text.splitlines() if line.startswith(STAGES)]
        if len(lines) != len(STAGES) or not all("up to date" in line for line in lines):
            raise SystemExit(f"`{args[0]}` found a stage to run, not a no-op:\n{text}")
        out[name] = {"seconds": round(min(r[0] for r in results), 2), "budget_s": round(2 + 1e-4 * n, 2),
                     "torch_imported": any(r[1].get("torch_imported") for r in results)}
        keep()
    out["scan"] = scan_times(repo, repo / "configs" / "demo.toml", {**sets, "run": run_dir.name})
    keep()
    return out


def scan_times(repo: Path, config: Path, sets: dict) -> dict:
    """The dataset scan in a child: the first (hashes every image the index lacks) and a second (indexed)."""
    code = ("import json, sys, time; sys.path.insert(0, sys.argv[1])\n"
            "from stages.core.config import load_config; from stages.core import caches\n"
            "from stages.families import get_family\n"
            "cfg = load_config(sys.argv[2], json.loads(sys.argv[3])); family = get_family(cfg.family); seconds = []\n"
            "for _ in range(2):\n"
            "    t = time.perf_counter(); items = caches.scan_items(cfg, family); seconds.append(time.perf_counter() - t)\n"
            "print(json.dumps({'items': len(items), 'seconds': [round(x, 3) for x in seconds]}))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": python_path(repo)}
    proc = subprocess.run([sys.executable, "-c", code, str(repo), str(config), json.dumps(sets)], cwd=repo, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mechanics(repo: Path, work: Path, n: int) -> dict:
    """Without the models, in a child: a latents-shaped RowStore of n rows written through its journal
    (rows/s, files, the stat-only intact check, random verified reads), and train's start-up work on n
    items (id joins, the bucket sampler's first epoch) with its peak traced memory."""
    code = """
import json, sys, time, tracemalloc, random
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import numpy as np
from stages.core.rowstore import RowStore
from stages.core import dataset
from stages.core.train_data import BucketSampler, TrainData, join_items
n, work = int(sys.argv[2]), Path(sys.argv[3])
out = {}
ids = [f"{k:016x}" for k in range(n)]
fields = {"mean": ((1, 16, 4, 4), "float16"), "logvar": ((1, 16, 4, 4), "float16"), "crop_top_left": ((1, 2), "int64"),
          "flip": ((1,), "uint8"), "original_size": ((2,), "int64"), "mask": ((1, 4, 4), "float16")}
row = {"mean": np.ones((1, 16, 4, 4)), "logvar": np.zeros((1, 16, 4, 4)), "crop_top_left": [[0, 0]], "flip": [0],
       "original_size": [32, 32], "mask": np.ones((1, 4, 4))}
t = time.perf_counter(); store = RowStore.create(work / "store.zarr", ids, fields)
write = getattr(store, "journal_row", store.write_row)  # an older checkout writes each row to its own files
for r in range(n):
    write(r, row)
getattr(store, "flush", lambda: None)(); out["write_rows_per_s"] = round(n / (time.perf_counter() - t))
out["store_files"] = sum(1 for p in (work / "store.zarr").rglob("*") if p.is_file())
t = time.perf_counter(); store = RowStore.open(work / "store.zarr"); ok = store.intact_mask(); row_of = store.row_of()
out["open_and_intact_s"] = round(time.perf_counter() - t, 3); assert ok.all()
picks = random.Random(0).sample(range(n), min(n, 500))
t = time.perf_counter(); [store.read_row(r) for r in picks]; out["verified_read_ms_per_row"] = round(1000 * (time.perf_counter() - t) / len(picks), 2)
items = [dataset.Item(f"img_{k:06d}.png", Path(f"/d/img_{k:06d}.png"), f"caption {k % 1000}", i,
                      dataset.caption_id(f"caption {k % 1000}")) for k, i in enumerate(ids)]
buckets = ["32x32", "48x32", "32x48"]
cap = {"rows": {c: k for k, c in enumerate(sorted({c for it in items for c in it.caption_ids}))}}
lat = {"index": {i: {"bucket": buckets[k % 3], "row": k // 3} for k, i in enumerate(ids)}}
tracemalloc.start(); t = time.perf_counter()
pairs = join_items(items, cap, lat, "scale")
data = TrainData(pairs, store, {b: store for b in buckets}, 1)
sampler = BucketSampler(data.buckets(), 4, 0, data.shares()); first = sampler.next()
out["join_and_sampler_s"] = round(time.perf_counter() - t, 3)
out["join_and_sampler_peak_mib"] = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
print(json.dumps(out))
"""
    folder = work / f"mechanics-{n}"
    env = {**os.environ, "PYTHONPATH": python_path(repo)}
    proc = subprocess.run([sys.executable, "-c", code, str(repo), str(n), str(folder)], cwd=repo, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def light(repo: Path, work: Path, n: int, model: Path, out_file: Path, store: bool) -> dict:
    """A size too large for this machine's encoders: the dataset scan (a fresh process's first, which
    builds or reads the image index, then an indexed one) and `mechanics`."""
    data = make_dataset(work / f"data-{n}", n, max(1, n // 10))
    sets = {"model": str(model), "data.path": str(data), "artifacts": str(work / "artifacts"), "device": "cpu",
            "data.resolution": 32, "data.cache_variants": 1, "run": f"scale-{n}"}
    out = {"n": n, "repo": str(repo), "light": True, "cpus": os.cpu_count()}
    for k in ("scan", "scan_again"):  # the second process finds the index the first one wrote
        out[k] = scan_times(repo, repo / "configs" / "demo.toml", sets)
        out_file.write_text(json.dumps(out, indent=2) + "\n")
    if store:
        out["mechanics"] = mechanics(repo, work, n)
    out_file.write_text(json.dumps(out, indent=2) + "\n")
    return out


def draw_photos(folder: Path, first: int, last: int, px: int) -> None:
    """JPEGs first..last-1 of px x px (a quarter px x 3/4 px): smooth gradients and a shape that move with the
    index, so the bytes differ and the decode costs what a photo's does."""
    import numpy as np
    from PIL import Image

    for i in range(first, last):
        w, h = (px, px * 3 // 4) if i % 4 == 3 else (px, px)
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        rgb = np.stack([(x * (i % 7 + 1) / w * 255) % 256, (y * (i % 5 + 1) / h * 255) % 256,
                        128 + 127 * np.sin((x + y + i) / 37.0)], axis=-1)
        rgb[(x - (i * 53) % w) ** 2 + (y - (i * 31) % h) ** 2 < (h / 6) ** 2] = (i * 37 % 256, 60, 200)
        Image.fromarray(rgb.astype(np.uint8)).save(folder / f"photo_{i:06d}.jpg", quality=90)


def gpu_latents(work: Path, n: int, px: int, out_file: Path, device: str = "cuda") -> dict:
    """cache-latents on the GPU with the full-size FLUX.1 VAE (random weights, bench/full_configs.py) in the tiny
    FLUX pipeline folder: n distinct px JPEGs, one variant each. Its images/s and encoder busy share (the
    stage's own summary), and the GPU's busy share over the encode loop (nvidia-smi, every 100 ms)."""
    import threading
    from concurrent.futures import ProcessPoolExecutor

    import torch

    from bench.full_configs import build_module
    from stages.tiny.models import build_tiny_pipeline

    model = work / "flux-dev-full-vae"
    if not (model / "model_index.json").exists():
        build_tiny_pipeline("flux-dev", model, seed=0)
        shutil.rmtree(model / "vae")
        build_module("flux", "vae", device, torch.float32).save_pretrained(str(model / "vae"), safe_serialization=True)
    data = work / f"photos-{n}-{px}"
    if not (data / "metadata.jsonl").exists():
        data.mkdir(parents=True, exist_ok=True)
        step = max(1, n // (os.cpu_count() or 1))
        starts = list(range(0, n, step))
        with ProcessPoolExecutor() as pool:
            list(pool.map(draw_photos, [data] * len(starts), starts, [min(n, k + step) for k in starts], [px] * len(starts)))
        (data / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"photo_{i:06d}.jpg", "text": f"photo {i}"})
                                                     + "\n" for i in range(n)))
    run, artifacts = f"gpu-latents-{n}-{px}", work / "artifacts"
    sets = {"model": str(model), "data.path": str(data), "artifacts": str(artifacts), "device": device,
            "data.resolution": px, "data.cache_variants": 1}
    args = ["cache-latents", "--config", str(ROOT / "configs" / "demo.toml"), "--run", run, "--force",
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    samples: list[tuple[float, float]] = []
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i",
                            os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0], "-lms", "100"],
                           stdout=subprocess.PIPE, text=True) if shutil.which("nvidia-smi") else None
    if smi is not None:
        threading.Thread(target=lambda: samples.extend((time.time(), float(line)) for line in smi.stdout
                                                       if line.strip().isdigit()), daemon=True).start()
    try:
        wall, _, output = cli(ROOT, args, work / "child.json")
    finally:
        if smi is not None:
            smi.terminate()
    run_events = events(artifacts / run, "cache-latents")
    loaded = next(e["ts"] for e in run_events if e["event"] == "loaded")
    done = run_events[-1]
    busy = [u for t, u in samples if loaded <= t <= done["ts"]]
    out = {"n": n, "px": px, "vae": "FLUX.1 AutoencoderKL, full size, random weights", "seconds": round(wall, 2),
           "stage_seconds": done.get("seconds"), "images_per_second": done.get("images_per_second"),
           "encoder_busy": done.get("encoder_busy"), "gpu_busy_pct": round(sum(busy) / len(busy), 1) if busy else None,
           "gpu_samples": len(busy), "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
           "summary": output.strip().splitlines()[-1]}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(out, indent=2) + "\n")
    return out


def table(rows: list[dict]) -> str:
    head = ("| items | files per 10k items (captions + latents) | cache-latents images/s | train start-up s "
            "| train peak RSS MiB | status s | no-op run s | scan s (indexed) |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in (r for r in rows if not r.get("light")):
        lines.append(f"| {r['n']:,} | {r['captions.zarr']['files_per_10k_items']:,} + {r['latents.zarr']['files_per_10k_items']:,} "
                     f"| {r['cache-latents']['images_per_second']} | {r['train']['start_to_first_step_s']} "
                     f"| {r['train']['peak_rss_mib']} | {r['status']['seconds']} | {r['noop_run']['seconds']} "
                     f"| {r['scan'].get('seconds', ['?'])[-1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000", help="comma-separated item counts")
    parser.add_argument("--full-up-to", type=int, default=10_000, help="larger sizes repeat their captions")
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose code is measured")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lorapipe-scale"), help="datasets, model and runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale",
                        help="a folder for scale-<N>.json, or with one size a .json file")
    parser.add_argument("--device", default="cpu", help="the stages' device (cuda on the GPU machine)")
    parser.add_argument("--no-store", action="store_true", help="--light sizes skip `mechanics`")
    parser.add_argument("--light", default="", help="comma-separated sizes measured without the encoders (`light`)")
    parser.add_argument("--checks-only", action="store_true",
                        help="runs built before (in --work): measure status, the no-op run and the scan again, "
                             "keeping the other figures of <out>/scale-<N>.json")
    parser.add_argument("--gpu-latents", type=int, default=0, metavar="N",
                        help="instead: cache-latents of N photos on the GPU with the full-size FLUX.1 VAE (`gpu_latents`); "
                             "--out is then the result file")
    parser.add_argument("--px", type=int, default=1024, help="--gpu-latents: the photos' size and data.resolution")
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo))
    if args.gpu_latents:
        print(json.dumps(gpu_latents(args.work, args.gpu_latents, args.px, args.out, args.device)), flush=True)
        return
    from stages.tiny.models import build_tiny_pipeline

    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "flux-dev"
    if not (model / "model_index.json").exists():
        build_tiny_pipeline("flux-dev", model, seed=0)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    one_file = args.out.suffix == ".json"
    if one_file and len(sizes) != 1:
        raise SystemExit(f"--out {args.out} is one file: give one size, or a folder")
    (args.out.parent if one_file else args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for n in sizes:
        out_file = args.out if one_file else args.out / f"scale-{n}.json"
        row = measure(args.repo.resolve(), args.work, n, n <= args.full_up_to, model, args.device, out_file,
                      args.checks_only)
        if not args.checks_only:
            row["mechanics"] = mechanics(args.repo.resolve(), args.work, n)
        out_file.write_text(json.dumps(row, indent=2) + "\n")
        rows.append(row)
        print(json.dumps(row), flush=True)
    for n in (int(s) for s in args.light.split(",") if s):
        rows.append(light(args.repo.resolve(), args.work, n, model, args.out / f"scale-{n}.json", not args.no_store))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
