"""The memory planner (stages/core/memory/), `plan --json`, and OOM as a clear error.

Planner choices are checked by giving budgets just above / below a candidate's predicted peak, on
the tiny families' real configs (meta-device sizes), so each option (precision, batch, slicing,
tiling, swapped blocks) is picked when and only when the budget forces it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import FAMILIES, demo_config_path, make_cfg, tiny_model
from stages.core import blockswap, memory
from stages.core.errors import ResourceError
from stages.core.model_source import ModelSource, stored_dtypes
from stages.families import get_family
from stages.core.caches import lora_dir


def _plan(stage: str, cfg, gb: float) -> memory.StagePlan:
    family = get_family(cfg.family)
    return memory.PLANNERS[stage].plan(cfg, family, ModelSource(cfg.model, cfg.revision), memory.Budget(gb, "cap"))


def _peak_of(plan: memory.StagePlan, **settings) -> float:
    return next(t["predicted_peak_gb"] for t in plan.tried if all(t.get(k) == v for k, v in settings.items()))


def _just_above(gb: float) -> float:
    return gb * memory.FRAGMENTATION * 1.0001


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_meta_sizes_equal_the_loaded_models(family, assets):
    """Predicted weight bytes come from configs alone and match the real loaded component."""
    import importlib

    src = ModelSource(str(tiny_model(assets, FAMILIES[family])))
    fam = get_family(family)
    for component in (fam.denoiser_components[0], fam.vae_components[0]):
        library, name = src.component_config("", "model_index.json")[component]
        real = src.load(getattr(importlib.import_module(library), name), component)
        assert memory.weight_bytes(memory.meta_component(src, component), "fp32") == \
            sum(p.numel() * 4 for p in real.parameters())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_plans_every_stage(family, assets, demo_data, edit_data, tmp_path):
    """Every stage of every family plans from configs alone under a budget (the planner runs on a GPU
    only, so a family whose text side has a weightless processor folder once failed here on the H200:
    "has no processor/config.json")."""
    edit = get_family(family).control_range[0] > 0
    cfg = make_cfg(family, assets, edit_data if edit else demo_data, tmp_path)
    for stage in memory.PLANNERS:
        plan = _plan(stage, cfg, 80.0)
        assert plan.fits and 0 < plan.predicted_peak_gb < 80, (stage, plan)


def _deeper_flux(assets, tmp_path, layers: int, single_layers: int, width: int | None = None) -> str:
    """The tiny FLUX's configs with more blocks (and `width` wide): planning reads configs only, so no
    weights are needed."""
    src = tiny_model(assets, FAMILIES["flux"])
    folder = tmp_path / f"deeper-flux-{width}"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text((src / "model_index.json").read_text())
    config = json.loads((src / "transformer" / "config.json").read_text())
    config.update(num_layers=layers, num_single_layers=single_layers)
    if width:
        config.update(num_attention_heads=width // config["attention_head_dim"])
    (folder / "transformer" / "config.json").write_text(json.dumps(config))
    # planning reads the weights' headers only (an fp8 load streams a file whose keys are the model's)
    _header_only(folder / "transformer" / "diffusion_pytorch_model.safetensors",
                 memory.meta_component(ModelSource(str(folder)), "transformer").state_dict())
    return str(folder)


def _header_only(path: Path, tensors: dict, rename: dict | None = None) -> None:
    """A bf16 safetensors file of these tensors' names (`rename`d) and shapes whose data is a hole (a sparse
    file): a real header, every reader's check of sizes and offsets passes, no disk written."""
    header, offset = {}, 0
    for name, t in tensors.items():
        size = 2 * t.numel()
        header[(rename or {}).get(name, name)] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)


def test_train_planner_checkpoints_then_swaps_blocks_only_when_forced(assets, demo_data, tmp_path, monkeypatch):
    monkeypatch.setattr(memory.calibration, "SWAP_EXTRA_GB", 0.0)  # an absolute margin: larger than the tiny model itself
    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"train.base_precision": "bf16", "data.resolution": 256,
                                                            "runtime.gradient_checkpointing": False,
                                                            "model": _deeper_flux(assets, tmp_path, 4, 8)})
    roomy = _plan("train", cfg, 1000.0)
    assert roomy.fits and roomy.settings["swapped_blocks"] == 0 and not roomy.settings["gradient_checkpointing"]
    n = roomy.settings["blocks"]
    assert n == 12
    checkpointed = _peak_of(roomy, swapped_blocks=0, gradient_checkpointing=True)
    assert checkpointed < _peak_of(roomy, swapped_blocks=0, gradient_checkpointing=False)
    chosen = _plan("train", cfg, _just_above(checkpointed)).settings
    assert chosen["gradient_checkpointing"] and chosen["swapped_blocks"] == 0
    peaks = [_peak_of(roomy, swapped_blocks=k) for k in range(2, n + 1)]
    # swapping more lowers the peak, except where the two device slots grow to a larger block's size
    assert peaks[-1] == min(peaks) < peaks[0]
    tight = _plan("train", cfg, _just_above(peaks[-1]))
    assert tight.fits and tight.settings["swapped_blocks"] == n and tight.settings["gradient_checkpointing"]
    hopeless = _plan("train", cfg, peaks[-1] / 10)
    assert not hopeless.fits and "--vram" in hopeless.note and "train.batch_size" in hopeless.note


def test_auto_precision_fits_whole_before_any_block_is_swapped(assets, demo_data, tmp_path):
    """train.base_precision = "auto" tries every precision whole, fastest first (bf16, then nf4), before
    swapping any block (SDXL at 4 GB: nf4 whole ran 0.79x, bf16 with 38 blocks swapped 0.23x); swap
    plans then go smallest precision first (nf4 copies a quarter of bf16's bytes); and a swap plan
    carries SWAP_EXTRA_GB over the same plan's activations and weights."""
    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"train.base_precision": "auto", "data.resolution": 256,
                                                            "model": _deeper_flux(assets, tmp_path, 4, 8)})
    family = get_family("flux")
    roomy = _plan("train", cfg, 1000.0)
    order = [(t["base_precision"], t["swapped_blocks"] > 0) for t in roomy.tried]  # the first that fits is taken
    assert order.index(("bf16", False)) < order.index(("nf4", False)) < order.index(("nf4", True)) \
        < order.index(("bf16", True))  # neither whole fits: nf4 blocks swap before any bf16 block
    assert roomy.settings["base_precision"] == "bf16" and roomy.settings["swapped_blocks"] == 0
    src = ModelSource(cfg.model, cfg.revision)
    bf16_whole = _peak_of(roomy, base_precision="bf16", swapped_blocks=0, gradient_checkpointing=True)
    nf4_whole = _peak_of(roomy, base_precision="nf4", swapped_blocks=0, gradient_checkpointing=True)
    assert nf4_whole < bf16_whole
    at = lambda gb: memory.plan_train(cfg, family, src, memory.Budget(gb, "cap")).settings  # noqa: E731
    assert at(_just_above(bf16_whole))["base_precision"] == "bf16"
    below = at(bf16_whole * 0.999 * memory.FRAGMENTATION)
    assert below["base_precision"] == "nf4" and below["swapped_blocks"] == 0
    # one block swapped keeps two blocks in flight plus the margin: never below the whole plan + margin
    one = _peak_of(roomy, base_precision="bf16", swapped_blocks=1)
    assert one - bf16_whole >= memory.SWAP_EXTRA_GB


def test_swapping_an_nf4_block_frees_its_codes_not_its_absmax(assets, demo_data, tmp_path):
    """Block swap moves an nf4 block's 4-bit codes to host memory and keeps its quant_state (absmax)
    on the GPU, and copies the swapped blocks into two device slots the size of the largest of them:
    each further swapped block lowers the predicted peak by its codes' bytes, less what the slots grow."""
    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"train.base_precision": "nf4", "data.resolution": 256,
                                                            "model": _deeper_flux(assets, tmp_path, 4, 8)})
    roomy = _plan("train", cfg, 1000.0)
    blocks = blockswap.repeated_blocks(memory.meta_component(ModelSource(cfg.model, cfg.revision), "transformer"))
    n = len(blocks)
    codes = [memory.weight_bytes(b, "nf4", codes_only=True) / memory.GB for b in blocks]
    grew = 0
    for k in range(3, n + 1):  # from two swapped blocks on, both slots are there (one block needs one)
        freed = _peak_of(roomy, swapped_blocks=k - 1) - _peak_of(roomy, swapped_blocks=k)
        slot_growth = max(codes[n - k:]) - max(codes[n - k + 1:])
        grew += slot_growth > 0
        assert freed == pytest.approx(codes[n - k] - 2 * slot_growth, rel=1e-6, abs=1e-12)
        assert codes[n - k] < memory.weight_bytes(blocks[n - k], "nf4") / memory.GB  # the absmax stays
    assert grew == 1  # the first double-stream block swapped is larger than the single-stream ones


def test_a_stage_process_builds_each_meta_component_once(assets, demo_data, tmp_path, monkeypatch):
    """On a GPU a stage plans several times before it loads anything (its plan; the fingerprints of
    its cache and the upstream ones, which ask what the stage would plan, and under "auto" plan train
    too): each component is built on the meta device once per process, keyed by its class and
    config, with the same plans as fresh builds; another config builds anew."""
    from collections import Counter

    from stages import cache_latents, encode_captions
    from stages.core import runtime

    monkeypatch.setattr(runtime, "pick_device", lambda name: torch.device("cuda"))  # plan as on a GPU (no CUDA call)
    monkeypatch.setattr(runtime, "device_type", lambda name: "cuda")
    monkeypatch.setattr(memory.sizes, "_META_CACHE", {})
    built, build = Counter(), memory.sizes._build_meta
    monkeypatch.setattr(memory.sizes, "_build_meta", lambda cls, *a: built.update([cls.__name__]) or build(cls, *a))
    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"captions.text_encoder_precision": "auto"})
    family, src, budget = get_family("flux"), ModelSource(cfg.model, cfg.revision), memory.Budget(80.0, "auto")
    encode_captions.fingerprint_parts(cfg), cache_latents.fingerprint_parts(cfg)  # what train's check_upstream asks
    plans = {stage: memory.plan_for(cfg, family, src, budget, stage) for stage in memory.PLANNERS}
    assert built == {"FluxTransformer2DModel": 1, "CLIPTextModel": 1, "T5EncoderModel": 1, "AutoencoderKL": 1}, built
    monkeypatch.setattr(memory.sizes, "_META_CACHE", {})
    assert {s: memory.plan_for(cfg, family, src, budget, s).to_dict() for s in plans} == \
        {s: p.to_dict() for s, p in plans.items()}
    deeper = make_cfg("flux", assets, demo_data, tmp_path, model=_deeper_flux(assets, tmp_path, 4, 8))
    assert memory.plan_train(deeper, family, ModelSource(deeper.model), budget).settings["blocks"] == 12
    assert built["FluxTransformer2DModel"] == 3  # the cleared cache, then the deeper config


