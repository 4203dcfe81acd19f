"""The benchmark's suites, as data: name -> rows, each row the arguments a bench script already takes.

    python bench/run.py --list                 # every suite, its rows and the command each runs
    bash bench/device.sh flux memory           # on the GPU machine (wheels installed first)

A row's `key` names its result file, bench/results/<suite>/<key>.json, which a newer run of the row
overwrites; bench/report.py shows, per key, the latest measurement. Kinds of row:

- `Bench`: one item of `bench/bench.py run` (`--families F --only F/<item>`): a train row is a family x
  precision x px x batch cell, unconstrained (no budget), with an optional settings tag ("compile": the
  item that forced `runtime.compile_transformer = on`, which `auto` does today); cache, export, verify and
  profile rows are the same family's other stage items.
- `Memory`: `bench/memory.py run --families F --res PX --budgets B [--set K=V]`: every stage under a
  budget (GB, or "auto": no cap).
- `Peers`: `bash bench/peers.sh WHICH PX BATCH STEPS` with PEERS_PRODUCT: diffusers' script (musubi-tuner for
  `wan14b`) beside the product's rows.
- `Script`: any other bench script whose result a doc cites; "{out}" in its arguments is the result file.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product


@dataclass(frozen=True)
class Bench:
    family: str
    item: str  # the item id after "<family>/": "train/nf4-512-b1", "encode/nf4", "latents/512", "verify/nf4-512-b1"

    @property
    def key(self) -> str:
        return bench_key(f"{self.family}/{self.item}")


@dataclass(frozen=True)
class Memory:
    family: str
    px: int
    budget: str  # GB, or "auto"
    sets: tuple[str, ...] = ()  # "KEY=VALUE" overrides of every stage (a variant with its own report table)
    captions: str = "equal"  # memory.py --captions: "varied" gives every caption its own length

    @property
    def key(self) -> str:
        return memory_key(self.family, self.px, self.budget, self.sets, self.captions)


@dataclass(frozen=True)
class Peers:
    which: str  # klein | kontext | ideogram (bench/peers.sh)
    px: int
    batch: int
    steps: int
    product: str  # PEERS_PRODUCT: the product's rows, e.g. "nf4,nf4+cudnn+fitreserved"

    @property
    def key(self) -> str:
        # file names of plain characters: the GPU machine's results do not come back under names with "+"
        return f"peers.{self.which}-{self.px}-b{self.batch}-{self.product.replace(',', '_').replace('+', '-')}"


@dataclass(frozen=True)
class Script:
    name: str  # the key
    args: tuple[str, ...]  # after `python3`; "{out}" is the result file
    gpus: int = 1

    @property
    def key(self) -> str:
        return self.name


Row = Bench | Memory | Peers | Script


def bench_key(item_id: str) -> str:
    """A bench item's result key: its id ("flux/train/nf4-512-b1-compile": family, stage, precision, px,
    batch, settings) with dots for slashes; a cache rerun ("...#rerun") keys as its item."""
    return item_id.split("#")[0].replace("/", ".")


def memory_key(family: str, px: int, budget: str, sets: tuple[str, ...] | list[str] = (), captions: str = "equal") -> str:
    """A memory row's result key: family, px, budget, its `--set` overrides and its captions where not "equal"."""
    settings = "".join(f"-{s.replace('=', '_')}" for s in sorted(sets))
    captions = "" if captions == "equal" else f"-{captions}-captions"
    return (f"memory.{family}-{px}-{budget if budget != '-' else 'build'}{'' if budget in ('auto', '-') else 'gb'}"
            f"{settings}{captions}")


def train(family: str, precision: str, px: int, batch: int, settings: str = "") -> Bench:
    return Bench(family, f"train/{precision}-{px}-b{batch}" + (f"-{settings}" if settings else ""))


def grid(family: str, precisions: tuple[str, ...], pxs: tuple[int, ...] = (512, 1024), batches: tuple[int, ...] = (1, 4),
         settings: dict[tuple[str, int, int], str] | None = None) -> list[Bench]:
    """Train rows for every precision x px x batch; `settings` tags some cells (the item docs cite)."""
    return [train(family, p, px, b, (settings or {}).get((p, px, b), "")) for p, px, b in product(precisions, pxs, batches)]


def stages(family: str, *items: str) -> list[Bench]:
    return [Bench(family, it) for it in items]


ALL = ("nf4", "fp8", "bf16")
# The nf4 rows forced to compile before `auto` compiled nf4: docs/performance.md cites these items
COMPILED = {"flux": {("nf4", 512, 1): "compile", ("nf4", 512, 4): "compile"},
            "qwen-image": {("nf4", 512, 1): "compile"},
            "z-image": {("nf4", 512, 4): "compile"},
            "sdxl": {("nf4", 512, 1): "compile", ("nf4", 512, 4): "compile"}}


