"""musubi-tuner's Wan 2.2 LoRA trainer side by side with the product, on the same model folder, clips and caches.

    python bench/peers_video.py run --family wan2.2-14b --model /dev/shm/m/wan2.2-14b --data /tmp/peers-data/wan14b \\
        --res 640 --frames 33 --steps 10 --out $OUT/peers-wan14b-640-b1.json
    python bench/peers_video.py run --tiny --family wan2.2-14b --model /tmp/m/wan14b --data /tmp/d/wan14b \\
        --out /tmp/peers-wan14b-tiny.json --peer-pythonpath /tmp/musubisite:/tmp/tvsite          # CPU plumbing

Why musubi-tuner and this family: bench/peers.md ("Wan 2.2"). The flow differs from bench/peers.py's (diffusers'
scripts read the pipeline folder and images themselves) because musubi reads Wan's original checkpoint layout and its
own cache files:

1. the product's encode-captions and cache-latents on the clips (its first train row reuses them);
2. the peer: the trained expert's transformer in Wan's key names (bench/wan_musubi.py convert, reused while the
   model folder's transformer is unchanged), musubi's cache files written from the product's caches (the same
   latents and text features, bench/wan_musubi.py caches, in the peer's environment), its dataset config, and
   musubi's wan_train_network.py through bench/musubi_launch.py with bench/peer_site on its PYTHONPATH, which times
   each optimizer step and its peak as for the diffusers scripts;
3. the product's train rows (`fitpeer` takes the peer's peak as its budget), as bench/peers.py runs them.

One JSON in bench/peers.py's layout (report: bench/report.py, "Side by side").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peers import (  # noqa: E402
    SITE, SCRIPTS, _imports, peer_side, peer_summary, product_rows, read_steps, result_file, run_product, watch,
)


@dataclass(frozen=True)
class VideoPeer:
    folder: str  # under .carry-peers/: the repository's files (its `src` on the peer's PYTHONPATH)
    upstream: str  # owner/name on GitHub
    upstream_commit: str
    task: str  # musubi's --task
    component: str  # the pipeline's transformer the product trains (train.expert = "high")
    # the trained expert's noise range as musubi's docs set it for one Wan 2.2 expert (the product: sigma >= 0.875)
    timesteps: tuple[str, ...]


PEERS = {
    "wan2.2-14b": VideoPeer("musubi-tuner", "kohya-ss/musubi-tuner", "30c658c4f4b0bf05038b3346eff9670259b10fc7",
                            "t2v-A14B", "transformer",
                            ("--min_timestep", "875", "--max_timestep", "1000", "--preserve_distribution_shape")),
}
SHIFT = 3.0  # configs/wan2.2-14b.toml train.shift (the Diffusers repo's flow_shift): both sides


def ensure_clips(data: Path, tiny: bool, frames: int) -> list[Path]:
    """8 drawn moving-shape clips (stages/tiny/shapes.py make_clip_dataset) at 832x480 (96x64 tiny), `frames` frames
    each, every one a folder of PNG frames (make_clip_dataset's fallback where PyAV cannot write: the GPU machine's
    wheels carry no PyAV, and the decode is outside the timed steps); its two stills are removed (the peer trains
    clips only). Made once per folder."""
    import stages.core.video as video
    from stages.tiny.shapes import make_clip_dataset

    clips = sorted(p for p in data.glob("clip_*") if p.suffix != ".txt")
    if not clips:
        write_mp4 = video.write_mp4
        video.write_mp4 = lambda *a, **k: False  # "no encoder": make_clip_dataset writes the frames as a folder
        try:
            make_clip_dataset(data, n=8, seed=0, frames=frames, fps=16.0, sizes=((96, 64),) if tiny else ((832, 480),))
        finally:
            video.write_mp4 = write_mp4
        for still in data.glob("still_*"):
            still.unlink()
        clips = sorted(p for p in data.glob("clip_*") if p.suffix != ".txt")
    return clips


def convert_dit(model: Path, component: str, out: Path) -> tuple[Path, float, bool]:
    """The transformer in Wan's names (bench/wan_musubi.py convert): kept while its stamp (the source files' sizes
    and times) matches. Returns (musubi's --dit, seconds spent, reused)."""
    from bench.wan_musubi import convert

    src = model / component
    stamp = {p.name: [p.stat().st_size, p.stat().st_mtime] for p in sorted(src.glob("*.safetensors"))}
    stamp_file = out / "source.json"
    shards = sorted(out.glob("wan-00001-of-*.safetensors"))
    if shards and stamp_file.exists() and json.loads(stamp_file.read_text()) == {"source": str(src), "files": stamp}:
        return shards[0], 0.0, True
    t0 = time.time()
    first = convert(src, out)
    stamp_file.write_text(json.dumps({"source": str(src), "files": stamp}))
    return first, round(time.time() - t0, 2), False


def peer_env(a: argparse.Namespace, steps_file: Path) -> tuple[dict[str, str], bool]:
    """The peer's environment: bench/peer_site (timing), the repo (the cache writer reads the product's stores), the
    carried musubi-tuner's src, --peer-pythonpath; torchvision's C ops skipped where its wheel cannot load them."""
    peer = PEERS[a.family]
    extra = [p for p in a.peer_pythonpath.split(os.pathsep) if p]
    path = [str(SITE), str(ROOT), str(Path(a.scripts) / peer.folder / "src"), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "LORAPIPE_PEER_STEPS": str(steps_file),
           "PYTHONPATH": os.pathsep.join(path + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    if not a.tiny:
        env["LORAPIPE_PEER_NO_CUDNN_SDPA"] = "1"  # as the product's train stage (cuDNN SDPA's backward dies on this stack)
    tv = _imports("torchvision", {**env, "LORAPIPE_PEER_STEPS": ""})
    if not tv:
        env["LORAPIPE_PEER_TV_STANDIN"] = "1"
    if not _imports("cv2", {**env, "LORAPIPE_PEER_STEPS": ""}):  # musubi imports it for resizing images it never
        env["LORAPIPE_PEER_CV2_STANDIN"] = "1"  # gets here (its caches are written from the product's): a stand-in
    return env, tv


def peer_command(a: argparse.Namespace, dims: Path, dit: Path, dataset: Path, out_dir: Path) -> list[str]:
    """musubi's wan_train_network.py arguments for the same work as the product's train row: LoRA r16/alpha 16 on
    every Linear of the blocks (musubi's default set = the product's default targets), gradient checkpointing, bf16,
    SDPA attention, torch's AdamW (fused on CUDA, as the product's), constant LR 1e-4, the expert's timesteps through
    the same flow shift, one timestep per sample (`--force_v2_1_time_embedding`: the diffusers A14B transformer's
    embedding; musubi's default for Wan 2.2 builds a per-token one, the same values at more memory)."""
    peer = PEERS[a.family]
    return [sys.executable, str(ROOT / "bench" / "musubi_launch.py"), "--dims", str(dims), "--",
            "--task", peer.task, "--dit", str(dit), "--dataset_config", str(dataset), "--sdpa",
            "--mixed_precision", "no" if a.tiny else "bf16", "--gradient_checkpointing",
            "--network_module", "musubi_tuner.networks.lora_wan", "--network_dim", "16", "--network_alpha", "16",
            "--optimizer_type", "AdamW", *([] if a.tiny else ["--optimizer_args", "fused=True"]),  # as the product's
            "--learning_rate", "1e-4", "--lr_scheduler", "constant", "--max_train_steps", str(a.steps), "--seed", "0",
            "--timestep_sampling", "shift", "--discrete_flow_shift", str(SHIFT), *peer.timesteps,
            "--force_v2_1_time_embedding", "--max_data_loader_n_workers", "0" if a.tiny else "2",
            *([] if a.tiny else ["--persistent_data_loader_workers"]),
            "--output_dir", str(out_dir), "--output_name", "peer"]


def run_peer(a: argparse.Namespace, run_dir: Path, data: Path, left: float) -> dict[str, Any]:
    from bench.wan_musubi import dataset_toml, musubi_dims

    peer, work = PEERS[a.family], Path(a.work)
    src = Path(a.scripts) / peer.folder / "src" / "musubi_tuner" / "wan_train_network.py"
    if not src.is_file():
        raise FileNotFoundError(f"{src} is missing: carry {peer.upstream} at {peer.upstream_commit[:10]} in "
                                f".carry-peers/{peer.folder} (bench/peers.md says how)")
    out_dir = work / f"peer-out-{a.family}-{a.res}-b{a.batch}"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    steps_file, log = out_dir / "steps.jsonl", work / f"peer-{a.family}-{a.res}-b{a.batch}.log"
    env, tv = peer_env(a, steps_file)
    t0 = time.time()
    dit, convert_s, reused = convert_dit(Path(a.model), peer.component, Path(a.dit_dir or work / f"musubi-dit-{a.family}"))
    dims = out_dir / "dims.json"
    dims.write_text(json.dumps({**musubi_dims(Path(a.model) / peer.component), "full": not a.tiny}))
    cache = out_dir / "cache"
    t1 = time.time()
    made = subprocess.run([sys.executable, str(ROOT / "bench" / "wan_musubi.py"), "caches", "--run-dir", str(run_dir),
                           "--data", str(data), "--out", str(cache)], env={**env, "LORAPIPE_PEER_STEPS": ""},
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise RuntimeError(f"musubi's caches from the product's: {made.stderr.strip()[-1500:]}")
    latents = sorted(cache.glob("*_wan.safetensors"))
    w, h = (int(v) for v in latents[0].name.split("_")[-2].split("x"))
    frames = int(latents[0].name.split("_")[-3].split("-")[1])
    dataset = out_dir / "dataset.toml"
    dataset.write_text(dataset_toml(cache, data, w, h, frames, a.batch))
    cmd = peer_command(a, dims, dit, dataset, out_dir)
    row: dict[str, Any] = {"side": "musubi-tuner", "script": "wan_train_network.py", "upstream": peer.upstream,
                           "upstream_commit": peer.upstream_commit, "precision": "fp32" if a.tiny else "bf16",
                           "cmd": " ".join(cmd[1:]).replace(str(ROOT) + "/", ""), "clips": len(latents),
                           "clip_shape": f"{w}x{h}x{frames}f", "convert_s": convert_s, "convert_reused": reused,
                           "caches_s": round(time.time() - t1, 2), "datasets": "product's caches",
                           "torchvision": "ok" if tv else "C ops skipped (CPU stand-in)",
                           "cv2": "stand-in (not installed)" if env.get("LORAPIPE_PEER_CV2_STANDIN") else "installed",
                           "cudnn_sdpa": "torch's default" if a.tiny else "off (as the product's train stage)"}
    left -= time.time() - t0
    t0 = time.time()
    rc, stopped = watch(cmd, work, env, log, max(30.0, min(a.peer_timeout_s, left)), out_dir / "peer.safetensors",
                        steps_file, a.steps)
    steps, exit_row = read_steps(steps_file)
    row.update(rc=rc, wall_s=round(time.time() - t0, 2), lora_saved=(out_dir / "peer.safetensors").exists(),
               stopped=stopped, step_source="optimizer-step hook")
    row.update(peer_summary(steps, exit_row, a.batch, a.warmup))
    row["status"] = "ok" if row["steps_done"] >= a.steps and row["step_s"] else "failed"
    if row["status"] != "ok":
        row["log_tail"] = log.read_text(errors="replace")[-3000:]
    row["log"] = str(log)
    return row


def run(a: argparse.Namespace) -> None:
    from bench.bench import Runner, family_full, machine_info, run_args
    from stages.families import get_family

    fam = a.family
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + a.budget_s
    data = Path(a.data).resolve()
    clips = ensure_clips(data, a.tiny, a.frames)
    targets = list(get_family(fam).default_lora_targets)
    result: dict[str, Any] = {
        "meta": {**machine_info(), "command": " ".join(sys.argv), "tiny": a.tiny},
        "family": fam, "res": a.res, "frames": a.frames, "batch": a.batch, "steps": a.steps, "warmup": a.warmup,
        "text_tokens": 512, "lora": {"rank": 16, "alpha": 16, "targets": targets}, "gradient_checkpointing": True,
        "images": len(clips), "clips": len(clips), "model": str(a.model), "rows": []}

    save, add = result_file(Path(a.out), result)

    save()
    runner = Runner(run_args(work=str(work / "product"), budget_s=max(30.0, deadline - time.time()),
                             out=str(work / "product" / "runner.json"), tiny=a.tiny, keep=True))
    runner.ensure_data = lambda controls=0, video=False: data
    res_sets = {**runner.base_sets(fam, a.res), "data.path": str(data), "data.resolution": a.res,
                "data.frames": a.frames, "data.fps": 0, "captions.max_sequence_length": 512, "train.steps": a.steps,
                "runtime.warmup_steps_excluded": a.warmup, "train.rank": 16, "train.alpha": 16, "train.expert": "high",
                "runtime.gradient_checkpointing": True, "train.lr_scheduler": "constant"}
    precisions = [p for p in a.product_precisions.split(",") if p]
    cache_rows: dict[str, Any] = {}
    caches = run_product(a, fam, data, precisions[0] if precisions else "bf16", runner, res_sets, cache_rows,
                         kinds=("encode", "latents"))
    result["product_caches"] = caches["stages"]
    save()
    if caches.get("status") != "ok":
        add({**caches, "side": "product", "precision": "caches"})
        return
    run_dir = Path(res_sets["artifacts"]) / f"peers-{fam}-{a.res}"
    peer_peak = peer_side(a, add, "musubi-tuner", lambda: run_peer(a, run_dir, data, deadline - time.time()))
    if "product" in a.sides.split(","):
        product_rows(precisions, deadline, add,
                     lambda precision: run_product(a, fam, data, precision, runner, res_sets, cache_rows, peer_peak))
    result["text_precision_product"] = family_full(fam).TEXT_PRECISION
    save()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the product's caches, the peer, then the product's train rows; one JSON")
    r.add_argument("--family", required=True, choices=sorted(PEERS))
    r.add_argument("--model", required=True, help="a diffusers pipeline folder (bench.py build)")
    r.add_argument("--data", required=True, help="a folder of clips (drawn here when it has none)")
    r.add_argument("--out", required=True)
    r.add_argument("--res", type=int, default=640, help="data.resolution (640: 832x480 clips stay 832x480)")
    r.add_argument("--frames", type=int, default=33)
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--steps", type=int, default=10)
    r.add_argument("--warmup", type=int, default=3, help="steps left out of the steady step time (both sides)")
    r.add_argument("--product-precisions", default="bf16", help="the product's train rows (bench/peers.py VARIANT_FLAGS)")
    r.add_argument("--sides", default="peer,product")
    r.add_argument("--peer-row", default="", help="with --sides product: the peer's row from an earlier run's JSON")
    r.add_argument("--peer-timeout-s", type=float, default=300.0)
    r.add_argument("--budget-s", type=float, default=560.0, help="no child starts or runs past this many seconds")
    r.add_argument("--work", default="/tmp/lorapipe-peers")
    r.add_argument("--dit-dir", default="", help="where the converted transformer goes (default: in --work; "
                   "peers.sh puts it in /dev/shm beside the model folder)")
    r.add_argument("--scripts", default=str(SCRIPTS), help="the carried peers' folder (.carry-peers)")
    r.add_argument("--peer-pythonpath", default="", help="extra import paths for the peer only (its wheels, e.g. "
                   "easydict, ftfy, einops, voluptuous, toml, where the environment lacks them)")
    r.add_argument("--tiny", action="store_true", help="tiny models on CPU: fp32 (plumbing check)")
    return ap


def main() -> None:
    a = parser().parse_args()
    if a.tiny:
        a.res = 64 if a.res == 640 else a.res
        a.frames = 9 if a.frames == 33 else a.frames
    run(a)


if __name__ == "__main__":
    main()