def test_caption_planner_lowers_batch_then_precision(assets, demo_data, tmp_path):
    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"captions.text_encoder_precision": "auto",
                                                            "captions.batch_size": 8})
    roomy = _plan("encode-captions", cfg, 1000.0)
    assert roomy.settings == {"text_encoder_precision": "bf16", "batch_size": 8}
    bf16_b1 = _peak_of(roomy, text_encoder_precision="bf16", batch_size=1)
    assert _plan("encode-captions", cfg, _just_above(bf16_b1)).settings == {"text_encoder_precision": "bf16", "batch_size": 1}
    nf4_b1 = _peak_of(roomy, text_encoder_precision="nf4", batch_size=1)
    assert nf4_b1 < bf16_b1
    assert _plan("encode-captions", cfg, _just_above(nf4_b1)).settings["text_encoder_precision"] == "nf4"


def test_latents_planned_by_a_budget_are_the_latents_train_expects(assets, demo_data, tmp_path, monkeypatch):
    """A cap too small for the fp32 VAE makes cache-latents cache bf16 latents; train (same config,
    same cap) must expect those, not the configured fp32 (on the H200 it refused them as stale).
    Under "auto" the VAE is never lowered only to stay below train's peak."""
    from stages import cache_latents
    from stages.core import runtime

    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"latents.vae_precision": "fp32", "data.resolution": 1024})
    fp32 = _peak_of(_plan("cache-latents", cfg, 1000.0), vae_precision="fp32", sliced=True, tiled=False)
    cap = _just_above(_peak_of(_plan("cache-latents", cfg, 1000.0), vae_precision="bf16", sliced=True, tiled=False))
    assert cap < fp32 * memory.FRAGMENTATION
    monkeypatch.setattr(runtime, "pick_device", lambda name: torch.device("cuda"))  # plan as on a GPU (no CUDA call)
    monkeypatch.setattr(runtime, "device_type", lambda name: "cuda")
    capped = make_cfg("flux", assets, demo_data, tmp_path, **{"latents.vae_precision": "fp32", "data.resolution": 1024,
                                                              "gpu.vram_budget_gb": cap})
    plan = _plan("cache-latents", capped, cap)
    assert plan.settings["vae_precision"] == "bf16"
    written = cache_latents.layout_parts(memory.with_plan(capped, plan))  # what cache-latents stores
    assert written["vae_precision"] == "bf16" and cache_latents.layout_parts(capped) == written  # what train checks
    # train's peak at batch 32 (~0.5 GB) holds a tiled bf16 encode (0.38) but not an fp32 one: "auto" keeps fp32
    big = make_cfg("flux", assets, demo_data, tmp_path, **{"latents.vae_precision": "fp32", "data.resolution": 1024,
                                                           "train.batch_size": 32})
    family, src = get_family("flux"), ModelSource(cfg.model, cfg.revision)
    train_peak = memory.plan_train(big, family, src, memory.Budget(1000.0, "cap")).predicted_peak_gb
    assert _peak_of(_plan("cache-latents", big, 1000.0), vae_precision="bf16", sliced=True, tiled=True) < train_peak
    auto = memory.plan_for(big, family, src, memory.Budget(fp32 * 5, "auto"), "cache-latents")
    assert auto.settings == {"vae_precision": "fp32", "sliced": False, "tiled": False}
    assert cache_latents.layout_parts(big)["vae_precision"] == "fp32"


def test_latent_planner_tiles_only_when_nothing_else_fits(assets, demo_data, tmp_path):
    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"latents.vae_precision": "fp32", "data.resolution": 1024})
    roomy = _plan("cache-latents", cfg, 1000.0)
    assert roomy.settings == {"vae_precision": "fp32", "sliced": False, "tiled": False}
    order = [(t["vae_precision"], t["sliced"], t["tiled"]) for t in roomy.tried]
    assert order == [("fp32", False, False), ("fp32", True, False), ("bf16", True, False), ("fp32", True, True),
                     ("bf16", True, True)]
    bf16_sliced = _peak_of(roomy, vae_precision="bf16", sliced=True, tiled=False)
    assert _plan("cache-latents", cfg, _just_above(bf16_sliced)).settings["tiled"] is False
    assert _plan("cache-latents", cfg, bf16_sliced).settings["tiled"] is True


@pytest.mark.parametrize("family", ["flux", "qwen-image"])
def test_tiled_encode_tiles_and_stays_near_the_untiled_posterior(family, assets):
    """The tiled encode cache-latents falls back to (memory.apply_vae_plan, then the family's
    encode_posterior), on the tiny VAE loaded as a user's: an untiled plan changes nothing; a tiled
    one really tiles (the encoder runs once per 64 px tile), keeps the latent shape (a tile's latent
    side is the tile over the VAE's own downsampling, 2x here, not a fixed 8x), and each tile's kept
    corner is that tile encoded alone. Qwen-Image's VAE normalizes each position on its own, so tiles
    differ only near their borders: within 15 % relative RMS of the untiled mean (measured 6.7 %).
    AutoencoderKL's GroupNorm and mid-block attention see the whole tile instead (random weights:
    ~77 %; bench/tiling.py measures both at full size)."""
    import copy

    from bench.tiling import synthetic_image
    from stages import cache_latents
    from stages.core.runtime import make_runtime

    fam = get_family(family)
    vae = fam.load_vae(ModelSource(str(tiny_model(assets, FAMILIES[family]))), make_runtime("cpu", "fp32"))
    pixels = cache_latents._to_pixels([synthetic_image(128)])
    plan = lambda tiled: memory.StagePlan("cache-latents", memory.Budget(None, "cpu"),  # noqa: E731
                                          {"vae_precision": "fp32", "sliced": tiled, "tiled": tiled}, 0.0, True)
    mean, logvar = fam.encode_posterior(vae, pixels)
    same = copy.deepcopy(vae)
    memory.apply_vae_plan(same, plan(False), tile_px=64)
    assert torch.equal(fam.encode_posterior(same, pixels)[0], mean)
    tiled, calls = copy.deepcopy(vae), []
    memory.apply_vae_plan(tiled, plan(True), tile_px=64)
    tiled.encoder.register_forward_hook(lambda *_: calls.append(1))
    t_mean, t_logvar = fam.encode_posterior(tiled, pixels)
    assert len(calls) == 9  # 128 px in 64 px tiles overlapping by a quarter: 3 x 3
    assert t_mean.shape == mean.shape and t_logvar.shape == logvar.shape
    corner = fam.encode_posterior(vae, pixels[..., :64, :64])[0]
    kept = 24  # the first tile's latent rows/columns no neighbour blends into: 32 less its 8 overlap
    torch.testing.assert_close(t_mean[..., :kept, :kept], corner[..., :kept, :kept], rtol=1e-5, atol=1e-5)
    rel = float((t_mean - mean).pow(2).mean().sqrt() / mean.pow(2).mean().sqrt())
    assert rel > 0  # tiling changes the numbers: it did not quietly encode whole
    if family == "qwen-image":
        assert rel < 0.15, rel
        assert float((t_logvar - logvar).abs().max()) < 0.5


def test_plan_json_schema(assets, demo_data, tmp_path, capsys):
    from stages import plan

    cfg = make_cfg("flux", assets, demo_data, tmp_path)
    result = plan.run(cfg, 0.5, as_json=True)
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(result))
    assert set(printed) == {"schema", "run", "family", "budget_gb", "budget_source", "allocator_gb", "context_gb", "fits",
                            "peak_gb", "total_gb", "stages"}
    assert printed["budget_gb"] == 0.5 and printed["budget_source"] == "cap"
    # a --vram number is the whole process: plan counts the GPU stage's CUDA context in it, even on a CPU
    assert printed["context_gb"] == memory.CUDA_CONTEXT_GB and printed["allocator_gb"] == max(0.5 - memory.CUDA_CONTEXT_GB, 0)
    assert [s["stage"] for s in printed["stages"]] == list(plan.PLANNED_STAGES)
    for s in printed["stages"]:
        assert set(s) == {"stage", "budget_gb", "budget_source", "allocator_gb", "context_gb", "settings",
                          "predicted_peak_gb", "predicted_total_gb", "fits", "note", "in_run"}
        assert s["in_run"] == (s["stage"] != "sample")  # the demo config leaves sample.after_train off
        # each stage counts its own context: the cache stages load fewer kernels than train
        assert s["context_gb"] == memory.stage_context_gb(s["stage"]) and s["allocator_gb"] == max(0.5 - s["context_gb"], 0)
        assert s["predicted_total_gb"] == pytest.approx(s["predicted_peak_gb"] * memory.FRAGMENTATION + s["context_gb"],
                                                        abs=2e-3)
    assert {s["context_gb"] for s in printed["stages"]} == {0.70, memory.CUDA_CONTEXT_GB}
    assert printed["peak_gb"] == max(s["predicted_peak_gb"] for s in printed["stages"] if s["in_run"])
    assert printed["total_gb"] == max(s["predicted_total_gb"] for s in printed["stages"] if s["in_run"])
    with pytest.raises(ResourceError, match="--vram"):
        plan.run(cfg, "lots", as_json=True)


def test_plan_on_the_cpu_shows_the_settings_each_stage_runs_and_how_to_plan_for_a_gpu(assets, demo_data, tmp_path, capsys):
    """Where the stages run on the CPU there is no budget: `plan` (the README's first command) shows each stage's
    settings as they run there, exits 0, and names the command that plans for a GPU of a given size."""
    from stages import plan

    cfg = make_cfg("flux", assets, demo_data, tmp_path, device="cpu")
    result = plan.run(cfg, "auto", as_json=True)
    assert result["budget_source"] == "cpu" and result["budget_gb"] is None and result["fits"]
    assert [s["settings"] for s in result["stages"]] == [memory.PLANNERS[s].configured(cfg) for s in plan.PLANNED_STAGES]
    capsys.readouterr()
    plan.print_table(result)
    out = " ".join(capsys.readouterr().out.split())
    assert "runs on the CPU: no GPU budget" in out and re.search(r"`lorapipe plan [^`]*--vram 12`", out), out
    assert "precision=auto" not in out, "'auto' precisions are shown as the CPU runs them"
    assert plan.run(cfg, 12, as_json=True)["budget_source"] == "cap", "a number still plans for that GPU on a CPU"