def measured_family(family: str, encode: tuple[str, ...], export: str = "nf4-512-b1") -> list[Row]:
    """FLUX.1, Qwen-Image, Z-Image, SDXL: caches, every precision at every shape, export and its load check."""
    return [*stages(family, *encode, "latents/512", "latents/1024"),
            *grid(family, ALL, settings=COMPILED[family]),
            *stages(family, f"export/{export}", f"verify/{export}")]


def short_family(family: str, precisions: tuple[str, ...] = ("nf4", "bf16"), refs: bool = False) -> list[Row]:
    """A newer or edit family: caches, its precisions at every shape, fp8 at 1024 px batch 1 and 4 (where fp8 is
    not among them), export and load check."""
    latents = ("latents/512", "latents/1024") + (("latents/512-ref1",) if refs else ())
    fp8 = [] if "fp8" in precisions else [train(family, "fp8", 1024, 1), train(family, "fp8", 1024, 4)]
    return [*stages(family, "encode/nf4", *latents), *grid(family, precisions), *fp8,
            *stages(family, "export/nf4-512-b1", "verify/nf4-512-b1")]


def memory_grid(family: str, px: int, budgets: tuple[str, ...], sets: tuple[str, ...] = ()) -> list[Memory]:
    return [Memory(family, px, b, sets) for b in budgets]


def video_grid(family: str, clips: tuple[tuple[int, int], ...], precisions: tuple[str, ...]) -> list[Memory]:
    """A video family's rows: per (px, frames), each base precision with no cap, then the whole plan at 24 GB."""
    return [Memory(family, px, budget, (f"data.frames={frames}", *sets)) for px, frames in clips
            for budget, sets in [*(("auto", (f"train.base_precision={p}",)) for p in precisions), ("24", ())]]


PARTIAL_CKPT = ("runtime.gradient_checkpointing=auto",)

# Every family's preset (its full.py PRESET; tests/bench/test_bench_suites.py holds them equal), most-used first: the
# budget grid runs in this order, so a device call cut short has measured the most useful rows.
PRESETS = {"flux": "configs/flux-dev.toml", "qwen-image": "configs/qwen-image.toml", "z-image": "configs/z-image.toml",
           "flux2-klein": "configs/flux2-klein.toml", "sdxl": "configs/sdxl.toml", "chroma": "configs/chroma.toml",
           "krea2": "configs/krea2.toml",
           "qwen-image-2.1": "configs/qwen-image-2.1.toml", "flux-kontext": "configs/flux-kontext.toml",
           "qwen-image-edit": "configs/qwen-image-edit.toml", "flux2": "configs/flux2.toml",
           "qwen-image-edit-2511": "configs/qwen-image-edit-2511.toml", "ernie-image": "configs/ernie-image.toml",
           "hidream-i1": "configs/hidream-i1.toml",
           "ideogram4": "configs/ideogram4.toml",
           "wan2.2-5b": "configs/wan2.2-5b.toml",
           "wan2.2-14b": "configs/wan2.2-14b.toml",
           "ltx2": "configs/ltx2.toml"}
GRID_BUDGETS = ("4", "6", "8", "12", "16", "24", "auto")


def preset_captions(family: str) -> dict[str, object]:
    """The [captions] table of the family's preset (what a user's run encodes with)."""
    import tomllib
    from pathlib import Path

    return tomllib.loads((Path(__file__).resolve().parent.parent / PRESETS[family]).read_text()).get("captions", {})


def budget_grid(family: str) -> list[Memory]:
    """The preset as a user runs it (its caption length, caption batch and text-encoder precision) under every
    budget, at the preset's caption length and at 77 tokens (or the family's shortest), train batch 1 and 4, 1024 and 512 px; the
    preset's length, batch 1 and 1024 px first. Each call is one (length, px, batch): bench/memory.py measures
    every stage under each budget there, predicted / allocated / reserved / with the CUDA context."""
    captions = preset_captions(family)
    fixed = tuple(f"captions.{k}={captions[k]}" for k in ("batch_size", "text_encoder_precision") if k in captions)
    from bench.bench import caption_tokens

    short = caption_tokens(family)
    lengths = list(dict.fromkeys((int(captions.get("max_sequence_length", short)), short)))
    return [Memory(family, px, b, (*fixed, f"captions.max_sequence_length={n}", f"train.batch_size={batch}"))
            for n, batch, px in product(lengths, (1, 4), (1024, 512)) for b in GRID_BUDGETS]


