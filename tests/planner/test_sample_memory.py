"""The sample stage's memory plan (stages/core/memory/sample.py): the whole pipeline, which is what
the sample stage loads, in bf16 on the GPU, else bf16 under model CPU offload, else the denoiser and
text encoders in nf4, else nf4 offloaded, else that with the denoiser's last blocks swapped; the first that
fits the budget. Before it, sample loaded
the pipeline in bf16 whatever the GPU: FLUX.2 dev's is 112.6 GB, Qwen-Image's 57 GB.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/planner/test_sample_memory.py

The `cuda` test renders the tiny FLUX pipeline in nf4 (the bench's CUDA tests run it on the H200).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_cfg
from stages import sample
from stages.core import memory
from stages.core.errors import ConfigError
from stages.core.events import EventLog, read_events
from stages.core.model_source import ModelSource
from stages.families import get_family

ORDER = [("bf16", False), ("bf16", True), ("nf4", False), ("nf4", True)]


def _plan(cfg, gb: float) -> memory.StagePlan:
    return memory.plan_for(cfg, get_family(cfg.family), ModelSource(cfg.model, cfg.revision), memory.Budget(gb, "cap"),
                           "sample")


def _choice(plan: memory.StagePlan) -> tuple[str, bool]:
    return plan.settings["precision"], plan.settings["cpu_offload"]


@pytest.fixture
def cfg(assets, demo_data, tmp_path, monkeypatch):
    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: None)  # this host's memory is not the plan's
    return make_cfg("flux", assets, demo_data, tmp_path, **{"sample.width": 64, "sample.height": 64})


def test_the_first_plan_that_fits_the_budget(cfg):
    tried = _plan(cfg, 1e6).tried
    assert [(t["precision"], t["cpu_offload"]) for t in tried] == ORDER
    peaks = [t["predicted_peak_gb"] for t in tried]
    assert peaks[0] == max(peaks) and peaks[3] == min(peaks) < peaks[0]
    for peak in sorted(peaks, reverse=True):
        budget = peak * memory.FRAGMENTATION * 1.001
        plan = _plan(cfg, budget)
        first = next(i for i, p in enumerate(peaks) if p * memory.FRAGMENTATION <= budget)
        assert plan.fits and _choice(plan) == ORDER[first], budget
    short = _plan(cfg, peaks[3] * memory.FRAGMENTATION * 0.9)
    assert not short.fits and short.predicted_peak_gb == min(peaks) and short.settings["cpu_offload"]
    assert "even the smallest sample plan needs" in short.note and "sample.width and sample.height" in short.note


def test_a_configured_precision_or_offload_is_kept(cfg):
    import dataclasses

    def with_sample(**kw):
        return dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample, **kw))

    tiny = 1e-9  # fits nothing: the smallest of the allowed plans comes back
    assert [(t["precision"], t["cpu_offload"]) for t in _plan(with_sample(precision="bf16"), tiny).tried] == ORDER[:2]
    assert [(t["precision"], t["cpu_offload"]) for t in _plan(with_sample(cpu_offload=True), 1e6).tried] == \
        [ORDER[1], ORDER[3]]
    assert _choice(_plan(with_sample(precision="fp32"), 1e6)) == ("fp32", False)


def test_bf16_offload_is_left_out_where_the_host_cannot_hold_it(cfg, monkeypatch):
    """An offloaded pipeline lives in host memory; one on the GPU whole is read there shard by shard."""
    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: 1000)
    plan = _plan(cfg, 1e6)
    assert _choice(plan) == ("bf16", False)
    assert [(t["precision"], t["cpu_offload"]) for t in plan.tried] == [ORDER[0], ORDER[2], ORDER[3]]
    assert plan.note.startswith("bf16 offloaded left out: its ") and "of host memory available" in plan.note


def test_the_stage_loads_as_planned(cfg, monkeypatch):
    """On a GPU budget (simulated) that bf16 does not fit whole, with a host that cannot hold it offloaded,
    load_pipeline asks for nf4: on this CPU that is the clear refusal, which shows the plan reached the load."""
    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: 1000)
    peaks = {(t["precision"], t["cpu_offload"]): t["predicted_peak_gb"] for t in _plan(cfg, 1e6).tried}
    budget = peaks[("nf4", False)] * memory.FRAGMENTATION * 1.001
    assert budget < peaks[("bf16", False)] * memory.FRAGMENTATION
    monkeypatch.setattr(memory.budget, "resolve_budget", lambda setting, device, enforce=True, stage=None: memory.Budget(budget, "cap"))
    log = EventLog(cfg.run_dir, cfg.run, "sample")
    with pytest.raises(ConfigError, match=r"sample.precision = 'nf4' needs a CUDA GPU"):
        sample.render_planned(cfg, log, [], ["a red square"], (64, 64), None, None)
    plan = [e for e in read_events(cfg.run_dir) if e["event"] == "plan"][-1]
    assert plan["stage"] == "sample" and plan["settings"] == {"precision": "nf4", "cpu_offload": False}


def test_out_of_memory_goes_on_with_the_next_smaller_plan(cfg, monkeypatch):
    """The plan's activations are estimates: a CUDA out-of-memory error while rendering (injected after the
    first image) frees the pipeline, warns and renders everything with the next smaller plan; with no smaller
    plan left the error stands. Simulated GPU budget, rendered on this CPU."""
    from stages.core import faults

    real_hit, hits = faults.hit, []

    def oom_once(point: str) -> None:
        real_hit(point)
        hits.append(point)
        if hits.count("sample") == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(faults, "hit", oom_once)
    monkeypatch.setattr(memory.budget, "resolve_budget", lambda setting, device, enforce=True, stage=None: memory.Budget(1e6, "cap"))
    log = EventLog(cfg.run_dir, cfg.run, "sample")
    done = sample.render_planned(cfg, log, [], ["a red square"], (64, 64), None, None)
    events = read_events(cfg.run_dir)
    plans = [e["settings"] for e in events if e["event"] == "plan"]
    assert plans == [{"precision": "bf16", "cpu_offload": False}, {"precision": "bf16", "cpu_offload": True}]
    warned = [e["message"] for e in events if e["event"] == "warning"]
    assert len(warned) == 1 and warned[0].startswith("sample ran out of GPU memory with {'precision': 'bf16', "
                                                     "'cpu_offload': False} (predicted ")
    assert len(done["cells"][0]) == len(cfg.sample.seeds) and hits.count("sample") == 1 + len(cfg.sample.seeds)
    peaks = [t["predicted_peak_gb"] for t in _plan(cfg, 1e6).tried]
    assert done["loaded_as"]["predicted_peak_gb"] == round(peaks[1], 3)

    hits.clear()
    monkeypatch.setattr(faults, "hit", lambda point: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("CUDA out of memory")))
    smallest = min(peaks) * memory.FRAGMENTATION * 1.0001
    monkeypatch.setattr(memory.budget, "resolve_budget", lambda setting, device, enforce=True, stage=None: memory.Budget(smallest, "cap"))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        sample.render_planned(cfg, log, [], ["a red square"], (64, 64), None, None)


def test_nf4_quantizes_the_text_encoders_and_the_denoiser_only(assets, demo_data, tmp_path):
    """Not the VAE, nor a tokenizer or scheduler (SDXL lists its scheduler among the denoiser's components)."""
    cfg = make_cfg("sdxl", assets, demo_data, tmp_path)
    quant = sample.nf4_config(get_family("sdxl"), ModelSource(cfg.model, cfg.revision))
    assert quant.components_to_quantize == ["text_encoder", "text_encoder_2", "unet"]
    assert quant.quant_kwargs["bnb_4bit_quant_type"] == "nf4" and quant.quant_kwargs["bnb_4bit_compute_dtype"] == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nf4 needs CUDA")
def test_cuda_nf4_pipeline_renders(cfg):
    import dataclasses

    cfg = dataclasses.replace(cfg, device="cuda", sample=dataclasses.replace(
        cfg.sample, precision="nf4", seeds=[0], steps=2, width=64, height=64))
    pipe, _, _ = sample.load_pipeline(cfg, EventLog(cfg.run_dir, cfg.run, "sample", enabled=False))
    assert type(pipe.transformer.transformer_blocks[0].attn.to_q).__name__ == "Linear4bit"
    _, cells, _ = sample.render_columns(pipe, cfg, [], ["a red square"], (64, 64), None)
    assert cells[0][0].size == (64, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_pipeline_loads_straight_to_the_gpu_and_offloaded(cfg):
    """Whole: every component on the GPU through device_map (no .to() after); offloaded: on the host until used."""
    import dataclasses

    for offload in (False, True):
        c = dataclasses.replace(cfg, device="cuda", sample=dataclasses.replace(
            cfg.sample, precision="bf16", cpu_offload=offload, seeds=[0], steps=2, width=64, height=64))
        pipe, _, loaded_as = sample.load_pipeline(c, EventLog(c.run_dir, c.run, "sample", enabled=False))
        assert loaded_as["precision"] == "bf16" and loaded_as["cpu_offload"] == offload
        assert (pipe.transformer.device.type == "cuda") != offload
        _, cells, _ = sample.render_columns(pipe, c, [], ["a red square"], (64, 64), None)
        assert cells[0][0].size == (64, 64)
        del pipe
        torch.cuda.empty_cache()


def test_work_runs_at_the_blocks_width_over_the_tokens_each_model_sees(tmp_path, monkeypatch):
    """Full-size LTX-2 (config only, meta device): its transformer's first Linear is the 128-channel patch
    projection and its text connectors' the projection of all of Gemma's layers at once (188,160 wide), but
    they work at their blocks' widths (4096, 3840), and Gemma at its text width (its first Linear is the vision
    tower's). Counting the first Linears, the connectors' work over the clip's tokens planned 51.6 GB for a
    sample that --vram 24 now fits, as nf4 offloaded."""
    from bench.plan_cost import config_only_model
    from stages.core.config import load_config
    from stages.core.memory.sizes import meta_component, work_width

    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: 24 * 2**30)
    model = config_only_model("ltx2", tmp_path / "ltx2")
    cfg = load_config("configs/ltx2.toml", {"model": str(model), "artifacts": str(tmp_path / "a")})
    src = ModelSource(cfg.model, cfg.revision)
    widths = {c: work_width(meta_component(src, c)) for c in ("transformer", "connectors", "text_encoder")}
    assert widths == {"transformer": 4096, "connectors": 3840, "text_encoder": 3840}
    plan = memory.plan_for(cfg, get_family("ltx2"), src, memory.cap_budget(24.0, memory.CUDA_CONTEXT_GB), "sample")
    assert plan.fits and _choice(plan) == ("nf4", True) and plan.predicted_peak_gb < 16


def test_below_nf4_offloaded_the_plan_swaps_the_fewest_denoiser_blocks_that_fit(cfg, demo_data, tmp_path, monkeypatch):
    """FLUX.1 dev's preset on the full-size configs (meta device): where even nf4 offloaded does not fit (8 GB),
    the plan keeps that and swaps the denoiser's last blocks (its T5 offloaded, as the denoiser's resident part
    is while T5 runs), the fewest that fit; more for a smaller budget, down to what T5 needs alone; never 1 or 2
    (its two slots would hold them). The tiny model's 2 blocks get no swap plan."""
    from bench.plan_cost import config_only_model
    from stages.core.config import load_config

    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: None)
    dev = load_config(Path(__file__).resolve().parents[2] / "configs" / "flux-dev.toml", {
        "model": str(config_only_model("flux", tmp_path / "model")), "data.path": str(demo_data),
        "artifacts": str(tmp_path / "artifacts")})
    tried = _plan(dev, 1e6).tried
    swaps = [t for t in tried if "swapped_blocks" in t]
    assert [(t["precision"], t["cpu_offload"]) for t in tried] == [*ORDER, *[("nf4", True)] * len(swaps)]
    ks, peaks = [t["swapped_blocks"] for t in swaps], [t["predicted_peak_gb"] for t in swaps]
    assert ks == sorted(ks) and ks[0] > 2 and ks[-1] == 57  # FLUX.1's 19 + 38 blocks
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < tried[3]["predicted_peak_gb"] / 1.3
    for budget in (peaks[len(peaks) // 2] * memory.FRAGMENTATION * 1.001, peaks[-1] * memory.FRAGMENTATION * 1.001):
        plan = _plan(dev, budget)
        first = next(k for k, p in zip(ks, peaks) if p * memory.FRAGMENTATION <= budget)
        assert plan.fits and plan.settings == {"precision": "nf4", "cpu_offload": True, "swapped_blocks": first}
    assert not any("swapped_blocks" in t for t in _plan(cfg, 1e6).tried)


def _grids_without_and_with_swap(built, tmp_path, device: str, **settings):
    """`sample._render` of the built run (2 steps, seed 0) under `settings`, then the same swapping 1 of the tiny
    model's 2 blocks: (each run's result, each run's images as float arrays, base then LoRA column)."""
    import dataclasses

    import numpy as np

    cfg = dataclasses.replace(built, device=device, sample=dataclasses.replace(built.sample, steps=2, seeds=[0], **settings))
    columns, log = sample.adapters(cfg, tmp_path), EventLog(cfg.run_dir, cfg.run, "sample")
    runs = [sample._render(cfg, memory.StagePlan("sample", memory.Budget(None, device), plan, 0.0, True), log, columns,
                           ["a red square"], (64, 64), None, None)
            for plan in (settings, {**settings, "swapped_blocks": 1})]
    return runs, [[np.asarray(image, dtype=np.float32) for column in run["cells"] for image in column] for run in runs]


@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
def test_a_plan_that_swaps_denoiser_blocks_renders_the_same_grid(built_run, tmp_path):
    """A sample plan that swaps the denoiser's blocks (here 1 of 2, on this CPU in fp32) loads the denoiser as
    train loads a base it swaps, loads every column's adapter before the swap packs the blocks, renders the base
    column with the adapters disabled: the same images, base and LoRA columns, as the whole denoiser."""
    import numpy as np

    runs, cells = _grids_without_and_with_swap(built_run, tmp_path, "cpu", precision="fp32", cpu_offload=False)
    assert "swapped_blocks" not in runs[0]["loaded_as"] and runs[1]["loaded_as"]["swapped_blocks"] == 1
    assert runs[1]["loaded_as"]["block_copies"] == 1  # one block swapped: its slot keeps it after the first copy
    assert len(cells[0]) == len(cells[1]) == 2 and not np.array_equal(cells[0][0], cells[0][1])  # the LoRA shows
    assert all(np.array_equal(a, b) for a, b in zip(*cells))


@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
def test_an_offloaded_swap_gives_its_slots_memory_to_each_other_component_and_renders_the_same_grid(built_run, tmp_path):
    """Offloaded, the swapped denoiser's slot gives its memory back while the text encoders and the VAE run (the
    plan counts the slots beside the denoiser's resident part only): the block is copied again each time the
    denoiser comes back (once a column: after the text encoders, never between its steps), the images are the
    unswapped ones, and the slot holds no memory once the VAE has decoded."""
    import numpy as np

    from stages.core import blockswap, pipeline_swap

    released = []
    release, install = blockswap.BlockSwap.release_slots, pipeline_swap.install
    with pytest.MonkeyPatch.context() as mp:
        # a spy: the slot's bytes after each release
        mp.setattr(blockswap.BlockSwap, "release_slots",
                   lambda self: (release(self), released.append(sum(s.untyped_storage().nbytes() for s in self.slots))))
        # this CPU offloads nothing (diffusers' offload needs an accelerator): the swap's one-at-a-time hooks run
        # here as on a GPU, each moving its component to the same device
        mp.setattr(pipeline_swap, "install", lambda pipe, family, k, device, offload: install(pipe, family, k, device, True))
        runs, cells = _grids_without_and_with_swap(built_run, tmp_path, "cpu", precision="fp32", cpu_offload=False)
    assert runs[1]["loaded_as"]["swapped_blocks"] == 1
    assert runs[1]["loaded_as"]["block_copies"] == 2  # base and LoRA column: each after its prompt's encode
    assert released and set(released) == {0}
    assert all(np.array_equal(a, b) for a, b in zip(*cells))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nf4, block swap's side stream, offload hooks)")
@pytest.mark.parametrize("built_run", ["flux"], indirect=True)
def test_cuda_an_nf4_offloaded_plan_that_swaps_blocks_renders_as_without(built_run, tmp_path):
    """On the GPU: nf4 offloaded with 1 of the tiny FLUX's 2 blocks swapped (the denoiser quantized block by block,
    the text encoders and VAE brought to the GPU one at a time beside it) renders the grid nf4 offloaded renders,
    up to the GPU's nondeterminism, and copies the swapped block."""
    import numpy as np

    runs, cells = _grids_without_and_with_swap(built_run, tmp_path, "cuda", precision="nf4", cpu_offload=True)
    assert runs[1]["loaded_as"]["block_copies"] > 0
    assert all(np.abs(a - b).mean() < 2.0 for a, b in zip(*cells)), [np.abs(a - b).mean() for a, b in zip(*cells)]