def test_plan_json_holds_what_plan_predicted_and_what_each_stage_ran_with(assets, demo_data, tmp_path, capsys):
    """`plan` writes its predictions to <run>/plan.json where the run's folder exists; a stage that plans adds
    the plan it runs with beside them, without dropping the others' entries."""
    from stages import plan
    from stages.core.events import EventLog

    cfg = make_cfg("flux", assets, demo_data, tmp_path)
    plan.run(cfg, 0.5, as_json=True, record=True)
    assert not (cfg.run_dir / memory.PLAN_FILE).exists()  # no run folder yet: nothing written
    cfg.run_dir.mkdir(parents=True)
    plan.run(cfg, 0.5, as_json=True)
    assert not (cfg.run_dir / memory.PLAN_FILE).exists()  # run --dry-run's call: nothing written
    predicted = plan.run(cfg, 0.5, as_json=True, record=True)
    capsys.readouterr()
    written = json.loads((cfg.run_dir / memory.PLAN_FILE).read_text())["stages"]
    assert sorted(written) == sorted(plan.PLANNED_STAGES)
    plans = [{k: v for k, v in s.items() if k != "in_run"} for s in predicted["stages"]]  # in_run: of the config, not the plan
    assert [written[s["stage"]]["planned"] for s in plans] == plans
    ran_cfg, ran = memory.plan_stage(cfg, get_family("flux"), "train", EventLog(cfg.run_dir, cfg.run, "train"))
    written = json.loads((cfg.run_dir / memory.PLAN_FILE).read_text())["stages"]
    assert written["train"]["ran"] == json.loads(json.dumps(ran.to_dict()))
    assert written["train"]["planned"] == plans[list(plan.PLANNED_STAGES).index("train")]
    assert "ran" not in written["encode-captions"]


def _raise_at(point: str, n: int, error: Exception | None = None):
    from stages.core import faults

    original = faults.hit
    count = {"n": 0}

    def hit(name: str) -> None:
        original(name)
        if name == point:
            count["n"] += 1
            if count["n"] == n:
                raise error or torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return hit


def test_oom_in_each_stage_is_one_clear_error_and_loses_nothing(assets, demo_data, tmp_path, monkeypatch):
    """An OOM injected after some rows/steps: exit 2 with the stage, the budget and the setting to
    change; what was written stays, and the rerun continues from it."""
    from click.testing import CliRunner

    from pipeline import cli
    from stages.core.artifacts import read_manifest

    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"train.steps": 4, "runtime.checkpoint_every": 1})
    args = ["--config", str(demo_config_path("flux")), "--model", cfg.model, "--set", f"data.path={demo_data}",
            "--set", f"artifacts={cfg.artifacts}", "--set", "device=cpu", "--set", "train.steps=4",
            "--set", "runtime.checkpoint_every=1", "--set", "gpu.vram_budget_gb=6"]
    for stage, point, rerun in [("encode-captions", "encode-captions", []), ("cache-latents", "cache-latents", []),
                                ("train", "train", ["--resume"])]:
        monkeypatch.setattr("stages.core.faults.hit", _raise_at(point, 2))
        result = CliRunner().invoke(cli, [stage, *args])
        assert result.exit_code == 2, result.output
        assert f"{stage} ran out of GPU memory (budget 6.0 GB" in result.output
        assert "--vram" in result.output and "Traceback" not in result.output
        assert ("runtime.cuda_graphs = 'off'" in result.output) == (stage == "train")
        monkeypatch.undo()
        result = CliRunner().invoke(cli, [stage, *args, *rerun])
        assert result.exit_code == 0, result.output
    final = read_manifest(lora_dir(cfg) / "final")
    assert final["step"] == 4 and final["complete"]
    events = [json.loads(line) for line in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "info" and "resumed from checkpoint-1" in e["message"]]
    assert resumed, "the train rerun continues from the checkpoint written before the OOM"
    captions = read_manifest(cfg.run_dir / "captions.zarr")
    assert captions["encoded_this_run"] < len(captions["rows"])  # the rows written before the OOM were kept


def test_vision_language_encoder_is_sized_by_its_text_model(assets):
    """Qwen2.5-VL (Qwen-Image's text encoder): activations scale with the text model's hidden size, not
    the vision tower's first Linear, and nf4 leaves the output embedding (lm_head) in bf16, as
    bitsandbytes through transformers does (the H200 encode peak was 1.5 GB over the old estimate)."""
    import torch

    import copy

    tiny = memory.meta_component(ModelSource(str(tiny_model(assets, FAMILIES["qwen-image"]))), "text_encoder")
    config = copy.deepcopy(tiny.config)
    config.vision_config.hidden_size = 2 * config.text_config.hidden_size  # a vision tower of its own width
    with torch.device("meta"):
        enc = type(tiny)(config)
    first = next(m.in_features for m in enc.modules() if isinstance(m, torch.nn.Linear))
    assert memory.sizes._width(enc) == enc.config.text_config.hidden_size != first
    head = enc.get_output_embeddings().weight
    linear = {id(m.weight) for m in enc.modules() if isinstance(m, torch.nn.Linear)} - {id(head)}
    want = sum(p.numel() * (memory.NF4_BYTES_PER_WEIGHT if id(p) in linear else 2) for p in enc.parameters())
    assert memory.weight_bytes(enc, "nf4") == want


def test_auto_checkpointing_checkpoints_the_fewest_blocks_that_fit(assets, demo_data, tmp_path, monkeypatch):
    """runtime.gradient_checkpointing = "auto": no block checkpointed at a roomy budget, all of them at a
    tight one, and in between the fewest that fit; the predicted peak falls with every block
    checkpointed; block swap only once every block is checkpointed. true and false plan as before."""
    monkeypatch.setattr(memory.calibration, "SWAP_EXTRA_GB", 0.0)
    model = _deeper_flux(assets, tmp_path, 4, 8)
    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"train.base_precision": "bf16", "data.resolution": 256,
                                                            "runtime.gradient_checkpointing": "auto", "model": model,
                                                            "runtime.cuda_graphs": "off"})  # graph room: the next test
    roomy = _plan("train", cfg, 1000.0)
    n = roomy.settings["blocks"]
    assert n == 12 and roomy.fits
    assert roomy.settings == {"base_precision": "bf16", "gradient_checkpointing": False, "checkpointed_blocks": 0,
                              "swapped_blocks": 0, "blocks": n}
    peaks = [_peak_of(roomy, swapped_blocks=0, checkpointed_blocks=k) for k in range(n + 1)]
    assert all(a > b for a, b in zip(peaks, peaks[1:]))  # each checkpointed block lowers the peak
    for k in (0, 1, 5, n - 1, n):
        chosen = _plan("train", cfg, _just_above(peaks[k])).settings
        assert (chosen["checkpointed_blocks"], chosen["swapped_blocks"]) == (k, 0), (k, chosen)
        assert chosen["gradient_checkpointing"] == (k > 0)
        assert memory.with_plan(cfg, _plan("train", cfg, _just_above(peaks[k]))).runtime.gradient_checkpointing == (k > 0)
    assert all(t["checkpointed_blocks"] == n for t in roomy.tried if t["swapped_blocks"])  # never un-checkpoint to swap
    swapped = _plan("train", cfg, peaks[n] * memory.FRAGMENTATION * 0.999).settings
    assert swapped["swapped_blocks"] > 0 and swapped["checkpointed_blocks"] == n
    for configured, ks in ((True, {n}), (False, {0, n})):  # as before partial checkpointing: all or none
        plan = _plan("train", make_cfg("flux", assets, demo_data, tmp_path, **{
            "train.base_precision": "bf16", "data.resolution": 256, "runtime.gradient_checkpointing": configured,
            "model": model}), 1000.0)
        assert {t["checkpointed_blocks"] for t in plan.tried if not t["swapped_blocks"]} == ks


def test_auto_checkpointing_under_a_cap_checkpoints_more_blocks_to_leave_cuda_graphs_room(assets, demo_data, tmp_path,
                                                                                          monkeypatch):
    """The trainer captures CUDA graphs only with room for them under the budget (fastpath.CaptureRoom):
    FLUX.2 klein's capture at 23 of 25 blocks checkpointed under a 5.08 GB cap ran out of memory and so
    did the eager steps after it. So where the fewest checkpointed blocks that fit leave too little room,
    the plan checkpoints more, the fewest that leave it (same precision, no swap), and says so; where none
    does, it keeps the fewest and says train runs eager. The same under a budget of "auto" (the free
    memory); cuda_graphs = "off" plans the fewest blocks that fit, as before."""
    from stages.core import fastpath

    monkeypatch.setattr(memory.calibration, "GRAPH_FREE_SLACK_GB", 0.0)  # the measured allowances outweigh the tiny model
    monkeypatch.setattr(memory.calibration, "GRAPH_ACTIVATIONS_EXTRA_GB", 0.0)
    monkeypatch.delenv(fastpath.ENV, raising=False)
    want = fastpath.UNSWAPPED_CAPTURE_ROOM * memory.GRAPH_ROOM_MARGIN
    sets = {"train.base_precision": "bf16", "data.resolution": 256, "runtime.gradient_checkpointing": "auto",
            "model": _deeper_flux(assets, tmp_path, 4, 8)}
    cfgs = {mode: make_cfg("flux", assets, demo_data, tmp_path, **sets, **{"runtime.cuda_graphs": mode}) for mode in ("auto", "off")}
    family, src = get_family("flux"), ModelSource(cfgs["auto"].model, cfgs["auto"].revision)
    roomy = _plan("train", cfgs["off"], 1000.0)
    n, seen = roomy.settings["blocks"], set()
    whole = {t["checkpointed_blocks"]: t for t in roomy.tried if not t["swapped_blocks"]}
    room_of = lambda t, gb: memory.graph_room(t["predicted_peak_gb"], t["activations_gb"], t["lora_grads_gb"],  # noqa: E731
                                              memory.Budget(gb, "cap"), swapped=False)
    for k, gb in [(k, _just_above(whole[k]["predicted_peak_gb"])) for k in range(n)] + [(0, 1000.0)]:
        auto, off = _plan("train", cfgs["auto"], gb), _plan("train", cfgs["off"], gb)
        free = memory.plan_train(cfgs["auto"], family, src, memory.Budget(gb, "auto"))  # the free memory: the same
        assert off.settings["checkpointed_blocks"] == k and "graph_room" not in off.settings
        assert (free.settings, free.note) == (auto.settings, auto.note)
        got = auto.settings["checkpointed_blocks"]
        assert auto.fits and auto.settings["swapped_blocks"] == 0 and auto.predicted_peak_gb * memory.FRAGMENTATION <= gb
        if room_of(whole[k], gb) >= want:
            assert got == k and auto.settings["graph_room"] == pytest.approx(room_of(whole[k], gb), rel=1e-4, abs=0.01)
            assert auto.note == ""
            seen.add("room")
        elif got > k:
            assert auto.settings["graph_room"] == pytest.approx(room_of(whole[got], gb), rel=1e-4, abs=0.01)
            assert auto.settings["graph_room"] >= want
            assert f"{got - k} more block{'s' * (got - k > 1)} checkpointed than the budget needs" in auto.note
            assert all(room_of(whole[j], gb) < want for j in range(k + 1, got))  # the fewest that leave it
            seen.add("moved")
        else:
            assert got == k and all(room_of(whole[j], gb) < want for j in range(k, n + 1))
            assert "CUDA graphs may have no room to capture under this plan" in auto.note and "else runs eager" in auto.note
            seen.add("eager")
    assert {"room", "moved"} <= seen, seen