SUITES: dict[str, list[Row]] = {
    # one train table per family (docs/performance.md, "Train speed by family")
    "flux": measured_family("flux", ("encode/nf4", "encode/bf16"), export="nf4-512-b4"),
    "qwen-image": measured_family("qwen-image", ("encode/nf4",)),
    "z-image": measured_family("z-image", ("encode/nf4",)),
    "sdxl": measured_family("sdxl", ("encode/bf16",)),
    "flux2-klein": short_family("flux2-klein", refs=True),
    "flux2": short_family("flux2", refs=True),
    "krea2": short_family("krea2"),
    "qwen-image-2.1": short_family("qwen-image-2.1"),
    "flux-kontext": short_family("flux-kontext"),
    "qwen-image-edit": short_family("qwen-image-edit"),
    "qwen-image-edit-2511": [*short_family("qwen-image-edit-2511"), *memory_grid("qwen-image-edit-2511", 1024, ("16",))],
    "chroma": [*short_family("chroma"), *memory_grid("chroma", 1024, ("16",))],
    "ernie-image": [*short_family("ernie-image", ALL), *memory_grid("ernie-image", 1024, ("16",))],
    # HiDream-I1: every base at 1024 px (the size it renders at), the nf4 512 px run its export check reads, 16 GB
    "hidream-i1": [*stages("hidream-i1", "encode/nf4", "latents/512", "latents/1024"), train("hidream-i1", "nf4", 512, 1),
                   *grid("hidream-i1", ALL, pxs=(1024,)), *stages("hidream-i1", "export/nf4-512-b1", "verify/nf4-512-b1"),
                   *memory_grid("hidream-i1", 1024, ("16",))],
    "ideogram4": [*stages("ideogram4", "encode/nf4", "latents/1024"), *grid("ideogram4", ALL, pxs=(1024,)),
                  *stages("ideogram4", "train/nf4-512-b1", "export/nf4-512-b1", "verify/nf4-512-b1"),
                  *memory_grid("ideogram4", 1024, ("16",))],
    # Wan 2.2 TI2V-5B: every stage's peak and train s/step at 480p (resolution 640) and 720p (960), 33 and 81 frames,
    # nf4 and fp8 bases unconstrained, and each clip size under a 24 GB cap (the plan picks precision and swap)
    "wan2.2-5b": video_grid("wan2.2-5b", ((640, 33), (640, 81), (960, 33), (960, 81)), ("nf4", "fp8")),
    # Wan 2.2 T2V-A14B (the high-noise expert, which the bench trains: Runner.base_sets; the low-noise one is the same size): as wan2.2-5b's rows
    "wan2.2-14b": video_grid("wan2.2-14b", ((640, 33), (640, 81), (960, 33), (960, 81)), ("nf4", "fp8")),
    # LTX-2 (video stream): the same grid
    "ltx2": video_grid("ltx2", ((640, 33), (640, 81), (960, 33), (960, 81)), ("nf4", "fp8")),
    # "Memory budgets": every stage under each budget, 1024 px, then the 512 px rows
    "memory": [*memory_grid("flux", 1024, ("auto", "6", "8", "12")),
               *memory_grid("flux", 1024, ("16", "24"), PARTIAL_CKPT),
               *memory_grid("qwen-image", 1024, ("auto", "8", "16")),
               *memory_grid("z-image", 1024, ("auto", "4", "8")),
               *memory_grid("sdxl", 1024, ("auto", "4"))],
    "memory-512": [*memory_grid("flux", 512, ("auto", "6", "8")), *memory_grid("qwen-image", 512, ("auto", "8")),
                   *memory_grid("z-image", 512, ("auto", "4")), *memory_grid("sdxl", 512, ("auto", "4", "8"))],
    # where a 512 px step under block swap spends its time (0.53-0.54x the uncapped step): torch.profiler over two
    # steps after the warm-up gives the GPU kernels' and the host-to-device copies' milliseconds beside the step's
    "swap-512-profile": [*memory_grid("flux", 512, ("6",), ("runtime.profile_steps=2",)),
                         *memory_grid("qwen-image", 512, ("8",), ("runtime.profile_steps=2",))],
    # a dataset whose captions each have their own length (every length a batch shape where the family cuts captions
    # to the batch's longest, and past 8 shapes steps run without CUDA graphs) against one of about one length, over
    # two epochs of its 24 images: Qwen-Image at 1024 px under its 8 GB swap plan and uncapped; then the varied
    # captions rounded up to 64 tokens (runtime.caption_tokens_multiple: masked padding, fewer shapes)
    "caption-lengths": [Memory("qwen-image", 1024, b, ("train.steps=48",), c) for c in ("varied", "equal") for b in ("8", "auto")]
                       + [Memory("qwen-image", 1024, b, ("train.steps=48", "runtime.caption_tokens_multiple=64"), "varied")
                          for b in ("8", "auto")],
    # "Memory budgets that hold": every preset x budget x caption length x train batch x px, most-used presets first;
    # tests/planner/test_budget.py holds the planner's predictions against these rows
    "budget-grid": [row for family in PRESETS for row in budget_grid(family)],
    # "Side by side with diffusers' own scripts": one call each (the script's row, then the product's)
    "peers-klein": [Peers("klein", 1024, 1, 15, "nf4,nf4+fitpeer,nf4+cudnn+fitpeer"),
                    Peers("klein", 1024, 1, 15, "nf4+cudnn+fitreserved,fp8+cudnn+fitreserved"),
                    Peers("klein", 1024, 1, 15, "fp8+cudnn+fp8blocks18")],
    "peers-kontext": [Peers("kontext", 1024, 1, 10, "fp8+fitpeer,fp8,nf4"),
                      Peers("kontext", 1024, 1, 10, "fp8+cudnn,fp8+cudnn+keepattn,fp8+cudnn+fitpeer+keepattn")],
    "peers-ideogram4": [Peers("ideogram", 1024, 1, 15, "nf4,nf4+fitpeer,fp8+fitpeer")],
    # Wan 2.2 T2V-A14B's high-noise expert beside musubi-tuner (bench/peers_video.py), 832x480, 33 frames: one product
    # train per call (a 14B train row, the peer and the caches fill one call); the build is skipped on a warm machine
    "peers-wan2.2-14b": [Peers("wan14b", 640, 1, 10, "bf16"), Peers("wan14b", 640, 1, 10, "bf16+fitpeer"),
                         Peers("wan14b", 640, 1, 10, "fp8+fitpeer")],
    # "Optimizers": each train.optimizer's step time and peak (its state), FLUX.1 bf16 1024 px b1; AdamW's row
    # is the flux suite's flux.train.bf16-1024-b1
    "optimizers": [train("flux", "bf16", 1024, 1, f"opt-{name}") for name in
                   ("adamw8bit", "prodigy", "prodigy_schedulefree", "adamw_schedulefree", "adafactor")],
    # "fp8 against bf16": the loss over 50 steps from one LoRA
    "fp8-fidelity": [Script("fp8-fidelity50", ("bench/fp8.py", "--fidelity-only", "--fidelity-steps", "50",
                                               "--deadline", "480", "--out", "{out}"))],
    # "Several GPUs" (the 2-GPU machine)
    "multigpu": [Script("multigpu-flux-bf16", ("bench/multigpu.py", "run", "--out", "{out}"), gpus=2),
                 Script("multigpu-flux-nf4", ("bench/multigpu.py", "run", "--precisions", "nf4", "--out", "{out}"), gpus=2)],
    # the tiled VAE encode against untiled, every distinct VAE (cache-latents' last resort)
    "tiling": [Script("tiling", ("bench/tiling.py", "--budget-s", "140", "--out", "{out}"))],
    # the same for the video VAEs, on 33-frame clips at 640 and 960 px (about 480p and 720p in pixels)
    "tiling-video": [Script("tiling-video", ("bench/tiling.py", "--families", "wan2.2-5b,wan2.2-14b,ltx2", "--sizes",
                                             "640,960", "--frames", "33", "--budget-s", "240", "--out", "{out}"))],
    # cache-latents with the full-size FLUX.1 VAE at 1024 px: images/s, encoder and GPU busy (docs/performance.md, scale)
    "scale-gpu": [Script("scale-gpu-flux-vae-1024", ("bench/scale.py", "--gpu-latents", "400", "--px", "1024",
                                                      "--device", "cuda", "--work", "/tmp/lorapipe-scale-gpu", "--out", "{out}")),
                  # status and a no-op run on a GPU machine, where torch would be imported to see the GPU
                  Script("scale-gpu-status-1000", ("bench/scale.py", "--sizes", "1000", "--device", "cuda", "--work",
                                                   "/tmp/lorapipe-scale-status", "--out", "{out}"))],
    # the tests that need a CUDA GPU (skipped on the CPU; conftest's --cuda-only selects them), in two calls' worth:
    # the trainer's paths (compile, graphs, fp8, swap), then the rest
    "cuda-tests": [Script("cuda-tests-trainer", ("-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--cuda-only",
                                                 "tests/stages/test_trainer_paths.py")),
                   Script("cuda-tests", ("-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--cuda-only", "tests/",
                                         "--ignore=tests/stages/test_trainer_paths.py"))],
}
