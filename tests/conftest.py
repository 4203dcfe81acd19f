"""Shared fixtures: tiny real-architecture pipelines, the drawn-shapes dataset, built runs.

Every family test is parametrized over FAMILIES, read from the registry (`stages.families`): a
family joins the suite by registering itself and shipping its demo config. A test of wiring that
is the same for every family runs once, on ONE_FAMILY's run (`@once`), instead of skipping the rest.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Tests live by layer (core/, planner/, stages/, families/, e2e/, bench/); a few share a helper across
# layers (`from test_memory import _plan`), so every layer's folder is importable wherever a file runs.
sys.path[1:1] = [str(p) for p in sorted(Path(__file__).parent.iterdir()) if p.is_dir() and p.name[0] not in "._"]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LORAPIPE_PLAIN", "1")
# One torch/OpenMP thread per test process (children inherit it): `make test` runs two pytest-xdist
# workers on two cores, and the tiny models gain nothing from more threads, while two workers of
# two spinning OpenMP threads each on two cores cost several times the CPU. Export it to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # a plugin imported torch before this file: the variable came too late
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from stages.families import FAMILIES as REGISTRY, demo_variant  # noqa: E402 - after sys.path

# family -> tiny variant built for it
FAMILIES: dict[str, str] = {name: demo_variant(name) for name in REGISTRY}
ONE_FAMILY = next(iter(FAMILIES))
ONCE = "session"  # pytest's scope of a fixture built once for the whole test run
once = pytest.mark.parametrize("built_run", [ONE_FAMILY], indirect=True)
"""For family-independent wiring (CLI paths, signals): the test runs on one family's built run."""


# ---- how `make test` (pytest-xdist, --dist loadfile) hands the files to its workers -------------------------
#
# Every worker builds its own `built_run` of each family it meets (5-10 s of CPU each) and two workers that
# both meet all ten build all ten twice. So a file's tests are split by family, and a worker takes the files,
# or the parts of them, of its own half of the families (FAMILIES in sorted order, dealt out in turn), or
# those naming no family, before another's; with none left it takes another's (and builds what that needs).
# ONE_FAMILY counts as no family: the `@once` tests of many files run on it, too many for one worker.
# Of what it may take, it takes the longest first, so that no long file starts last: SLOW_FILES (seconds
# on a 2-core machine, --durations), then its own half's parts (the others' would cost builds), then
# xdist's order (most tests first). Where each test runs is all that changes; with one worker, or --dist
# other than loadfile, nothing does.
SLOW_FILES = ("test_family.py", "test_resume.py", "test_bench_runner.py",  # 112, 65, 48 s
              "test_inspect_sample_report.py", "test_edit_demo.py",  # 47, 45 s
              "test_e2e.py", "test_distributed.py", "test_crash.py",  # 29, 28, 23 s
              "test_kohya_verify.py", "test_bench_report.py", "test_budget.py", "test_trainer_paths.py",  # 18-21 s
              "test_bench_staged.py", "test_run_state.py")