def test_auto_checkpointing_never_lowers_the_precision_to_uncheckpoint(assets, demo_data, tmp_path):
    """With "auto"'s precision order (bf16, then nf4), a budget that bf16 fits only with every block
    checkpointed keeps bf16 checkpointed, though nf4 with no block checkpointed would fit too
    (tiny images and captions: the weights outweigh the activations here)."""
    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{
        "train.base_precision": "auto", "runtime.gradient_checkpointing": "auto", "data.resolution": 16,
        "captions.max_sequence_length": 1, "model": _deeper_flux(assets, tmp_path, 4, 8)})
    family = get_family("flux")
    src = ModelSource(cfg.model, cfg.revision)
    roomy = memory.plan_train(cfg, family, src, memory.Budget(1000.0, "cap"))
    n = roomy.settings["blocks"]
    budget = _just_above(_peak_of(roomy, base_precision="bf16", swapped_blocks=0, checkpointed_blocks=n))
    assert _peak_of(roomy, base_precision="bf16", swapped_blocks=0, checkpointed_blocks=n - 1) * memory.FRAGMENTATION > budget
    assert _peak_of(roomy, base_precision="nf4", swapped_blocks=0, checkpointed_blocks=0) * memory.FRAGMENTATION < budget
    chosen = memory.plan_train(cfg, family, src, memory.Budget(budget, "cap")).settings
    assert (chosen["base_precision"], chosen["checkpointed_blocks"], chosen["swapped_blocks"]) == ("bf16", n, 0)


def test_a_swap_plan_counts_a_host_copy_of_the_base_only_where_its_files_are_not_bf16(assets, demo_data, tmp_path):
    """A bf16 load reads a base stored as bf16 safetensors as mapped file pages, not a copy (bench/fp8.md:
    1.74 GB of anonymous memory for a 2.44 GB model), so a swap plan's host memory is its swapped blocks;
    stored in fp32 the cast to bf16 is a copy, and the plan adds the base's bf16 size."""
    from diffusers import FluxTransformer2DModel

    from stages.core.model_source import stored_as_bf16

    plans, bf16_gb = {}, None
    for dtype in (torch.bfloat16, torch.float32):
        folder = Path(_deeper_flux(assets, tmp_path / str(dtype), 4, 8, width=256))
        config = json.loads((folder / "transformer" / "config.json").read_text())
        FluxTransformer2DModel.from_config(config).to(dtype).save_pretrained(folder / "transformer")
        assert stored_as_bf16(stored_dtypes(ModelSource(str(folder)).weight_files("transformer"))) == (dtype == torch.bfloat16)
        cfg = make_cfg("flux", assets, demo_data, tmp_path / f"run-{dtype}", **{"train.base_precision": "nf4",
                       "data.resolution": 256, "model": str(folder)})
        plans[dtype] = _plan("train", cfg, 1000.0)
        bf16_gb = memory.weight_bytes(memory.meta_component(ModelSource(str(folder)), "transformer"), "bf16") / memory.GB
    pairs = [(a, b) for a, b in zip(plans[torch.bfloat16].tried, plans[torch.float32].tried) if a["swapped_blocks"]]
    assert pairs and all(a["swapped_blocks"] == b["swapped_blocks"] for a, b in pairs)
    assert bf16_gb > 0.025 and all(abs(b["host_gb"] - a["host_gb"] - bf16_gb) <= 0.011 for a, b in pairs), (bf16_gb, pairs[:2])
    assert max(a["host_gb"] for a, _ in pairs) < bf16_gb  # the swapped blocks alone (nf4: a quarter of bf16)


def test_a_swap_plan_checks_host_memory_before_loading(assets, demo_data, tmp_path, monkeypatch):
    """A swap plan keeps its swapped blocks in host memory, after a bf16 read of the base that copies it
    where the files are not bf16 safetensors (here: the folder's weights file is a placeholder): the plan
    says how much (`host_gb`, shown by `plan`), and train stops before loading when the host has less
    available, naming both figures and what to do; with enough, or where it cannot tell, it loads."""
    from stages.core.errors import ResourceError
    from stages.core.runtime import HostLoad, make_runtime
    from stages.plan import _settings_text

    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"train.base_precision": "nf4", "data.resolution": 256,
                                                            "model": _deeper_flux(assets, tmp_path, 4, 8)})
    roomy = _plan("train", cfg, 1000.0)
    bf16 = memory.weight_bytes(memory.meta_component(ModelSource(cfg.model, cfg.revision), "transformer"), "bf16")
    swapping = [t for t in roomy.tried if t["swapped_blocks"]]
    assert swapping and all(round(bf16 / memory.GB, 2) <= t["host_gb"] <= round(2 * bf16 / memory.GB, 2) for t in swapping)
    assert all("host_gb" not in t for t in roomy.tried if not t["swapped_blocks"])  # nf4 whole: shard by shard
    plan = memory.StagePlan("train", memory.Budget(6.0, "cap"), {**swapping[-1], "host_gb": 40.0}, 5.0, True)
    assert "host_gb=40.0" in _settings_text(plan.settings)
    rt = make_runtime("cpu", "fp32")
    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: int(30 * memory.GB))
    with pytest.raises(ResourceError) as err:
        memory.load_device(plan, rt)
    assert all(s in str(err.value) for s in ("40.0 GB", "30.0 GB", "host memory", "--vram", f"swaps {plan.settings['swapped_blocks']} of"))
    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: int(41 * memory.GB))
    assert isinstance(memory.load_device(plan, rt), HostLoad) and memory.host_shortfall(plan) == ""
    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: None)  # not Linux: not checked
    assert isinstance(memory.load_device(plan, rt), HostLoad)
    assert memory.load_device(roomy, rt) is rt  # no swap: the runtime's device, nothing checked
    fp8_cfg = make_cfg("flux", assets, demo_data, tmp_path / "fp8", **{"train.base_precision": "fp8",
                       "data.resolution": 256, "model": cfg.model})
    assert "host_gb" not in _plan("train", fp8_cfg, 1000.0).settings  # a diffusers folder: fp8 streams its shards
    fp8 = memory.StagePlan("train", memory.Budget(60.0, "cap"), {**roomy.settings, "base_precision": "fp8",
                                                                   "host_gb": 40.0}, 20.0, True)
    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: int(30 * memory.GB))
    with pytest.raises(ResourceError) as err:  # fp8 from a single file reads the bf16 base into host memory
        memory.load_device(fp8, rt)
    assert all(s in str(err.value) for s in ("an fp8 base from a single-file checkpoint", "40.0 GB", "30.0 GB",
                                             "diffusers folder", "'nf4'"))
    import pathlib

    if pathlib.Path("/proc/meminfo").exists():  # Linux: the real figure is read
        monkeypatch.undo()
        assert 0 < memory.host_available_bytes() < 2**50


def test_a_swap_plan_swaps_more_blocks_to_leave_cuda_graphs_room(assets, demo_data, tmp_path, monkeypatch):
    """Under swap the trainer captures CUDA graphs only with room for them (fastpath.CaptureRoom), and
    eager steps are host-bound at small images: so where the fewest blocks that fit leave too little
    room, the plan swaps more, the fewest that leave it (same precision and checkpointing), and says
    so; where no swap plan leaves it, the plan stays and its note says train runs eager. With
    cuda_graphs off or LoRA dropout the fewest blocks that fit, as before."""
    from stages.core import fastpath

    monkeypatch.setattr(memory.calibration, "SWAP_EXTRA_GB", 0.0)  # an absolute margin: larger than the tiny model itself
    monkeypatch.setattr(memory.calibration, "GRAPH_FREE_SLACK_GB", 0.0)  # so are the room's measured allowances
    monkeypatch.setattr(memory.calibration, "GRAPH_ACTIVATIONS_EXTRA_GB", 0.0)
    monkeypatch.delenv(fastpath.ENV, raising=False)
    want = fastpath.CAPTURE_ROOM * memory.GRAPH_ROOM_MARGIN
    seen = set()
    # 1024 wide, a block's weights are ~40x its checkpointed activations at 256 px, 4096 wide ~160x: the
    # fewest blocks that fit leave room under some budgets and not under others, more blocks make it
    for width in (1024, 4096):
        sets = {"train.base_precision": "bf16", "data.resolution": 256, "model": _deeper_flux(assets, tmp_path, 4, 8, width)}
        cfgs = {mode: make_cfg("flux", assets, demo_data, tmp_path, **sets, **{"runtime.cuda_graphs": mode}) for mode in ("auto", "off", "on")}
        # base_precision "auto": the plan that makes room keeps the precision the fewest blocks had
        either = {mode: make_cfg("flux", assets, demo_data, tmp_path, **{**sets, "train.base_precision": "auto"},
                                 **{"runtime.cuda_graphs": mode}) for mode in ("auto", "off")}
        dropout = make_cfg("flux", assets, demo_data, tmp_path, **sets, **{"train.dropout": 0.1})
        roomy = _plan("train", cfgs["auto"], 1000.0)
        swaps = [t for t in roomy.tried if t["swapped_blocks"] > 0 and t["base_precision"] == "bf16"]
        for t in swaps:
            gb = _just_above(t["predicted_peak_gb"])
            auto, off = _plan("train", cfgs["auto"], gb), _plan("train", cfgs["off"], gb)
            a, o = (_plan("train", either[mode], gb).settings for mode in ("auto", "off"))
            assert (a["base_precision"], a["checkpointed_blocks"]) == (o["base_precision"], o["checkpointed_blocks"])
            assert a["swapped_blocks"] >= o["swapped_blocks"]
            assert "graph_room" not in off.settings and off.settings == _plan("train", dropout, gb).settings
            if not off.settings["swapped_blocks"]:
                continue
            room = memory.graph_room(off.predicted_peak_gb, t["activations_gb"], t["lora_grads_gb"], memory.Budget(gb, "cap"))
            assert auto.fits and auto.predicted_peak_gb * memory.FRAGMENTATION <= gb
            moved = auto.settings["swapped_blocks"] - off.settings["swapped_blocks"]
            if room >= want:
                assert moved == 0 and auto.settings["graph_room"] == round(room, 2) and auto.note == ""
                seen.add("room")
            elif moved > 0:
                assert auto.settings["graph_room"] >= want and f"{moved} more block{'s' * (moved > 1)} swapped" in auto.note
                new = next(u for u in roomy.tried if u["base_precision"] == "bf16" and u["swapped_blocks"] == auto.settings["swapped_blocks"])
                assert auto.predicted_peak_gb == new["predicted_peak_gb"] and auto.settings["graph_room"] == round(
                    memory.graph_room(new["predicted_peak_gb"], new["activations_gb"], new["lora_grads_gb"], memory.Budget(gb, "cap")), 2)
                fewer = [u for u in roomy.tried if u["base_precision"] == "bf16" and
                         off.settings["swapped_blocks"] < u["swapped_blocks"] < auto.settings["swapped_blocks"]]
                assert all(memory.graph_room(u["predicted_peak_gb"], u["activations_gb"], u["lora_grads_gb"], memory.Budget(gb, "cap")) < want
                           or u["predicted_peak_gb"] * memory.FRAGMENTATION > gb for u in fewer)  # the fewest that do
                seen.add("moved")
            else:
                assert auto.settings["graph_room"] == round(room, 2) < want and "else runs eager" in auto.note
                on = _plan("train", cfgs["on"], gb)  # "on" captures regardless: its note says so
                assert on.settings == auto.settings and "'on' captures anyway and may run out of memory" in on.note
                seen.add("eager")
    assert seen == {"room", "moved", "eager"}


