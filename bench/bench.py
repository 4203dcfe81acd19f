"""The product's benchmark: full-size random-weight pipelines, trained by the product's own stages.

    python bench/bench.py run --out $OUT/bench.json            # on the H200 machine (all families present)
    python bench/bench.py run --tiny --out /tmp/bench.json     # the same plumbing on tiny models, on CPU
    python bench/bench.py report --write /tmp/RESULTS.md        # every file of bench/results, latest per row

`run` builds each family's full-size pipeline from bench/full_configs.py (random bf16 weights, made
on the GPU, saved as an ordinary diffusers folder on local disk or /dev/shm), writes a synthetic
dataset, and runs `pipeline.py encode-captions / cache-latents / train / export-lora` as child
processes with `--set` overrides, in priority order (PLAN) until `--budget-s` is spent. After each
item it rewrites --out, so a cut-off call keeps what it measured; `--skip-done FILE` continues a
plan in a later call. The family's model folder is deleted at the end (64 GB disk: one at a time).
A family too big for the host (full.py STAGED: FLUX.2 dev) is built one stage's components at a time
just before the stage that reads them (bench/staged.py); `--staged` does the same for every family,
which is how `--tiny` exercises it for the others.
`report` turns result files into bench/RESULTS.md (tables, targets, MFU, what was not run).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRAIN_STEPS, WARMUP = 8, 3
VARIED_CAPTIONS = 24  # images in the dataset of varied caption lengths (memory.py --captions varied)  # 3 steps excluded from samples/s (first step, graph capture, one replay)
CAPTION_TOKENS = 77
# a family whose text encoder takes only some lengths: LTX-2's connectors fill the padding with their 128 learnable
# registers, so its captions are a multiple of 128 tokens
CAPTION_TOKENS_OF = {"ltx2": 128}


def caption_tokens(family: str) -> int:
    """The caption length of a family's bench rows: 77 tokens, or the shortest its text encoder takes."""
    return CAPTION_TOKENS_OF.get(family, CAPTION_TOKENS)


def family_full(fam: str) -> Any:
    """The family's full-size facts (stages/families/<family>/full.py): PRESET, TEXT_PRECISION (of the
    captions every train run reads), BUILD_SECONDS (build + save on the H200, measured 30-98 s)."""
    from stages.families import family_part

    return family_part(fam, "full")


@dataclass
class Item:
    id: str  # e.g. "flux/train/nf4-512-b4"
    kind: str  # encode | latents | train | export | verify | profile | pytest
    res: int = 512
    sets: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    est_s: float = 60.0  # expected seconds on the H200, to decide what still fits the budget
    run: str = ""  # run name (default bench-<family>-<res>)
    controls: int | None = None  # control images per item in its dataset (None: the family's least, control_range[0])

    def sibling(self, kind: str) -> str:
        """The id of this item's row of another stage, same family and tag ("flux/export/nf4-512-b1" ->
        "flux/train/nf4-512-b1" for "train")."""
        fam, _, tag = self.id.split("/", 2)
        return f"{fam}/{kind}/{tag}"


def _train(fam: str, precision: str, res: int, batch: int, est: float, tag: str = "", **extra: Any) -> Item:
    env, run, controls = extra.pop("env", {}), extra.pop("run", ""), extra.pop("controls", None)
    sets = {"train.base_precision": precision, "train.batch_size": batch, **extra}
    return Item(f"{fam}/train/{precision}-{res}-b{batch}{tag}", "train", res, sets, env, est, run, controls)


# train.optimizer rows beside AdamW's bf16-1024-b1 (FLUX.1: step time and peak, i.e. the optimizer state), with
# the settings each needs: Prodigy's LR is a multiplier of its estimate; prodigy_schedulefree refuses clipping.
OPTIMIZER_SETS = {"adamw8bit": {}, "prodigy": {"train.learning_rate": 1.0}, "adafactor": {},
                  "prodigy_schedulefree": {"train.learning_rate": 1.0, "train.max_grad_norm": 0.0},
                  "adamw_schedulefree": {}}


def _optimizer_rows(fam: str) -> list[Item]:
    return [_train(fam, "bf16", 1024, 1, 60, f"-opt-{name}", **{"train.optimizer": name, **sets})
            for name, sets in OPTIMIZER_SETS.items()]


MEASURED = ("flux", "qwen-image", "z-image", "sdxl")  # families whose long plan (ablations included) ran before


def plan(fam: str) -> list[Item]:
    """Everything measured for one family, most important first (the targets lead).

    FLUX's targets are at batch 4; the other families' (Qwen-Image's step time, every family's
    peak VRAM) at batch 1, so for them the batch-1 nf4 run, its export and its load check lead.
    The newer and edit families get the short plan (`_short_plan`)."""
    if fam not in MEASURED:
        return _staged_plan(fam) if staged_family(fam) else _short_plan(fam)
    items = _full_plan(fam)
    if fam == "flux":
        return items + _optimizer_rows(fam)
    first = [f"{fam}/encode/{_text_precision(fam)}", f"{fam}/latents/512", f"{fam}/train/nf4-512-b1", f"{fam}/export/nf4-512-b1",
             f"{fam}/verify/nf4-512-b1", f"{fam}/train/bf16-512-b1", f"{fam}/train/nf4-512-b4", f"{fam}/profile/nf4-512-b1"]
    renamed = {f"{fam}/export/nf4-512-b4": first[3], f"{fam}/verify/nf4-512-b4": first[4],
               f"{fam}/profile/nf4-512-b4": first[7]}
    for it in items:
        if it.id in renamed:
            it.id, it.sets = renamed[it.id], {**it.sets, "train.batch_size": 1} if it.sets else {}
    by_id = {it.id: it for it in items}
    return [by_id[i] for i in first] + [it for it in items if it.id not in first and it.kind != "pytest"]  # pytest: once