def _family_of(nodeid: str) -> str | None:
    """The family a test's id names among its parameters ("...::test_x[qwen-image-edit]", "[flux-2]"), if any."""
    if not nodeid.endswith("]") or "[" not in nodeid:
        return None
    params = nodeid[nodeid.index("[") + 1:-1]
    named = [f for f in FAMILIES if f"-{f}-" in f"-{params}-"]
    return max(named, key=len) if named else None


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    if not all(hasattr(LoadFileScheduling, m) for m in ("_split_scope", "_assign_work_unit")):
        return None  # another xdist than 3.x's internals (pyproject pins <4): its own scheduling, same tests
    order = sorted(set(FAMILIES) - {ONE_FAMILY})

    class FamilyHalves(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file, family = super()._split_scope(nodeid), _family_of(nodeid)
            if family in (None, ONE_FAMILY) or self.numnodes < 2:
                return file
            return f"{file}::{order.index(family) % self.numnodes}"

        def _assign_work_unit(self, node) -> None:
            mine = str(int(node.gateway.id.removeprefix("gw")) % self.numnodes) if self.numnodes > 1 else None
            scopes = list(self.workqueue)
            own = [(i, s) for i, s in enumerate(scopes) if "::" not in s or s.rsplit("::", 1)[1] == mine]

            def rank(entry: tuple[int, str]) -> tuple[int, bool, int]:  # of files alike, its own half's part first
                i, scope = entry
                name = Path(scope.split("::", 1)[0]).name
                slow = SLOW_FILES.index(name) if name in SLOW_FILES else len(SLOW_FILES)
                return slow, "::" not in scope, i

            _, scope = min(own or list(enumerate(scopes)), key=rank)
            self.workqueue.move_to_end(scope, last=False)  # the unit the parent class takes
            super()._assign_work_unit(node)

    return FamilyHalves(config, log)


def demo_config_path(family: str) -> Path:
    from stages.demo import demo_config

    return demo_config(family)


@pytest.fixture(scope=ONCE)
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("assets")


@pytest.fixture(scope=ONCE)
def demo_data(assets: Path) -> Path:
    from stages.tiny.shapes import make_demo_dataset

    return make_demo_dataset(assets / "data", n=12, seed=0)


_MODELS: dict[str, Path] = {}


def tiny_model(assets: Path, variant: str) -> Path:
    if variant not in _MODELS:
        from stages.tiny.models import build_tiny_pipeline

        _MODELS[variant] = build_tiny_pipeline(variant, assets / variant, seed=0)
    return _MODELS[variant]


def trained_denoiser(cfg: Any, folder: Path) -> Any:
    """A fresh fp32 denoiser on the CPU (the expert cfg.train names, for a two-expert family) with the adapter
    train attaches for cfg, its weights loaded from `folder` (a checkpoint or lora final)."""
    from stages.core import lora
    from stages.core.model_source import model_source
    from stages.core.runtime import make_runtime
    from stages.families import get_family

    family = get_family(cfg.family)
    model = family.load_denoiser(model_source(cfg), "fp32", make_runtime("cpu", "fp32"), cfg.train)
    lora.attach_lora(model, lora.train_lora_config(cfg.train, family.default_lora_targets, dropout=0.0))
    lora.load_adapter_weights(model, folder)
    return model


def flux_with_t5(assets: Path, folder: Path, **t5: int) -> str:
    """The tiny FLUX's text encoders, T5's config changed by `t5` (d_model, d_ff, ...), as a folder of configs
    only: planning builds them on the meta device, so a planner test gets a T5 of real size for free."""
    import json

    src = tiny_model(assets, FAMILIES["flux"])
    for part in ("text_encoder", "text_encoder_2"):
        (folder / part).mkdir(parents=True)
        config = json.loads((src / part / "config.json").read_text())
        if part == "text_encoder_2":
            config.update(t5)
        (folder / part / "config.json").write_text(json.dumps(config))
    (folder / "model_index.json").write_text((src / "model_index.json").read_text())
    return str(folder)


def make_cfg(family: str, assets: Path, data: Path, root: Path, **overrides):
    """The family's demo config pointed at test assets, with dotted-key overrides."""
    from stages.core.config import load_config

    base = {"model": str(tiny_model(assets, FAMILIES[family])), "data.path": str(data),
            "artifacts": str(root), "device": "cpu"}
    base.update(overrides)
    return load_config(demo_config_path(family), base)


@pytest.fixture(scope=ONCE)
def edit_data(assets: Path) -> Path:
    """Edit pairs (control -> target: the shape turns blue) for the edit families."""
    from stages.tiny.shapes import make_edit_dataset

    return make_edit_dataset(assets / "data-edit", n=12, seed=0)


@pytest.fixture(scope=ONCE)
def clip_data(assets: Path) -> Path:
    """Moving-shape clips (mp4 and folders of frames) and two stills, for the video families."""
    from stages.tiny.shapes import make_clip_dataset

    return make_clip_dataset(assets / "data-clips", n=8, seed=0)


def family_data(family: str, request: pytest.FixtureRequest) -> Path:
    """The demo dataset the family trains on: drawn shapes, edit pairs for an edit family, clips for a video one."""
    from stages.demo import demo_data_kind

    kind = demo_data_kind(family)
    return request.getfixturevalue({"edit": "edit_data", "clips": "clip_data"}.get(kind, "demo_data"))


_RUNS: dict[str, object] = {}
BUILT_MODELS: dict[str, dict[str, set[str]]] = {}
"""family -> stage -> the diffusers/transformers model classes that stage constructed in built_run."""


@contextlib.contextmanager
def library_lines():
    """Collects what diffusers and transformers log at WARNING and above inside the block, as
    "logger: message" lines (their own handlers write to the stderr they found at import, which the
    test's capture does not see)."""
    import logging

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"{record.name}: {record.getMessage()}")

    handler, loggers = Collect(logging.WARNING), [logging.getLogger(n) for n in ("diffusers", "transformers")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield lines
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


@contextlib.contextmanager
def record_models():
    """Collects the class name of every diffusers/transformers model constructed inside the block
    (in-process, what LORAPIPE_TRACE_MODELS records for a child process)."""
    import diffusers
    import transformers

    from stages.core.runtime import library_class

    seen: set[str] = set()
    originals = {base: base.__init__ for base in (diffusers.ModelMixin, transformers.PreTrainedModel)}

    def wrap(original):
        def traced(self, *args, **kwargs):
            seen.add(library_class(self))
            original(self, *args, **kwargs)
        return traced

    for base, original in originals.items():
        base.__init__ = wrap(original)
    try:
        yield seen
    finally:
        for base, original in originals.items():
            base.__init__ = original


@pytest.fixture(scope=ONCE, params=sorted(FAMILIES))
def built_run(request: pytest.FixtureRequest, assets: Path, tmp_path_factory: pytest.TempPathFactory):
    """All four stages run in-process once per family (the demo config and data, fewer steps); the
    model classes each stage constructs go to BUILT_MODELS."""
    family = request.param
    if family not in _RUNS:
        from stages import cache_latents, encode_captions, export_lora, train

        data = family_data(family, request)
        cfg = make_cfg(family, assets, data, tmp_path_factory.mktemp(f"run-{family}"), **{"train.steps": 8, **one_adapter(family)})
        built = BUILT_MODELS.setdefault(family, {})
        for module, stage in ((encode_captions, "encode-captions"), (cache_latents, "cache-latents"),
                              (train, "train"), (export_lora, "export-lora")):
            with record_models() as seen:
                module.run(cfg)
            built[stage] = seen
        _RUNS[family] = cfg
    return _RUNS[family]


def one_adapter(family: str) -> dict[str, str]:
    """The built run trains one adapter, so every family's tests read one adapter's folders (lora_dir(cfg),
    export_dir(cfg)): a two-expert family's demo (train.expert = "both") is built for its first expert. Its
    both-expert run has its own tests (tests/families/test_family_wan22_14b.py)."""
    from stages.families import get_family

    experts = get_family(family).experts
    return {"train.expert": experts[0]} if experts else {}


def losses_and_lora(trainer, steps: int = 6):
    """`steps` optimizer steps of a set-up Trainer: their losses and its LoRA weights after them (float64, CPU)."""
    import torch

    losses = torch.tensor([trainer.step()[0] for _ in range(steps)], dtype=torch.float64)
    return losses, lora_vector(trainer)


def lora_vector(trainer):
    """A set-up Trainer's LoRA weights as one float64 CPU vector, in key order."""
    import torch

    return torch.cat([v.detach().double().flatten().cpu() for k, v in sorted(trainer.model.state_dict().items())
                      if "lora" in k])


def run_beside(built, name: str, **overrides):
    """A run folder beside `built` (a built run's config) holding copies of its caches, made by the
    same config, so a test trains at once from identical inputs without re-encoding."""
    import shutil

    from stages.core.config import load_config

    cfg = load_config(demo_config_path(built.family), {
        "model": built.model, "data.path": built.data.path, "artifacts": built.artifacts, "device": built.device,
        "run": f"{built.family}-{name}", **one_adapter(built.family), **overrides})
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    for cache in ("captions.zarr", "latents.zarr"):
        shutil.copytree(built.run_dir / cache, cfg.run_dir / cache)
    return cfg


def comfy_name(cfg) -> str:
    """The run's exported ComfyUI file name (with the family's expert tag where it has one: wan2.2-14b)."""
    from stages.core.comfyui_file import comfyui_file_name
    from stages.families import get_family

    return comfyui_file_name(cfg.run, tag=get_family(cfg.family).file_tag(cfg.train))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cuda-only", action="store_true",
                     help="run only the tests that need a CUDA GPU (those skipped elsewhere): the GPU machine's "
                          "cuda-tests suite")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if not config.getoption("--cuda-only"):
        return
    keep = [it for it in items
            if any("cuda" in str(m.kwargs.get("reason", "")).lower() for m in it.iter_markers("skipif"))]
    config.hook.pytest_deselected(items=[it for it in items if it not in keep])
    items[:] = keep