def test_a_spread_swap_plan_counts_the_blocks_it_picks_and_hands_them_on(assets, demo_data, tmp_path, monkeypatch):
    """runtime.block_swap_layout = "spread": the planner prices the blocks blockswap.swapped_positions
    picks (FLUX's double blocks outweigh its single ones; the two slots hold the largest swapped block
    each, so the resident bytes are the base less the swapped blocks plus two of the largest), the
    settings name the layout, and the load and the swap get it."""
    from diffusers import FluxTransformer2DModel

    from stages.core.runtime import Runtime

    monkeypatch.setattr(memory.calibration, "SWAP_EXTRA_GB", 0.0)
    folder = _deeper_flux(assets, tmp_path, 4, 8)
    sets = {"train.base_precision": "bf16", "data.resolution": 256, "model": folder}
    with torch.device("meta"):
        meta = FluxTransformer2DModel.from_config(json.loads((Path(folder) / "transformer" / "config.json").read_text()))
    size = [memory.weight_bytes(b, "bf16", codes_only=True) for b in blockswap.repeated_blocks(meta)]
    assert size[0] > 2 * size[-1]  # a double block, a single block
    plans = {layout: _plan("train", make_cfg("flux", assets, demo_data, tmp_path, **sets, **{"runtime.block_swap_layout": layout}), 1000.0)
             for layout in ("last", "spread")}
    swaps = {layout: {t["swapped_blocks"]: t for t in p.tried if t["swapped_blocks"]} for layout, p in plans.items()}
    n = plans["last"].settings["blocks"]
    assert sorted(swaps["last"]) == sorted(swaps["spread"]) == list(range(1, n + 1))
    assert all("swap_layout" not in t for t in swaps["last"].values())
    assert all(t["swap_layout"] == "spread" for t in swaps["spread"].values())
    kept = lambda k, layout: -sum(h := [size[i] for i in blockswap.swapped_positions(n, k, layout)]) + 2 * max(h)  # noqa: E731
    differed = 0
    for k in range(1, n + 1):
        last, spread = swaps["last"][k]["predicted_peak_gb"], swaps["spread"][k]["predicted_peak_gb"]
        assert spread - last == pytest.approx((kept(k, "spread") - kept(k, "last")) / memory.GB, abs=2e-6), k
        differed += kept(k, "spread") != kept(k, "last")
    assert differed  # e.g. one double block among the spread ones: its slots are larger, a single block stays
    gb = _just_above(swaps["spread"][6]["predicted_peak_gb"])
    tight = _plan("train", make_cfg("flux", assets, demo_data, tmp_path, **sets, **{"runtime.block_swap_layout": "spread",
                                                                                     "runtime.cuda_graphs": "off"}), gb)
    assert tight.settings["swap_layout"] == "spread" and tight.settings["swapped_blocks"] >= 6
    monkeypatch.setattr(memory.train, "host_shortfall", lambda plan: "")
    load = memory.load_device(tight, Runtime(torch.device("cuda"), torch.bfloat16))
    assert (load.swapped_blocks, load.swap_layout) == (tight.settings["swapped_blocks"], "spread")


def test_a_spread_swap_is_refused_where_blocks_run_in_another_order(assets, demo_data, tmp_path):
    """SDXL's UNet lists its blocks down, up, mid and runs them down, mid, up: with swapped blocks
    spread among resident ones the swap could not copy the next one ahead, so the planner refuses
    "spread" there with a message naming the key and the fix; "last" plans as before."""
    from stages.core.errors import ConfigError

    cfg = make_cfg("sdxl", assets, demo_data, tmp_path, **{"runtime.block_swap_layout": "spread"})
    with pytest.raises(ConfigError, match=r"runtime.block_swap_layout = 'spread' does not suit sdxl: .* Set runtime.block_swap_layout = 'last'"):
        _plan("train", cfg, 0.01)
    assert _plan("train", make_cfg("sdxl", assets, demo_data, tmp_path), 0.01).stage == "train"