def _short_plan(fam: str) -> list[Item]:
    """A newer or edit family: stage peaks and samples/s at 512 and 1024 px, batch 1 and 4, in the
    base precisions its full.py lists (BASE_PRECISIONS, default nf4 and bf16), then fp8 rows at 1024 px (batch 1
    and 4) where those lack fp8.
    Train items take the family's TRAIN_SECONDS (a compiled 512 px b1 item: load, regional compile,
    8 steps) plus what 1024 px and batch 4 add on the H200 (FLUX.1 rows in bench/results: +10-25 s).
    A family whose references are optional (control_range (0, n), FLUX.2) adds a one-reference run."""
    full = family_full(fam)
    train_s, precisions = full.TRAIN_SECONDS, getattr(full, "BASE_PRECISIONS", ("nf4", "bf16"))
    control_s = 5 * max(1, _family_controls(fam))  # cache-latents encodes each control too

    def train(p: str, res: int, b: int, **kw: Any) -> Item:
        return _train(fam, p, res, b, train_s + (15 if res == 1024 else 0) + (10 if b == 4 else 0), **kw)

    items = [Item(f"{fam}/encode/{_text_precision(fam)}", "encode", 512, est_s=getattr(full, "ENCODE_SECONDS", 25)),
             Item(f"{fam}/latents/512", "latents", 512, est_s=20 + control_s),
             train(precisions[0], 512, 1),
             Item(f"{fam}/export/{precisions[0]}-512-b1", "export", 512, est_s=20),
             Item(f"{fam}/verify/{precisions[0]}-512-b1", "verify", 512, {"train.batch_size": 1}, est_s=train_s // 2)]
    items += [train(p, 512, 1) for p in precisions[1:]] + [train(p, 512, 4) for p in precisions]
    items += [Item(f"{fam}/latents/1024", "latents", 1024, est_s=25 + 2 * control_s)]
    items += [train(p, 1024, 1) for p in precisions] + [train(p, 1024, 4) for p in precisions]
    low, high = _control_range(fam)
    if low == 0 and high > 0:  # optional reference images: one run with a reference per item
        run = f"bench-{fam}-512-ref1"
        items += [Item(f"{fam}/latents/512-ref1", "latents", 512, est_s=25, run=run, controls=1),
                  _train(fam, precisions[0], 512, 1, train_s + 5, "-ref1", run=run, controls=1)]
    # an fp8 base (Hopper/Ada) beside bf16's 1024 px rows
    return items + ([] if "fp8" in precisions else [train("fp8", 1024, 1), train("fp8", 1024, 4)])


def staged_family(fam: str) -> bool:
    """A family whose full-size pipeline the 1-GPU host cannot hold (full.py's STAGED): its folder is
    built one stage's components at a time (bench/staged.py)."""
    return bool(getattr(family_full(fam), "STAGED", False))


def _staged_plan(fam: str) -> list[Item]:
    """The short plan regrouped by the components each stage reads, so that each big one is built once:
    encode (text encoder), every latents item (VAE), then the denoiser's items, led by the 512 px b1
    train with its export and load check, 1024 px b1, 512 px b4 and a bf16 row where the plan has one."""
    items = _short_plan(fam)
    p = family_full(fam).BASE_PRECISIONS[0]
    lead = [f"{fam}/train/{p}-512-b1", f"{fam}/export/{p}-512-b1", f"{fam}/verify/{p}-512-b1",
            f"{fam}/train/{p}-1024-b1", f"{fam}/train/{p}-512-b4", f"{fam}/train/bf16-512-b1"]
    group = {"encode": 0, "latents": 1}
    order = {it.id: (group.get(it.kind, 2), lead.index(it.id) if it.id in lead else len(lead), n)
             for n, it in enumerate(items)}
    return sorted(items, key=lambda it: order[it.id])


def _control_range(fam: str) -> tuple[int, int]:
    from stages.families import get_family

    return get_family(fam).control_range


def _family_controls(fam: str) -> int:
    """Control images per item in the bench data of a plain run: the least the family trains on."""
    return _control_range(fam)[0]


def _text_precision(fam: str) -> str:
    return family_full(fam).TEXT_PRECISION


def _full_plan(fam: str) -> list[Item]:
    eager = {"LORAPIPE_CUDA_GRAPHS": "off"}
    bf16_captions = [] if _text_precision(fam) == "bf16" else [  # the text encoder's bf16 peak, beside nf4's
        Item(f"{fam}/encode/bf16", "encode", 512, {"captions.text_encoder_precision": "bf16"}, est_s=35,
             run=f"bench-{fam}-t5bf16")]
    return [
        Item(f"{fam}/encode/{_text_precision(fam)}", "encode", 512, est_s=35),  # the 1024 run gets a copy (same fingerprint)
        Item(f"{fam}/latents/512", "latents", 512, est_s=25),
        Item(f"{fam}/profile/nf4-512-b4", "profile", 512, {"train.base_precision": "nf4", "train.batch_size": 4}, est_s=60),
        _train(fam, "nf4", 512, 4, 80),  # untagged nf4 rows in bench/results ran before auto compiled nf4 (compiled: 66-84 s)
        Item(f"{fam}/export/nf4-512-b4", "export", 512, est_s=15),
        _train(fam, "bf16", 512, 4, 65),  # compiled bf16 items took 45-85 s (bench/results)
        Item(f"{fam}/verify/nf4-512-b4", "verify", 512, est_s=40),
        _train(fam, "nf4", 512, 1, 75),
        _train(fam, "bf16", 512, 1, 60),
        Item(f"{fam}/latents/1024", "latents", 1024, est_s=30),
        _train(fam, "bf16", 1024, 4, 75),
        _train(fam, "nf4", 1024, 4, 90),
        _train(fam, "bf16", 512, 4, 40, "-nocompile", **{"runtime.compile_transformer": "off"}),  # auto compiles bf16
        Item(f"{fam}/pytest/cuda", "pytest", est_s=90),
        _train(fam, "nf4", 1024, 1, 85),
        _train(fam, "bf16", 1024, 1, 60),
        _train(fam, "bf16", 1024, 4, 60, "-nockpt", **{"runtime.gradient_checkpointing": False}),
        _train(fam, "bf16", 512, 4, 50, "-eager", env=eager),
        _train(fam, "nf4", 512, 4, 60, "-eager", env=eager),
        _train(fam, "bf16", 1024, 4, 60, "-nocompile", **{"runtime.compile_transformer": "off"}),
        _train(fam, "nf4", 512, 4, 90, "-compile", **{"runtime.compile_transformer": "on"}),  # = auto now; was off over nf4
        _train(fam, "nf4", 512, 1, 80, "-compile", **{"runtime.compile_transformer": "on"}),
        _train(fam, "nf4", 1024, 4, 100, "-compile", **{"runtime.compile_transformer": "on"}),
        _train(fam, "fp8", 1024, 4, 85),  # fp8 base (Hopper/Ada), beside bf16-1024-b4 (FLUX.1: 84.7 s)
        _train(fam, "fp8", 1024, 1, 75),  # Qwen-Image's fp8 target is at 1024 px b1
        _train(fam, "fp8", 512, 1, 70),
        _train(fam, "fp8", 512, 4, 70),
        *[Item(f"{fam}/profile/{p}-512-b1", "profile", 512, {"train.base_precision": p, "train.batch_size": 1}, est_s=70)
          for p in ("fp8", "bf16")],  # where fp8's 512 px b1 step goes (Qwen-Image: 1.03x bf16's)
        *bf16_captions,
    ]


# ---- the machine and its software ------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    import platform

    import torch

    info: dict[str, Any] = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "python": platform.python_version(),
                            "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node()}
    for mod in ("diffusers", "transformers", "peft", "bitsandbytes", "zarr", "accelerate", "safetensors"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - a missing package is itself a fact to record
            info[mod] = f"missing ({type(e).__name__})"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        info["driver"] = smi.stdout.strip()
    return info


def model_dir(args: argparse.Namespace, fam: str) -> Path:
    """/dev/shm when it can hold the pipeline (no disk reads), else the work folder on disk."""
    if args.models:
        return Path(args.models) / fam
    shm = Path("/dev/shm")
    in_shm = shm / "lorapipe-bench" / fam
    if not args.tiny and (in_shm / "model_index.json").exists():  # begun there: a staged family's later components join it
        return in_shm
    if not args.tiny and shm.is_dir() and shutil.disk_usage(shm).free > 45 * 2**30:
        return in_shm
    return Path(args.work) / "models" / fam


# ---- the runner ----------------------------------------------------------------------------------


class Runner:
    def __init__(self, args: argparse.Namespace):
        self.args, self.work = args, Path(args.work)
        self.deadline = time.time() + args.budget_s
        priors = [json.loads(Path(f).read_text()) for f in args.skip_done]
        self.done = {r["id"] for prior in priors for r in prior.get("items", []) if r.get("status") == "ok"}
        self.results: dict[str, Any] = {"meta": {**machine_info(), "command": " ".join(sys.argv), "tiny": args.tiny},
                                        "items": [], "builds": {}}
        self.work.mkdir(parents=True, exist_ok=True)
        self.broken: set[tuple[str, int]] = set()
        self.notes: dict[str, str] = {}  # item id -> a note its row carries (record)

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        tmp.replace(out)

    def record(self, item: Item, status: str, **fields: Any) -> dict[str, Any]:
        row = {"id": item.id, "kind": item.kind, "res": item.res, "sets": item.sets, "env": item.env,
               "status": status, **fields}
        if item.id in self.notes and "note" not in row:
            row["note"] = self.notes[item.id]
        self.results["items"].append(row)
        self.save()
        print(f"[bench] {item.id}: {status} {json.dumps({k: v for k, v in fields.items() if k in ('wall_s', 'summary', 'reason')}, default=str)[:400]}", flush=True)
        return row

    # -- setup
    def staged(self, fam: str) -> bool:
        """Built one stage's components at a time: the family's STAGED, or every family with --staged."""
        return staged_family(fam) or bool(getattr(self.args, "staged", False))

    def to_build(self, fam: str, kind: str) -> list[str]:
        """The modules an item of `kind` needs that the folder lacks (all of them: the whole pipeline)."""
        from bench import staged

        if not self.staged(fam):
            return [] if (model_dir(self.args, fam) / "model_index.json").exists() else list(staged.module_components(fam))
        have = staged.read_state(model_dir(self.args, fam), fam)
        return [c for c in staged.stage_components(fam, kind) if have.get(c) != "built"]

    def build_seconds(self, fam: str, kind: str) -> float:
        missing = self.to_build(fam, kind)
        if not missing:
            return 0.0
        per = getattr(family_full(fam), "COMPONENT_BUILD_SECONDS", {})
        if self.staged(fam) and all(c in per for c in missing):
            return float(sum(per[c] for c in missing))
        return float(family_full(fam).BUILD_SECONDS)

    def ensure_model(self, fam: str, kind: str = "train") -> Path:
        """The family's pipeline folder, holding the modules an item of `kind` loads: the whole pipeline,
        or for a staged family those modules, every other built one replaced by a stand-in first."""
        from bench import staged

        folder, missing = model_dir(self.args, fam), self.to_build(fam, kind)
        if not missing:
            return folder
        cmd = [sys.executable, str(ROOT / "bench" / "bench.py"), "build", "--family", fam, "--folder", str(folder)]
        key, stood_in = fam, {}
        if self.staged(fam):
            keep = staged.stage_components(fam, kind)
            stood_in = {c: staged.stand_in(folder, c) for c, s in staged.read_state(folder, fam).items()
                        if s == "built" and c not in keep}  # room for the next one (bytes freed)
            cmd += ["--components", ",".join(missing)]
            key = f"{fam}/{','.join(missing)}"
        counts_file = self.work / f"build-{key.replace('/', '_').replace(',', '+')}.json"
        cmd += ["--counts", str(counts_file)] + (["--tiny"] if self.args.tiny else [])
        rc, wall, tail = self.call(cmd, {}, f"{key}/build")
        if rc != 0:
            raise RuntimeError(f"building {key} failed: {tail[-800:]}")
        counts = json.loads(counts_file.read_text())
        parts = [folder / c for c in missing] if self.staged(fam) else [folder]
        self.results["builds"][key] = {"seconds": wall, "params_b": counts, "folder": str(folder),
                                       "bytes": sum(f.stat().st_size for d in parts for f in d.rglob("*") if f.is_file()),
                                       **({"stood_in_bytes_freed": stood_in} if stood_in else {})}
        self.save()
        print(f"[bench] built {key} in {wall:.0f}s at {folder}", flush=True)
        return folder

    def ensure_data(self, controls: int = 0, video: bool = False) -> Path:
        """The synthetic dataset, with `controls` control images per item (edit families, references); for a video
        family, clips of CLIP_FRAMES frames (every item a whole clip, so each step trains data.frames frames)."""
        varied = getattr(self.args, "captions", "equal") == "varied"
        data = self.work / ("data-clips" if video else "data" if not controls else f"data-c{controls}")
        data = data.with_name(data.name + "-varied") if varied else data
        if not data.exists():
            if video:
                make_clips(data, n=4, frames=CLIP_FRAMES, size=(96, 64) if self.args.tiny else (1280, 720))
            else:
                make_dataset(data, n=VARIED_CAPTIONS if varied else 8, side=96 if self.args.tiny else 1024,
                             controls=controls, varied=varied)
        return data

    def base_sets(self, fam: str, res: int, controls: int | None = None) -> dict[str, Any]:
        from stages.families import get_family

        tiny = self.args.tiny
        controls = _family_controls(fam) if controls is None else controls
        # a video family's clips are frame folders read at their own rate (data.fps = 0): every row's data.frames
        # are consecutive frames of one clip
        video = {"data.fps": 0} if get_family(fam).trains_video else {}
        # a two-expert family's rows train its first expert (Wan 2.2 A14B: the high-noise one; the other is its twin)
        experts = get_family(fam).experts
        return {"artifacts": str(self.work / "artifacts"), "data.path": str(self.ensure_data(controls, bool(video))),
                **video, **({"train.expert": experts[0]} if experts else {}),
                "data.resolution": 64 if tiny else res, "data.cache_variants": 1, "captions.batch_size": 8,
                "captions.text_encoder_precision": _text_precision(fam),  # every train run reads these captions
                "captions.max_sequence_length": caption_tokens(fam),
                "train.steps": 4 if tiny else TRAIN_STEPS, "runtime.warmup_steps_excluded": 1 if tiny else WARMUP,
                "runtime.checkpoint_every": 0, "runtime.log_every": 1, "train.lr_warmup_steps": 0,
                "runtime.gradient_checkpointing": True}

    def config(self, fam: str, model: Path, res: int, sets: dict[str, Any]) -> Any:
        """The config a row's stages run with on the GPU (the preset, the bench's settings and the row's
        `sets`), loaded here for planning: no stage runs."""
        from stages.core.config import load_config

        return load_config(ROOT / family_full(fam).PRESET,
                           {**self.base_sets(fam, res), **sets, "model": str(model), "device": "cuda"})

    def stage_cmd(self, fam: str, item: Item, stage: str, model: Path, extra: list[str] = ()) -> list[str]:
        sets = {**self.base_sets(fam, item.res, item.controls), **item.sets}
        if self.args.tiny:  # nf4, fp8 and bf16 need CUDA: the tiny run checks the plumbing in fp32
            sets = {k: ("fp32" if v in ("nf4", "fp8", "bf16") else v) for k, v in sets.items()}
        cmd = [sys.executable, str(ROOT / "pipeline.py"), stage, "--config", str(ROOT / family_full(fam).PRESET),
               "--model", str(model), "--run", run_name(fam, item)]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
        return cmd + list(extra)

    def run_dir(self, run: str) -> Path:
        return self.work / "artifacts" / run

    def call(self, cmd: list[str], env: dict[str, str], name: str) -> tuple[int, float, str]:
        log = self.work / "logs" / f"{name.replace('/', '_')}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "LORAPIPE_PLAIN": "1", **env}
        t = time.time()
        with log.open("w") as fh:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env=full_env, stdout=fh, stderr=subprocess.STDOUT,
                                    timeout=max(30.0, self.left())).returncode
            except subprocess.TimeoutExpired:
                rc = -9
            else:
                rc = KILLED_FROM_OUTSIDE if rc == -9 else rc  # -9 stays the budget's: FLUX.2 dev's export read as cut off
        tail = log.read_text()[-2500:] if rc != 0 else ""
        return rc, round(time.time() - t, 2), tail

    # -- items
    def caches_ready(self, run: str) -> bool:
        return all(stage_manifest(self.run_dir(run), kind).exists() for kind in ("encode", "latents"))

    def caption_donor(self, fam: str, run: str) -> Path | None:
        """Another run's captions this run can reuse: the other resolution's (captions do not depend on
        it), or, for a run with references whose text encoder does not see them, the plain run's."""
        from stages.families import get_family

        suffix = run.split(f"bench-{fam}-", 1)[1].lstrip("0123456789")  # "" or "-ref1"
        names = [f"bench-{fam}-{r}{suffix}" for r in (512, 1024)]
        if suffix and not get_family(fam).text_sees_controls:
            names += [f"bench-{fam}-{r}" for r in (512, 1024)]
        return next((stage_manifest(self.run_dir(n), "encode").parent for n in names
                     if n != run and stage_manifest(self.run_dir(n), "encode").exists()), None)

    def copy_captions(self, fam: str, run: str) -> None:
        caps, donor = stage_manifest(self.run_dir(run), "encode"), self.caption_donor(fam, run)
        if not caps.exists() and donor is not None:
            shutil.copytree(donor, caps.parent, dirs_exist_ok=True)

    def ensure_caches(self, fam: str, item: Item, items: list[Item]) -> None:
        run = run_name(fam, item)
        self.copy_captions(fam, run)
        if self.caches_ready(run):
            return
        if run in self.broken:
            raise RuntimeError(f"the caches of run {run} could not be built (see the encode/latents rows)")
        self.broken.add(run)
        caps = stage_manifest(self.run_dir(run), "encode")
        for it in items:  # caches missing (a failed or cold earlier call): build them, recorded as a rerun
            if it.kind == "encode" and not it.run and not caps.exists():
                self.execute(fam, Item(it.id + "#rerun", "encode", item.res, it.sets, it.env, it.est_s, run,
                                       item.controls))
            if it.kind == "latents" and run_name(fam, it) == run:
                self.execute(fam, Item(it.id + "#rerun", "latents", it.res, it.sets, it.env, it.est_s, it.run, it.controls))
        if not self.caches_ready(run):
            raise RuntimeError(f"the caches of run {run} could not be built (see the encode/latents rows)")
        self.broken.discard(run)

    def ensure_upstream(self, fam: str, item: Item, items: list[Item]) -> None:
        """An export needs its run's trained adapter and a verify its export. When an earlier call measured
        those (--skip-done) on a machine since given back, they are rebuilt here, recorded as reruns (a verify
        row on a fresh machine otherwise finds no export to check)."""
        if item.kind not in ("export", "verify"):
            return
        rd = self.run_dir(run_name(fam, item))
        for kind in ("train", "export") if item.kind == "verify" else ("train",):
            marker = stage_manifest(rd, kind)
            if marker.exists():
                continue
            prior = next((it for it in items if it.id == item.sibling(kind)), None)
            if prior is None:
                raise RuntimeError(f"{item.id} needs {marker}, and the plan has no {item.sibling(kind)} to make it")
            if item.id in self.notes:  # the export of the adapter `order` moved this item behind
                self.notes[prior.id + "#rerun"] = self.notes[item.id]
            row = self.execute(fam, replace(prior, id=prior.id + "#rerun", res=item.res, run=run_name(fam, item),
                                            controls=item.controls))  # the run `order` may have moved it to
            if row.get("status") != "ok":
                raise RuntimeError(f"{item.id} needs {prior.id}, whose rerun failed (see its row)")

    def finished_note(self, fam: str, item: Item, run_dir: Path, rc: int, since: float) -> str | None:
        """For a stage call that failed (rc != 0): the row's note when it was a train stage killed after
        writing its complete final manifest (`finished_before_kill`: the row is read from it), else None."""
        if rc == 0 or item.kind != "train":
            return None
        steps = int({**self.base_sets(fam, item.res, item.controls), **item.sets}["train.steps"])
        return KILLED_AFTER_MANIFEST.format(rc=rc, steps=steps) if finished_before_kill(run_dir, "train", since, steps) else None

    def execute(self, fam: str, item: Item) -> dict[str, Any]:
        kind = item.kind
        model = self.ensure_model(fam, kind) if kind != "pytest" else model_dir(self.args, fam)
        if kind in ("encode", "latents", "train", "export"):
            stage = {"encode": "encode-captions", "latents": "cache-latents", "train": "train", "export": "export-lora"}[kind]
            # a train item measures a fresh training: --restart sets an earlier item's adapter of this run aside
            extra = {"export": ["--verify"], "encode": ["--force"], "latents": ["--force"], "train": ["--restart"]}[kind]
            cmd = self.stage_cmd(fam, item, stage, model, extra)
            t0 = time.time()
            rc, wall, tail = self.call(cmd, item.env, item.id)
            fields = {"cmd": _shell(cmd, item.env), "rc": rc, "wall_s": wall}
            run_dir = self.run_dir(run_name(fam, item))
            note = self.finished_note(fam, item, run_dir, rc, t0)
            if note:
                fields["note"] = note
            elif rc != 0:
                return self.record(item, _failed(rc), **fields, log_tail=tail)
            return self.record(item, "ok", **fields, summary=collect(run_dir, kind, t0))
        if kind in ("verify", "profile"):
            script = "verify_export.py" if kind == "verify" else "profile_step.py"
            out = self.work / f"{item.id.replace('/', '_')}.json"
            cmd = [sys.executable, str(ROOT / "bench" / script), "--out", str(out)]
            cmd += self.stage_cmd(fam, item, "train", model)[3:]  # the same --config/--model/--run/--set
            rc, wall, tail = self.call(cmd, item.env, item.id)
            fields = {"cmd": _shell(cmd, item.env), "rc": rc, "wall_s": wall}
            if rc != 0 or not out.exists():
                return self.record(item, _failed(rc), **fields, log_tail=tail)
            return self.record(item, "ok", **fields, summary=json.loads(out.read_text()))
        if kind == "pytest":
            cmd = [sys.executable, "-m", "pytest", "-q", "-x", "--cuda-only", str(ROOT / "tests")]  # those that need CUDA
            rc, wall, tail = self.call(cmd, {}, item.id)
            log = (self.work / "logs" / f"{item.id.replace('/', '_')}.log").read_text()
            return self.record(item, "ok" if rc == 0 else "failed", cmd=" ".join(cmd[1:]), rc=rc, wall_s=wall,
                               summary={"last_line": log.strip().splitlines()[-1] if log.strip() else ""})
        raise ValueError(kind)

    def wanted(self, item: Item) -> bool:
        """Not measured by an earlier call (--skip-done) and selected by --only."""
        return item.id not in self.done and (not self.args.only or any(fnmatch.fnmatch(item.id, p) for p in self.args.only))

    def order(self, fam: str, items: list[Item]) -> list[Item]:
        """The items this call runs, in plan order, except that an export or verify whose run has no adapter
        on this machine (its train measured by an earlier call, on a machine since given back) moves to just
        after this call's first train of the same run (else of any run: it then exports from that run), and
        exports (and checks) that adapter: the LoRA's keys depend on neither the base's precision, the
        resolution nor the batch, and the rerun of its own train that `ensure_upstream` would make
        otherwise costs a whole train item (60-95 s at full size)."""
        todo = [it for it in items if self.wanted(it)]
        moved: dict[str, int] = {}  # train id -> items moved behind it so far
        for item in list(todo):
            if item.kind not in ("export", "verify") or stage_manifest(self.run_dir(run_name(fam, item)), "train").exists():
                continue
            if any(it.id == item.sibling("train") for it in todo):
                continue  # its own train runs in this call
            pos = todo.index(item)
            trains = [it for it in todo[pos + 1:] if it.kind == "train"]
            later = next((it for it in trains if run_name(fam, it) == run_name(fam, item)), trains[0] if trains else None)
            if later is None:
                continue  # no train in this call: ensure_upstream reruns its own
            todo[pos] = replace(item, res=later.res, run=run_name(fam, later), controls=later.controls)  # that run's
            todo.insert(todo.index(later) + 1 + moved.get(later.id, 0), todo.pop(pos))
            moved[later.id] = moved.get(later.id, 0) + 1
            self.notes[item.id] = (f"the adapter of {later.id}, trained just before in this call ({item.sibling('train')} "
                                   f"was measured by an earlier call, on another machine)")
        return todo

    def run_family(self, fam: str) -> None:
        items = plan(fam)
        for item in self.order(fam, items):
            build_s = self.build_seconds(fam, item.kind) if item.kind != "pytest" else 0.0
            need = (item.est_s + build_s) * (0.05 if self.args.tiny else 1.0)
            if self.left() < need:
                self.record(item, "skipped", reason=f"device-time budget: {self.left():.0f}s left, needs ~{item.est_s:.0f}s")
                continue
            try:
                if item.kind in ("train", "export", "verify", "profile"):
                    self.ensure_caches(fam, item, items)
                    self.ensure_upstream(fam, item, items)
                self.execute(fam, item)
            except Exception as e:  # noqa: BLE001 - one broken item must not lose the others' numbers
                self.record(item, "failed", reason=f"{type(e).__name__}: {e}")
        if not self.args.keep:
            shutil.rmtree(model_dir(self.args, fam), ignore_errors=True)


def build(fam: str, folder: Path, counts_file: Path, tiny: bool, components: list[str]) -> None:
    from bench.full_configs import build_full_pipeline

    counts: dict[str, float] = {}
    if components:  # a staged build: these modules only (bench/staged.py)
        from bench.staged import build_components

        counts = build_components(fam, folder, components, tiny)
    elif tiny:
        from stages.families import demo_variant
        from stages.tiny.models import build_tiny_pipeline

        build_tiny_pipeline(demo_variant(fam), folder, seed=0)
    else:
        counts = build_full_pipeline(fam, folder, device="cuda")
    counts_file.write_text(json.dumps(counts))


def run_name(fam: str, item: Item) -> str:
    return item.run or f"bench-{fam}-{item.res}"


def stage_manifest(run_dir: Path, kind: str) -> Path:
    """The manifest a stage of item `kind` (encode, latents, train, export) writes last in its run's folder."""
    if kind == "train":
        return adapter_folder(run_dir) / "final" / "manifest.json"
    if kind == "export":
        return adapter_folder(run_dir, "export") / "manifest.json"
    return run_dir / {"encode": "captions.zarr", "latents": "latents.zarr"}[kind] / "manifest.json"


def adapter_folder(run_dir: Path, name: str = "lora") -> Path:
    """The run's lora/ (or export/) folder, or for a two-expert family's run the one of the expert its config
    trains (lora/<expert>/: the bench trains one expert, `Runner.base_sets`)."""
    try:
        expert = json.loads((run_dir / "config.json").read_text()).get("train", {}).get("expert", "")
    except (OSError, ValueError):
        expert = ""
    return run_dir / name / expert if expert and expert != "both" else run_dir / name


def finished_before_kill(run_dir: Path, kind: str, since: float, steps: int) -> bool:
    """A train stage that wrote its complete final manifest in this call, then was killed while its process
    was exiting (a Kontext bf16 side-by-side row: "train done in 65.7 s", then the budget's
    kill): its row is read from that manifest, with a note."""
    final = stage_manifest(run_dir, "train")
    if kind != "train" or not final.exists() or final.stat().st_mtime < since:
        return False
    manifest = json.loads(final.read_text())
    return manifest.get("complete") is True and manifest.get("step") == steps


KILLED_AFTER_MANIFEST = "the process ended with rc {rc} (-9: the budget's timeout killed it) after it had written its " \
                        "final manifest for all {steps} steps: the row is read from that manifest"


KILLED_FROM_OUTSIDE = 137  # SIGKILL before the budget's deadline: the kernel's OOM killer, as a rule


def _failed(rc: int) -> str:
    if rc == KILLED_FROM_OUTSIDE:
        return "killed (SIGKILL before the budget's deadline: out of host memory?)"
    return "cut off (budget)" if rc == -9 else "failed"


def _shell(cmd: list[str], env: dict[str, str]) -> str:
    pre = " ".join(f"{k}={v}" for k, v in env.items())
    args = [Path(c).name if c == sys.executable else c for c in cmd]
    args = ["python" if a.startswith("python") else a for a in args]
    return (pre + " " if pre else "") + " ".join(str(a).replace(str(ROOT) + "/", "") for a in args)


CLIP_FRAMES = 81  # the longest clip a video row trains (suites.video_grid: 33 and 81 frames)


def make_clips(folder: Path, n: int, frames: int, size: tuple[int, int]) -> Path:
    """n clips, each a folder of `frames` PNG frames (the GPU machine has no video encoder): a colour field with a
    disc moving across it, and a caption per clip."""
    import numpy as np
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w] / max(w, h)
    for i in range(n):
        clip = folder / f"clip_{i:03d}"
        clip.mkdir(exist_ok=True)
        base, fill = rng.uniform(0, 255, 3), tuple(int(v) for v in rng.uniform(0, 255, 3))
        field = np.stack([base[c] * (0.5 + 0.5 * np.sin(6 * xx * (c + 1) + 4 * yy + i)) for c in range(3)], -1)
        background = Image.fromarray(field.clip(0, 255).astype("uint8"))
        r = h // 5
        for k in range(frames):
            frame = background.copy()
            cx = r + (w - 2 * r) * k / max(1, frames - 1)
            ImageDraw.Draw(frame).ellipse((cx - r, h // 2 - r, cx + r, h // 2 + r), fill=fill)
            frame.save(clip / f"{k:04d}.png", compress_level=1)
        (folder / f"clip_{i:03d}.txt").write_text(f"a disc moving right across a colour field, clip {i}")
    return folder


def make_dataset(folder: Path, n: int, side: int, controls: int = 0, varied: bool = False) -> Path:
    """n synthetic images (smooth colour fields with a shape) and ~77-token captions; with `controls`,
    that many control images per item beside each (img_XXX_control.png, or _control_1.png, _2, ...: the
    target with its colour channels rotated), for the edit families. `varied`: caption i has 4 + 2i words of
    that text instead, so every caption has its own length, as in a real dataset (and every length is a batch
    shape in the families that cut captions to the batch's longest)."""
    import numpy as np
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = ("a photograph of a {c} {s} on a {b} background, soft studio light, shallow depth of field, "
             "high detail, 35mm film grain, centered composition, muted palette, gentle shadows, "
             "a quiet morning scene with a wooden table, linen cloth, ceramic cup and a small plant")
    colours, shapes, backs = ["red", "blue", "green", "amber"], ["circle", "square", "triangle", "star"], ["white", "grey"]
    yy, xx = np.mgrid[0:side, 0:side] / side
    for i in range(n):
        base = rng.uniform(0, 255, 3)
        img = np.stack([base[c] * (0.5 + 0.5 * np.sin(6 * xx * (c + 1) + 4 * yy + i)) for c in range(3)], -1)
        im = Image.fromarray(img.clip(0, 255).astype("uint8"))
        r = side // 4
        ImageDraw.Draw(im).ellipse((side // 2 - r, side // 2 - r, side // 2 + r, side // 2 + r),
                                   fill=tuple(int(v) for v in rng.uniform(0, 255, 3)))
        im.save(folder / f"img_{i:03d}.png")
        for k in range(1, controls + 1):
            suffix = "_control" if controls == 1 else f"_control_{k}"
            Image.fromarray(np.roll(np.asarray(im), k, axis=-1)).save(folder / f"img_{i:03d}{suffix}.png")
        caption = words.format(c=colours[i % 4], s=shapes[(i // 4) % 4], b=backs[i % 2]) + f", variant {i}"
        if varied:  # 4 + 2i words, under the bench's 77 tokens for 24 images
            caption = " ".join((caption.split() * 2)[:4 + 2 * i])
        (folder / f"img_{i:03d}.txt").write_text(caption)
    return folder


def events_since(run_dir: Path, since: float) -> list[dict[str, Any]]:
    """The events a stage call started at `since` wrote to the run's events.jsonl (none where there is no file);
    a line that is not a JSON object, such as one a killed stage left half-written, is passed over."""
    path = run_dir / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and float(event.get("ts") or 0.0) >= since - 1:
            events.append(event)
    return events


def collect(run_dir: Path, kind: str, since: float) -> dict[str, Any]:
    """What one stage call produced: its manifest's timings and memory, and (train) its step events and the
    profile.json this call wrote (runtime.profile_steps)."""
    m = json.loads(stage_manifest(run_dir, kind).read_text())
    keep = ("seconds", "peak_vram_gb", "samples_per_second", "loss_first", "loss_last", "precision", "compiled",
            "runtime", "step", "encoded_this_run", "files", "tensors", "verified", "verify", "checks", "fields", "latent_shapes")
    out = {k: m[k] for k in keep if k in m}
    mine = [e for e in events_since(run_dir, since) if e.get("stage") == {"encode": "encode-captions", "latents":
            "cache-latents", "train": "train", "export": "export-lora"}[kind]]
    out["warnings"] = [e["message"] for e in mine if e["event"] == "warning"][:8]
    out["loaded_s"] = [e.get("seconds") for e in mine if e["event"] == "loaded"]
    if kind == "train":
        steps = [e for e in mine if e["event"] == "step"]
        out["steps"] = [{"step": e["step"], "ts": e["ts"], "loss": e["loss"], "peak": e.get("peak_vram_gb")} for e in steps]
        profile = adapter_folder(run_dir) / "profile.json"  # runtime.profile_steps, written by this call
        if profile.exists() and profile.stat().st_mtime >= since:
            out["profile"] = json.loads(profile.read_text())
    return out


def run_args(make_parser: Callable[[], argparse.ArgumentParser] | None = None, **overrides: Any) -> argparse.Namespace:
    """`run`'s arguments as `make_parser` (default: this script's; bench/memory.py's `parser` for a
    MemoryRunner) gives them, defaults and no --out (""), then `overrides`: for the code that drives a
    runner without the command line (bench/peers.py, `bench/memory.py plan`, the tests)."""
    args = (make_parser or parser)().parse_args(["run", "--out", ""])
    for key, value in overrides.items():
        if not hasattr(args, key):
            raise TypeError(f"`run` has no argument {key!r}")
        setattr(args, key, value)
    return args


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="build, run the stages, write results JSON")
    r.add_argument("--out", required=True)
    r.add_argument("--families", default="", help="comma list (default: every registered family, FLUX first)")
    r.add_argument("--work", default="/tmp/lorapipe-bench")
    r.add_argument("--models", default="", help="where the pipelines go (default /dev/shm if it has room)")
    r.add_argument("--budget-s", type=float, default=1e9, help="stop starting items after this many seconds")
    r.add_argument("--skip-done", action="append", default=[], help="results JSON of an earlier call: skip its ok items "
                   "(repeatable)")
    r.add_argument("--only", action="append", default=[], help="run only the items whose id matches this glob, "
                   "e.g. '*/train/nf4-*-compile' (repeatable; caches they need are built anyway)")
    r.add_argument("--tiny", action="store_true", help="tiny models on CPU (plumbing check)")
    r.add_argument("--keep", action="store_true", help="keep the model folder afterwards")
    r.add_argument("--staged", action="store_true", help="build every family's folder one stage's components at a "
                   "time, as the families whose full size the host cannot hold (full.py STAGED) always are")
    b = sub.add_parser("build", help="build one family's pipeline (run by `run` as a child process)")
    b.add_argument("--family", required=True)
    b.add_argument("--folder", required=True)
    b.add_argument("--counts", required=True)
    b.add_argument("--tiny", action="store_true")
    b.add_argument("--components", default="", help="comma list of modules to build into the folder (a staged "
                   "build: model_index.json and the weightless parts are written too; nothing else is built)")
    p = sub.add_parser("report", help="results JSON files -> bench/RESULTS.md and bench/APPENDIX.md")
    p.add_argument("files", nargs="*", help="default: every file under bench/results (bench/report.py result_files)")
    p.add_argument("--write", default="", help="write the report there (and APPENDIX.md beside it) instead of printing it")
    p.add_argument("--docs", default="", help="rewrite the per-family train tables of this docs/performance.md in place "
                   "from the latest results instead")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.cmd == "build":
        build(args.family, Path(args.folder), Path(args.counts), args.tiny, [c for c in args.components.split(",") if c])
        return
    if args.cmd == "report":
        from bench.report import APPENDIX, result_files, sync_performance_doc, write_report

        files = [Path(f) for f in args.files] or result_files()
        if args.docs:
            doc = Path(args.docs)
            doc.write_text(sync_performance_doc(doc.read_text(), files))
            return
        docs = write_report(files)
        if args.write:
            Path(args.write).write_text(docs["RESULTS.md"])
            Path(args.write).with_name(APPENDIX).write_text(docs[APPENDIX])
        else:
            print(docs["RESULTS.md"])
        return
    from stages.families import FAMILIES

    families = [f for f in args.families.split(",") if f] or ["flux"] + sorted(set(FAMILIES) - {"flux"})
    runner = Runner(args)
    for fam in families:
        runner.run_family(fam)
    runner.save()


if __name__ == "__main__":
    main()