def test_keep_attention_costs_one_attention_output_per_checkpointed_block(assets, demo_data, tmp_path, monkeypatch):
    """runtime.keep_attention: each checkpointed block that is not swapped keeps its attention output (a block-width
    activation: ATTENTION_KEPT_UNITS units), so at every checkpointed count the predicted peak grows by exactly
    that, a swap plan counts only its resident blocks, and at the same budget "auto" un-checkpoints fewer blocks.
    SDXL (UNet blocks with several attentions at other widths) is refused, naming the key and the fix."""
    from stages.core.errors import ConfigError

    monkeypatch.setattr(memory.calibration, "SWAP_EXTRA_GB", 0.0)
    model = _deeper_flux(assets, tmp_path, 4, 8)
    sets = {"train.base_precision": "bf16", "data.resolution": 256, "runtime.gradient_checkpointing": "auto",
            "model": model, "runtime.cuda_graphs": "off"}
    plain, kept = (_plan("train", make_cfg("flux", assets, demo_data, tmp_path, **sets, **{"runtime.keep_attention": k}),
                         1000.0) for k in (False, True))
    n = plain.settings["blocks"]
    denoiser = memory.meta_component(ModelSource(model, None), "transformer")
    cfg = make_cfg("flux", assets, demo_data, tmp_path)
    tokens = cfg.train.batch_size * ((256 // 16) ** 2 + cfg.captions.max_sequence_length)
    block_gb = memory.ATTENTION_KEPT_UNITS * tokens * memory.sizes._width(blockswap.repeated_blocks(denoiser)[0]) * 2 / memory.GB

    def extra(**at) -> float:
        return _peak_of(kept, **at) - _peak_of(plain, **at)

    for k in range(n + 1):
        assert extra(swapped_blocks=0, checkpointed_blocks=k) == pytest.approx(k * block_gb, abs=1e-6)
    swaps = [t for t in kept.tried if t["swapped_blocks"]]
    assert swaps and all(extra(swapped_blocks=t["swapped_blocks"], checkpointed_blocks=n)
                         == pytest.approx((n - t["swapped_blocks"]) * block_gb, abs=1e-6) for t in swaps)
    budget = _just_above(_peak_of(plain, swapped_blocks=0, checkpointed_blocks=5))
    chosen = {k: _plan("train", make_cfg("flux", assets, demo_data, tmp_path, **sets, **{"runtime.keep_attention": k}),
                       budget).settings["checkpointed_blocks"] for k in (False, True)}
    assert chosen[False] == 5 < chosen[True]
    with pytest.raises(ConfigError, match=r"runtime.keep_attention = true does not suit sdxl: .* Set runtime.keep_attention = false"):
        _plan("train", make_cfg("sdxl", assets, demo_data, tmp_path, **{"runtime.keep_attention": True}), 1000.0)

    # the plan's hint: only from KEEP_ATTENTION_HINT_TOKENS a sample (not a batch), only where the kept outputs fit too
    hint = "runtime.keep_attention = true fits this budget too"
    full = {**sets, "runtime.gradient_checkpointing": True}
    assert hint not in _plan("train", make_cfg("flux", assets, demo_data, tmp_path, **full), 1000.0).note  # 256 px: short
    per_sample = tokens // cfg.train.batch_size
    assert cfg.train.batch_size > 1
    monkeypatch.setattr(memory.calibration, "KEEP_ATTENTION_HINT_TOKENS", per_sample + 1)  # the batch's tokens are more, a sample's not
    assert hint not in _plan("train", make_cfg("flux", assets, demo_data, tmp_path, **full), 1000.0).note
    monkeypatch.setattr(memory.calibration, "KEEP_ATTENTION_HINT_TOKENS", per_sample)
    roomy = _plan("train", make_cfg("flux", assets, demo_data, tmp_path, **full), 1000.0)
    assert f"{hint} (+{n * block_gb:.1f} GB): the {n} checkpointed blocks" in roomy.note
    assert hint not in _plan("train", make_cfg("flux", assets, demo_data, tmp_path, **full, **{"runtime.keep_attention": True}),
                             1000.0).note
    assert hint not in _plan("train", make_cfg("flux", assets, demo_data, tmp_path, **full),
                             _just_above(roomy.predicted_peak_gb)).note


def test_fp8_weight_bytes_equal_the_quantized_model(assets, tmp_path):
    """The planner sizes an fp8 base from its config alone as stages/core/fp8.py makes it: the block
    Linears one byte per weight plus a 4-byte scale per output channel, everything else bf16."""
    from diffusers import FluxTransformer2DModel

    from stages.core import fp8

    src = ModelSource(_deeper_flux(assets, tmp_path, 2, 2, width=256))
    meta = memory.meta_component(src, "transformer")
    model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(src.path / "transformer"))
    model = fp8.quantize_denoiser_fp8(model.to(torch.bfloat16), fp8.inside_repeated_blocks(model), "cpu")
    real = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    assert fp8.fp8_bytes(model) > 0 and memory.weight_bytes(meta, "fp8") == real
    assert real < 0.75 * memory.weight_bytes(meta, "bf16")


def test_auto_tries_fp8_between_bf16_and_nf4_where_the_gpu_runs_it(assets, demo_data, tmp_path, monkeypatch):
    """On a GPU with fp8 tensor cores "auto" tries bf16 whole, then fp8 whole (faster than nf4 in every
    row measured on the H200, at about half bf16's memory), then fp8 in fewer and fewer of the first
    blocks with the rest nf4, then nf4; fp8 blocks are never swapped.
    A diffusers folder's fp8 load streams its shards, so host memory does not matter; from a source read
    whole (a single file) without enough host memory for its bf16 read fp8 is left out and the plan says
    why; without fp8 tensor cores it is left out quietly."""
    from stages.core import fp8

    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"train.base_precision": "auto", "data.resolution": 256,
                                                            "model": _deeper_flux(assets, tmp_path, 2, 4, width=256)})
    src, family = ModelSource(cfg.model, cfg.revision), get_family("flux")
    at = lambda gb: memory.plan_train(cfg, family, src, memory.Budget(gb, "cap"))  # noqa: E731
    monkeypatch.setattr(fp8, "fp8_supported", lambda: True)
    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: None)
    monkeypatch.setattr(type(family), "fp8_faster_from_tokens", None)  # the order without rows (next test: with)
    roomy = at(1000.0)
    order = [(t["base_precision"], t["swapped_blocks"] > 0) for t in roomy.tried]
    assert order.index(("bf16", False)) < order.index(("fp8", False)) < order.index(("nf4", False))
    assert ("fp8", True) not in order and roomy.settings["base_precision"] == "bf16"
    whole = {p: _peak_of(roomy, base_precision=p, swapped_blocks=0, gradient_checkpointing=True)
             for p in ("bf16", "fp8", "nf4")}
    assert whole["nf4"] < whole["fp8"] < whole["bf16"]
    between = at(whole["bf16"] * 0.999 * memory.FRAGMENTATION)
    assert between.settings["base_precision"] == "fp8" and between.settings["swapped_blocks"] == 0
    assert "host_gb" not in between.settings and "fp8" not in between.note
    below = at(whole["fp8"] * 0.999 * memory.FRAGMENTATION)  # fp8 in the first blocks, the rest nf4
    assert below.settings["base_precision"] == "fp8" and below.settings["fp8_blocks"] == 5
    fewest = _peak_of(roomy, base_precision="fp8", fp8_blocks=2, gradient_checkpointing=True)
    assert at(fewest * 0.999 * memory.FRAGMENTATION).settings["base_precision"] == "nf4"
    host_gb = round(memory.weight_bytes(memory.meta_component(src, "transformer"), "bf16") / memory.GB, 2)
    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: int(host_gb * memory.GB / 2))
    assert at(whole["bf16"] * 0.999 * memory.FRAGMENTATION).settings["base_precision"] == "fp8"  # streamed
    meta = memory.meta_component(src, "transformer").state_dict()
    first = next(iter(meta))  # a folder whose keys diffusers converts on load: the loader reads it whole
    _header_only(Path(cfg.model) / "transformer" / "diffusion_pytorch_model.safetensors", meta,
                 rename={first: "converted." + first})
    assert not fp8.streams(memory.meta_component(src, "transformer"), stored_dtypes(src.weight_files("transformer")))
    converted = at(whole["bf16"] * 0.999 * memory.FRAGMENTATION)
    monkeypatch.setattr(ModelSource, "weight_files", lambda self, sub: None)  # a single file: the same
    for short in (converted, at(whole["bf16"] * 0.999 * memory.FRAGMENTATION)):
        assert short.settings["base_precision"] == "nf4" and "fp8" not in {t["base_precision"] for t in short.tried}
        assert f"auto left fp8 out: its bf16 read ({host_gb:.1f} GB)" in short.note and "host memory" in short.note
    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: None)
    cfg.runtime.compile_transformer = "off"  # fp8 pays only compiled
    eager = at(whole["bf16"] * 0.999 * memory.FRAGMENTATION)
    assert eager.settings["base_precision"] == "nf4" and "compile_transformer = 'off'" in eager.note
    cfg.runtime.compile_transformer = "auto"
    monkeypatch.setattr(fp8, "fp8_supported", lambda: False)
    older = at(whole["bf16"] * 0.999 * memory.FRAGMENTATION)
    assert "fp8" not in {t["base_precision"] for t in older.tried} and "fp8" not in older.note


def test_auto_tries_fp8_first_from_the_step_size_it_was_measured_faster(assets, demo_data, tmp_path, monkeypatch):
    """Where a family's fp8 step was measured faster than bf16's (family.fp8_faster_from_tokens: Qwen-Image
    from its 1024 px b1 step, 4173 tokens; slower at 512 px b1), "auto" tries fp8 before bf16 for a step of
    at least that many tokens and says why; below it, or for a family with no fp8 rows, bf16 stays first."""
    from stages.core import fp8

    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"train.base_precision": "auto", "data.resolution": 256,
                                                            "model": _deeper_flux(assets, tmp_path, 2, 4, width=256)})
    src, family = ModelSource(cfg.model, cfg.revision), get_family("flux")
    monkeypatch.setattr(fp8, "fp8_supported", lambda: True)
    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: None)
    tokens = cfg.train.batch_size * ((256 // 16) ** 2 + cfg.captions.max_sequence_length)
    assert (get_family("qwen-image").fp8_faster_from_tokens, get_family("sdxl").fp8_faster_from_tokens) == (4173, 1101)
    assert get_family("flux-kontext").fp8_faster_from_tokens == get_family("flux").fp8_faster_from_tokens  # its transformer
    # FLUX.2 klein and dev, Krea 2 and Qwen-Image 2.1: their one fp8 row each, 1024 px b1 (bench/results)
    assert {get_family(n).fp8_faster_from_tokens for n in ("flux2-klein", "flux2", "krea2", "qwen-image-2.1")} == {4173}
    for faster_from, first in ((tokens, "fp8"), (tokens + 1, "bf16"), (None, "bf16")):
        monkeypatch.setattr(type(family), "fp8_faster_from_tokens", faster_from)
        plan = memory.plan_train(cfg, family, src, memory.Budget(1000.0, "cap"))
        order = [t["base_precision"] for t in plan.tried if not t["swapped_blocks"]]
        assert plan.settings["base_precision"] == first and order.index(first) == 0, order
        assert (f"{tokens} tokens a step" in plan.note) == (first == "fp8"), plan.note


def test_an_fp8_base_that_does_not_fit_is_not_swapped(assets, demo_data, tmp_path):
    """train.base_precision = "fp8" set by hand under a budget it does not fit: the plan says so (an fp8
    base has no host-resident blocks to swap) instead of planning a swap that could not load."""
    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"train.base_precision": "fp8", "data.resolution": 256,
                                                            "model": _deeper_flux(assets, tmp_path, 2, 4, width=256)})
    roomy = _plan("train", cfg, 1000.0)
    assert {t["swapped_blocks"] for t in roomy.tried} == {0}
    tight = _plan("train", cfg, min(t["predicted_peak_gb"] for t in roomy.tried) * 0.9)
    assert not tight.fits and "more than the" in tight.note


def test_an_fp8_base_that_does_not_fit_keeps_its_first_blocks_in_fp8_and_the_rest_in_nf4(assets, demo_data, tmp_path):
    """train.base_precision = "fp8" under a budget its whole base does not fit: the plan keeps the most of
    the first blocks in fp8 that fit, the rest nf4 (a GB of fp8 blocks saved FLUX.2 klein more time than a GB
    of un-checkpointed blocks: under checkpointing "auto" more fp8 blocks come first), says so, and train
    loads it as a MixedLoad."""
    from stages.core.runtime import MixedLoad, make_runtime

    model = _deeper_flux(assets, tmp_path, 2, 4, width=256)
    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"train.base_precision": "fp8", "data.resolution": 256,
                                                            "model": model, "runtime.gradient_checkpointing": True})
    roomy = _plan("train", cfg, 1000.0)
    assert roomy.settings["base_precision"] == "fp8" and "fp8_blocks" not in roomy.settings
    mixed = [t for t in roomy.tried if "fp8_blocks" in t]
    # under "auto" down to a quarter of the 6 blocks, rounded up: fewer fp8 blocks gain too little
    assert [t["fp8_blocks"] for t in mixed] == [5, 4, 3, 2] and all(t["base_precision"] == "fp8" for t in mixed)
    peaks = [t["predicted_peak_gb"] for t in mixed]
    assert roomy.predicted_peak_gb > peaks[0] and peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    plan = _plan("train", cfg, _just_above(peaks[2]))
    assert plan.fits and (plan.settings["fp8_blocks"], plan.settings["checkpointed_blocks"]) == (3, 6)
    assert f"fp8 for the first 3 of 6 blocks, nf4 for the other blocks and outside them: the whole fp8 base needs " \
           f"{roomy.predicted_peak_gb * memory.FRAGMENTATION:.1f} GB" in plan.note
    load = memory.load_device(plan, make_runtime("cpu", "bf16"))
    assert isinstance(load, MixedLoad) and load.fp8_blocks == 3
    assert not isinstance(memory.load_device(roomy, make_runtime("cpu", "bf16")), MixedLoad)
    auto = _plan("train", make_cfg("flux", assets, demo_data, tmp_path, **{
        "train.base_precision": "fp8", "data.resolution": 256, "model": model, "runtime.gradient_checkpointing": "auto"}), 1000.0)
    order = [(t.get("fp8_blocks"), t["checkpointed_blocks"]) for t in auto.tried]
    assert order.index((5, 6)) < order.index((4, 0))  # another fp8 block before fewer checkpointed ones
    fixed = _plan("train", make_cfg("flux", assets, demo_data, tmp_path, **{
        "train.base_precision": "fp8", "data.resolution": 256, "model": model, "train.fp8_blocks": 1}), 1000.0)
    assert fixed.settings["fp8_blocks"] == 1 and {t.get("fp8_blocks") for t in fixed.tried} == {1}
    assert "fp8 for the first 1 of 6 blocks, nf4 for the other blocks and outside them: train.fp8_blocks." in fixed.note
    every = _plan("train", make_cfg("flux", assets, demo_data, tmp_path, **{
        "train.base_precision": "fp8", "data.resolution": 256, "model": model, "train.fp8_blocks": 6}), 1000.0)
    assert every.settings["base_precision"] == "fp8" and not any("fp8_blocks" in t for t in every.tried)


def test_an_fp8_base_under_a_cap_keeps_fewer_fp8_blocks_to_leave_cuda_graphs_room(assets, demo_data, tmp_path, monkeypatch):
    """FLUX.2 klein's planned 22 of 25 fp8 blocks under the diffusers script's 5.74 GB left a capture too little
    room, so every step ran eager (and slower). Where the most fp8 blocks that fit leave too little room and
    checkpointing more cannot give it, the plan keeps the fewest fewer fp8 blocks that do (same checkpointing)
    and says so; where none does it keeps the most and says train runs eager. cuda_graphs = "off" and
    train.fp8_blocks set by hand plan the most fp8 blocks that fit, as before."""
    from stages.core import fastpath

    monkeypatch.setattr(memory.calibration, "GRAPH_FREE_SLACK_GB", 0.0)  # the measured allowances outweigh the tiny model
    monkeypatch.setattr(memory.calibration, "GRAPH_ACTIVATIONS_EXTRA_GB", 0.0)
    monkeypatch.delenv(fastpath.ENV, raising=False)
    want = fastpath.UNSWAPPED_CAPTURE_ROOM * memory.GRAPH_ROOM_MARGIN
    sets = {"train.base_precision": "fp8", "data.resolution": 256, "runtime.gradient_checkpointing": True,
            "model": _deeper_flux(assets, tmp_path, 4, 8, width=1024)}
    cfgs = {mode: make_cfg("flux", assets, demo_data, tmp_path, **sets, **{"runtime.cuda_graphs": mode}) for mode in ("auto", "off")}
    roomy = _plan("train", cfgs["off"], 1000.0)
    mixed = {t["fp8_blocks"]: t for t in roomy.tried if "fp8_blocks" in t}
    room_of = lambda t, gb: memory.graph_room(t["predicted_peak_gb"], t["activations_gb"], t["lora_grads_gb"],  # noqa: E731
                                              memory.Budget(gb, "cap"), swapped=False)
    seen = set()
    lo, hi = _just_above(min(t["predicted_peak_gb"] for t in mixed.values())), _just_above(roomy.predicted_peak_gb)
    for gb in [lo + (hi - lo) * i / 24 for i in range(24)]:
        auto, off = _plan("train", cfgs["auto"], gb), _plan("train", cfgs["off"], gb)
        m = off.settings["fp8_blocks"]
        assert "graph_room" not in off.settings
        got = auto.settings["fp8_blocks"]
        assert auto.fits and auto.settings["checkpointed_blocks"] == off.settings["checkpointed_blocks"]
        assert auto.predicted_peak_gb == mixed[got]["predicted_peak_gb"]
        if room_of(mixed[m], gb) >= want:
            assert got == m and "CUDA graphs" not in auto.note
            seen.add("room")
        elif got < m:
            assert auto.settings["graph_room"] == round(room_of(mixed[got], gb), 2) and room_of(mixed[got], gb) >= want
            assert f"{m - got} fewer block{'s' * (m - got > 1)} in fp8 than the budget allows" in auto.note
            assert all(room_of(mixed[j], gb) < want for j in range(got + 1, m))  # the fewest fewer that leave it
            seen.add("fewer")
        else:
            assert got == m and all(room_of(mixed[j], gb) < want for j in mixed if j <= m) and "else runs eager" in auto.note
            seen.add("eager")
        by_hand = make_cfg("flux", assets, demo_data, tmp_path, **sets, **{"train.fp8_blocks": m})
        assert _plan("train", by_hand, gb).settings["fp8_blocks"] == m
    assert seen == {"room", "fewer", "eager"}, seen


def test_a_cap_gives_the_allocator_expandable_segments_unless_the_user_configured_it(monkeypatch):
    """Under a cap the caching allocator gets expandable segments (set in the environment before CUDA starts):
    with torch's fixed segments FLUX.2 klein's planned run died of fragmentation in its first step under the
    cap. The user's own allocator settings (either of torch's names) win; no cap, no change; without CUDA,
    or once CUDA has started (too late), nothing is set."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert memory.allocator_for_cap(8.0, env := {}) is None and env == {}  # no CUDA: nothing to configure
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine before CUDA starts
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert memory.allocator_for_cap(8.0, env := {}) == "expandable_segments:True"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert memory.allocator_for_cap("auto", env := {}) is None and env == {}
    assert memory.allocator_for_cap(None, env := {}) is None and env == {}
    for name in memory.ALLOC_CONF_VARS:
        env = {name: "max_split_size_mb:128"}
        assert memory.allocator_for_cap(8.0, env) is None and env == {name: "max_split_size_mb:128"}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert memory.allocator_for_cap(8.0, env := {}) is None and env == {}
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert memory.allocator_summary(torch.device("cpu")) == "torch's default"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert memory.allocator_summary(torch.device("cpu")) == "PYTORCH_ALLOC_CONF=expandable_segments:True"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("user", ["", "max_split_size_mb:256"])
def test_a_capped_train_stage_runs_with_expandable_segments_unless_the_user_set_the_allocator(user, assets, demo_data,
                                                                                             tmp_path):
    """The stages in their own processes on the GPU under --vram 8: train's manifest says which allocator ran,
    expandable segments as the stage set them, or the user's own setting with fixed segments."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in memory.ALLOC_CONF_VARS}
    env.update({"HF_HUB_OFFLINE": "1", **({"PYTORCH_CUDA_ALLOC_CONF": user} if user else {})})
    args = ["--config", str(demo_config_path("flux")), "--model", str(tiny_model(assets, FAMILIES["flux"])),
            "--set", f"data.path={demo_data}", "--set", f"artifacts={tmp_path / 'artifacts'}", "--set", "train.steps=2",
            "--set", "device=cuda", "--set", "runtime.compile_transformer=off", "--vram", "8"]  # compile: minutes, beside the point
    done = subprocess.run([sys.executable, str(root / "pipeline.py"), "run", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = json.loads(next((tmp_path / "artifacts").glob("*/lora/final/manifest.json")).read_text())
    want = (f"PYTORCH_CUDA_ALLOC_CONF={user} (fixed segments)" if user else
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (expandable segments)")
    assert manifest["runtime"]["allocator"] == want


def test_allocator_retries_at_the_cap_get_a_warning_over_one_a_step():
    """More retries than steps under a cap is a warning naming the cap, the counts and what to change; as many
    as the steps or fewer, an "auto" budget (no cap), CPU or no steps is none."""
    cap = memory.Budget(5.74, "cap")
    note = memory.retries_note(230, 15, cap)
    assert note.startswith("the GPU allocator reached the 5.74 GB cap and flushed its cache 230 times in 15 steps")
    assert "a larger --vram (gpu.vram_budget_gb)" in note
    assert memory.retries_note(15, 15, cap) is None and memory.retries_note(0, 15, cap) is None
    assert memory.retries_note(230, 15, memory.Budget(40.0, "auto")) is None
    assert memory.retries_note(230, 15, memory.Budget(None, "cpu")) is None and memory.retries_note(3, 0, cap) is None


def test_the_plan_table_says_what_allocator_a_capped_stage_runs(monkeypatch, capsys):
    """`pipeline.py plan` under a cap says the stages will give the allocator expandable segments, or keep the
    user's setting; under "auto" it says nothing of it."""
    from stages.plan import allocator_line, print_table

    for name in memory.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    assert "torch's allocator with expandable_segments:True" in allocator_line()
    for source in ("cap", "auto"):
        stage = {"settings": {}, "predicted_peak_gb": 1.0, "predicted_total_gb": 2.0, "fits": True, "note": ""}
        print_table({"run": "r", "family": "flux", "budget_gb": 8.0, "budget_source": source, "allocator_gb": 7.1,
                     "context_gb": 0.9, "stages": [{**stage, "stage": "encode-captions", "context_gb": 0.7},
                                                   {**stage, "stage": "train", "context_gb": 0.9}]})
        out = " ".join(capsys.readouterr().out.split())
        assert ("expandable_segments:True" in out) == (source == "cap")
        assert "stage's CUDA context (encode-captions 0.70, train 0.90 GB)" in out
        assert ("each stage's plan fits torch's allocator into the number less that stage's CUDA context" in out) == (source == "cap")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:256")
    assert allocator_line() == "Under this cap the stages keep your allocator setting (PYTORCH_ALLOC_CONF=max_split_size_mb:256)."


def test_mixed_fp8_nf4_weight_bytes_match_the_built_base(assets, tmp_path):
    """The planner's bytes for a base with its first m blocks fp8 and the rest nf4 (memory.fp8_nf4_weight_bytes)
    are those of the model stages/core/fp8.py builds (nf4's absmax counted as the planner's 1/64 byte a weight)."""
    from diffusers import FluxTransformer2DModel

    from stages.core import fp8

    src = ModelSource(_deeper_flux(assets, tmp_path, 2, 2, width=256))
    meta = memory.meta_component(src, "transformer")
    sizes = memory.fp8_nf4_weight_bytes(meta)
    assert len(sizes) == 5 and sizes[0] == memory.weight_bytes(meta, "nf4") and sizes[0] < sizes[2] < sizes[4]
    model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(src.path / "transformer"))
    fp8.quantize_fp8_nf4(model.to(torch.bfloat16), 2, "cpu", double_quant=True)
    real = 0
    for m in model.modules():
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                real += t.numel() * t.element_size()
                if blockswap.quantized(t):  # nf4 codes (counted above) and their absmax
                    real += t.quant_state.absmax.numel() * t.quant_state.absmax.element_size()
    assert fp8.fp8_bytes(model) > 0 and abs(real - sizes[2]) / sizes[2] < 0.01, (real, sizes[2])


def test_a_cuda_crash_under_the_cudnn_attention_opt_in_names_the_setting_and_the_resume(assets, demo_data, tmp_path,
                                                                                          monkeypatch):
    """FLUX.1 Kontext's steps died in "an illegal memory access" with runtime.cudnn_attention = true: one line naming
    the setting and the command that resumes without it; the checkpoints before the crash are kept and that
    command finishes the run. Without the opt-in the same error stays a bug (a traceback)."""
    import shlex

    from click.testing import CliRunner

    from pipeline import cli
    from stages.core.artifacts import read_manifest

    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"train.steps": 3})
    args = ["--config", str(demo_config_path("flux")), "--model", cfg.model, "--set", f"data.path={demo_data}",
            "--set", f"artifacts={cfg.artifacts}", "--set", "device=cpu", "--set", "train.steps=3",
            "--set", "runtime.checkpoint_every=1"]
    for stage in ("encode-captions", "cache-latents"):
        assert CliRunner().invoke(cli, [stage, *args]).exit_code == 0
    crash = torch.AcceleratorError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                                   "asynchronously reported")
    monkeypatch.setattr("stages.core.faults.hit", _raise_at("train", 2, crash))
    result = CliRunner().invoke(cli, ["train", *args, "--set", "runtime.cudnn_attention=true"])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert ("train: a step died in a CUDA error (CUDA error: an illegal memory access was encountered) with "
            "runtime.cudnn_attention = true" in line), line
    assert "Traceback" not in result.output and "asynchronously" not in result.output
    resume = line.split("resume with `")[1].split("`")[0]
    assert shlex.split(resume)[:4] == ["lorapipe", "train", "--config", str(demo_config_path("flux"))]  # as named
    assert "--resume" in resume and "runtime.cudnn_attention=false" in resume
    from stages.train.checkpoints import complete_checkpoints

    assert [p.name for p in complete_checkpoints(lora_dir(cfg))] == ["checkpoint-1"]  # the step before it
    monkeypatch.undo()
    result = CliRunner().invoke(cli, shlex.split(resume)[1:])  # the printed command, as the user would paste it
    assert result.exit_code == 0, result.output
    final = read_manifest(lora_dir(cfg) / "final")
    assert final["step"] == 3 and final["complete"]

    monkeypatch.setattr("stages.core.faults.hit", _raise_at("train", 1, crash))
    result = CliRunner().invoke(cli, ["train", *args, "--force"])  # cuDNN attention off (the default)
    assert result.exit_code != 2 and isinstance(result.exception, torch.AcceleratorError)


def test_plan_exits_2_when_a_stage_cannot_fit(assets, demo_data, tmp_path):
    """A script or Makefile can tell from `plan`'s exit code whether every stage fits the budget."""
    from click.testing import CliRunner

    import pipeline

    args = ["plan", "--config", str(demo_config_path("flux")), "--model", str(tiny_model(assets, "flux-dev")),
            "--set", f"data.path={demo_data}", "--set", f"artifacts={tmp_path}", "--json"]
    fits = CliRunner().invoke(pipeline.cli, [*args, "--vram", "8"])
    assert fits.exit_code == 0 and json.loads(fits.stdout)["fits"], fits.output
    unfit = CliRunner().invoke(pipeline.cli, [*args, "--vram", "0.001"])
    assert unfit.exit_code == 2, unfit.output
    assert not json.loads(unfit.stdout)["fits"] and "cannot fit 0.00 GB" in unfit.stderr

    # a budget between train's total and sample's: sample, which a plain `run` leaves out, does not decide the exit
    total = {s["stage"]: s["predicted_total_gb"] for s in json.loads(fits.stdout)["stages"]}
    assert total["sample"] > max(v for k, v in total.items() if k != "sample"), total
    between = f"{(total['sample'] + max(v for k, v in total.items() if k != 'sample')) / 2:.4f}"
    apart = CliRunner().invoke(pipeline.cli, [*args, "--vram", between])
    assert apart.exit_code == 0, apart.output
    stages = {s["stage"]: s for s in json.loads(apart.stdout)["stages"]}
    assert json.loads(apart.stdout)["fits"] and not stages["sample"]["fits"] and not stages["sample"]["in_run"]
    assert "sample cannot fit" in apart.stderr and "a plain `lorapipe run` leaves it out" in apart.stderr
    asked = CliRunner().invoke(pipeline.cli, [*args, "--vram", between, "--set", "sample.after_train=true"])
    assert asked.exit_code == 2 and json.loads(asked.stdout)["stages"][-1]["in_run"], asked.output
    assert "plan: sample cannot fit" in asked.stderr


@pytest.mark.parametrize("vram", ["auto", 0.5])
def test_cache_fingerprints_ask_their_own_stage_planner_only(assets, demo_data, tmp_path, monkeypatch, vram):
    """encode-captions' and cache-latents' fingerprints (what `status` and train's staleness check compute)
    run their own stage's planner, never train's: under "auto" as well, where the stages themselves plan
    for train's predicted peak."""
    from stages import cache_latents, encode_captions

    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"gpu.vram_budget_gb": vram})
    monkeypatch.setattr(memory.planning, "plans_for_gpu", lambda cfg: True)  # a GPU run's fingerprints

    def refuse(*args, **kwargs):
        raise AssertionError("train's planner ran")

    monkeypatch.setitem(memory.PLANNERS, "train", dataclasses.replace(memory.PLANNERS["train"], plan=refuse))
    with pytest.raises(AssertionError, match="train's planner ran"):  # the stage's own "auto" plan does ask it
        memory.plan_for(cfg, get_family("flux"), ModelSource(cfg.model), memory.Budget(8.0, "auto"), "encode-captions")
    assert encode_captions.fingerprint_parts(cfg)["precision"] == "bf16"
    assert cache_latents.fingerprint_parts(cfg)["vae_precision"] == cfg.latents.vae_precision


def _wider_t5(assets, tmp_path) -> str:
    """The tiny FLUX's text encoders with a T5 of ~0.4 B parameters, so its bf16 and nf4 peaks lie apart by
    more than a budget's rounding."""
    from conftest import flux_with_t5

    return flux_with_t5(assets, tmp_path / "wider-t5", d_model=1024, d_ff=16384, num_layers=8, num_heads=16, d_kv=64)


def test_auto_captions_under_trains_peak_store_what_their_fingerprint_expects(assets, demo_data, tmp_path, monkeypatch):
    """Under "auto", encode-captions plans for train's predicted peak, but only in the precision its own
    planner gives with memory to spare (the one its fingerprint expects): where only nf4 encoders fit under
    that peak, it plans bf16 within the free memory instead of storing nf4 captions train would call stale."""
    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"gpu.vram_budget_gb": "auto", "model": _wider_t5(assets, tmp_path)})
    family, src = get_family("flux"), ModelSource(cfg.model)
    tried = memory.plan_captions(cfg, family, src, memory.Budget(float("inf"), "auto")).tried
    least = {p: min(t["predicted_peak_gb"] for t in tried if t["text_encoder_precision"] == p) for p in ("bf16", "nf4")}
    assert least["nf4"] * 2 < least["bf16"]
    peak = (least["nf4"] + least["bf16"]) / 2  # nf4 fits under train's peak, bf16 does not
    monkeypatch.setitem(memory.PLANNERS, "train", dataclasses.replace(
        memory.PLANNERS["train"], plan=lambda *a: memory.StagePlan("train", a[-1], {}, peak, True)))
    under_peak = memory.plan_captions(cfg, family, src, memory.Budget(round(peak * memory.FRAGMENTATION, 3), "auto"))
    assert under_peak.fits and under_peak.settings["text_encoder_precision"] == "nf4"
    plan = memory.plan_for(cfg, family, src, memory.Budget(1e6, "auto"), "encode-captions")
    assert plan.settings["text_encoder_precision"] == "bf16"
    monkeypatch.setattr(memory.planning, "plans_for_gpu", lambda cfg: True)
    assert memory.planned_caption_precision(cfg, family) == "bf16"  # what encode-captions' fingerprint expects


def test_the_cache_stages_record_their_plan_and_a_check_with_the_same_key_reads_it(assets, demo_data, tmp_path,
                                                                                  monkeypatch):
    """On a GPU the caches' fingerprints ask their planners (own_settings), which build the models on the meta device
    (diffusers and transformers: seconds of `status`). A cache's manifest records that plan with the key of what it
    depends on; a later check with the same key reads it and builds nothing, and one with another config or model
    plans again. The fingerprints are the same either way."""
    from stages import cache_latents, encode_captions
    from stages.core import runtime
    from stages.core.artifacts import atomic_write_json, manifest_path, read_manifest
    from stages.core.caches import captions_dir, latents_dir

    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"captions.text_encoder_precision": "auto",
                                                            "gpu.vram_budget_gb": 0.3})
    encode_captions.run(cfg), cache_latents.run(cfg)  # real manifests (on the CPU: no plan in them)
    assert "planned" not in read_manifest(captions_dir(cfg))
    monkeypatch.setattr(runtime, "pick_device", lambda name: torch.device("cuda"))  # plan as on a GPU (no CUDA call)
    monkeypatch.setattr(runtime, "device_type", lambda name: "cuda")
    family = get_family("flux")
    planned = {stage: memory.recorded_plan(cfg, family, stage) for stage in memory.RECORDED_PLANS}
    parts = encode_captions.fingerprint_parts(cfg), cache_latents.fingerprint_parts(cfg)
    for stage, folder in (("encode-captions", captions_dir(cfg)), ("cache-latents", latents_dir(cfg))):
        assert planned[stage]["planned"]["settings"] == memory.own_settings(cfg, family, stage)
        atomic_write_json(manifest_path(folder), {**read_manifest(folder), **planned[stage]})  # as a GPU run writes it
        assert read_manifest(folder)["planned"] == planned[stage]["planned"]
    calls = []
    for stage in memory.RECORDED_PLANS:
        planner = memory.PLANNERS[stage]
        counted = lambda *a, plan=planner.plan, stage=stage, **k: calls.append(stage) or plan(*a, **k)  # noqa: E731
        monkeypatch.setitem(memory.PLANNERS, stage, dataclasses.replace(planner, plan=counted))
    assert (encode_captions.fingerprint_parts(cfg), cache_latents.fingerprint_parts(cfg)) == parts
    assert calls == [], "the recorded plans were read, not planned again"
    other = dataclasses.replace(cfg, gpu=dataclasses.replace(cfg.gpu, vram_budget_gb=0.2))
    assert memory.plan_key(other, family) != memory.plan_key(cfg, family)
    encode_captions.fingerprint_parts(other), cache_latents.fingerprint_parts(other)
    assert sorted(set(calls)) == sorted(memory.RECORDED_PLANS), "another budget plans again"
