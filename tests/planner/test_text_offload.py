"""Layer offload of the text encoder in encode-captions (stages/core/memory/captions.py `_offload_candidates`,
stages/families/text_encoders.py `offload_kwargs`): chosen only when nf4 whole does not fit, loaded
through transformers' own device_map/max_memory, and placement only: the same rows and fingerprint.

The planner reads configs only, so a deeper, wider tiny Qwen2.5-VL config (no weights) stands in for
a large encoder whose layers outweigh its embeddings, as in the real 7B/24B ones.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import FAMILIES, make_cfg, tiny_model
from stages.core import memory
from stages.core.errors import ResourceError
from stages.core.model_source import ModelSource
from stages.core.runtime import OffloadLoad, Runtime
from stages.families import get_family


def _deep_qwen(assets, tmp_path) -> str:
    """The tiny Qwen-Image's text-encoder config with 24 decoder layers 256 wide (~48 MB bf16)."""
    src = tiny_model(assets, FAMILIES["qwen-image"])
    folder = tmp_path / "deep-qwen"
    if folder.exists():
        return str(folder)
    (folder / "text_encoder").mkdir(parents=True)
    (folder / "model_index.json").write_text((src / "model_index.json").read_text())
    config = json.loads((src / "text_encoder" / "config.json").read_text())
    config["text_config"].update(hidden_size=256, intermediate_size=1024, num_hidden_layers=24, num_attention_heads=4,
                                 num_key_value_heads=2, layer_types=["full_attention"] * 24)
    (folder / "text_encoder" / "config.json").write_text(json.dumps(config))
    return str(folder)


def _plan(cfg, gb: float) -> memory.StagePlan:
    return memory.plan_captions(cfg, get_family(cfg.family), ModelSource(cfg.model), memory.Budget(gb, "cap"))


def _deep_cfg(assets, demo_data, tmp_path, **overrides):
    return make_cfg("qwen-image", assets, demo_data, tmp_path, **{
        "model": _deep_qwen(assets, tmp_path), "captions.max_sequence_length": 64, "captions.batch_size": 2, **overrides})


def _nf4_b1(cfg) -> float:
    roomy = _plan(cfg, 1000.0)
    assert not any("gpu_weights_gb" in t for t in roomy.tried)  # a budget that fits whole never lists offload
    return next(t["predicted_peak_gb"] for t in roomy.tried if t["text_encoder_precision"] == "nf4" and t["batch_size"] == 1)


def test_offload_only_when_nf4_whole_does_not_fit(assets, demo_data, tmp_path):
    cfg = _deep_cfg(assets, demo_data, tmp_path)
    nf4_b1 = _nf4_b1(cfg)
    above = _plan(cfg, nf4_b1 * memory.FRAGMENTATION * 1.0001)
    assert above.fits and above.settings == {"text_encoder_precision": "nf4", "batch_size": 1}
    budgets = [nf4_b1 * memory.FRAGMENTATION * f for f in (0.999, 0.6, 0.35)]
    plans = [_plan(cfg, gb) for gb in budgets]
    for plan, gb in zip(plans, budgets):
        s = plan.settings
        assert plan.fits and s["text_encoder_precision"] == "bf16" and 0 < s["gpu_weights_gb"] and s["offload_gb"] > 0
        assert plan.predicted_peak_gb * memory.FRAGMENTATION <= gb  # never a plan over budget
        assert 0 < s["gpu_layers"] < s["layers"] == 26  # 24 decoder layers + the 2 vision blocks
    shares = [p.settings["gpu_weights_gb"] for p in plans]
    assert shares == sorted(shares, reverse=True) and plans[0].settings["gpu_layers"] > plans[-1].settings["gpu_layers"]
    # offload keeps the configured dense precision; nf4 is never offloaded
    assert _plan(_deep_cfg(assets, demo_data, tmp_path, **{"captions.text_encoder_precision": "fp32"}),
                 budgets[1]).settings["text_encoder_precision"] == "fp32"
    nf4 = _plan(_deep_cfg(assets, demo_data, tmp_path, **{"captions.text_encoder_precision": "nf4"}), budgets[1])
    assert not nf4.fits and "gpu_weights_gb" not in nf4.settings
    hopeless = _plan(cfg, nf4_b1 / 100)
    assert not hopeless.fits and "--vram" in hopeless.note
    assert hopeless.settings["gpu_weights_gb"] > 0 and hopeless.settings["gpu_layers"] >= 1  # the least offload plan


def test_family_without_offloadable_encoder_never_offloads(assets, demo_data, tmp_path):
    """SDXL loads its two CLIPs itself (no `text_offload_components`): its smallest plan is nf4 whole."""
    cfg = make_cfg("sdxl", assets, demo_data, tmp_path)
    plan = _plan(cfg, 1e-6)
    assert not plan.fits and not any("gpu_weights_gb" in t for t in plan.tried)


def test_offload_load_kwargs_give_transformers_the_planned_placement(assets, demo_data, tmp_path):
    """The stage's from_pretrained kwargs, fed to transformers' own device-map inference (what
    from_pretrained does with them), give exactly the device map the planner predicted."""
    from transformers.integrations.accelerate import _get_device_map

    from stages.families.text_encoders import offload_kwargs

    cfg = _deep_cfg(assets, demo_data, tmp_path)
    plan = _plan(cfg, _nf4_b1(cfg) * memory.FRAGMENTATION * 0.6)
    rt = memory.text_encoder_runtime(plan, Runtime(torch.device("cuda", 0), torch.bfloat16))
    assert isinstance(rt, OffloadLoad) and rt.device_bytes == int(plan.settings["gpu_weights_gb"] * memory.GB)
    kwargs = offload_kwargs(rt, plan.settings["text_encoder_precision"])
    assert kwargs["device_map"] == "auto" and set(kwargs["max_memory"]) == {0, "cpu"}
    assert kwargs["max_memory"][0] == rt.device_bytes and kwargs["max_memory"]["cpu"] > 0
    model = memory.meta_component(ModelSource(cfg.model), "text_encoder").to(torch.bfloat16)
    device_map = _get_device_map(model, kwargs["device_map"], {**kwargs["max_memory"], "cpu": memory.HOST_BYTES}, None)
    placed = memory.offload_placement(model, "bf16", plan.settings["gpu_weights_gb"])
    assert device_map == placed.device_map and {0, "cpu"} == set(device_map.values())
    assert memory.text_encoder_runtime(_plan(cfg, 1000.0), rt) is rt  # a whole plan loads as before
    with pytest.raises(ResourceError, match="nf4"):
        offload_kwargs(rt, "nf4")


def test_missing_accelerate_is_a_clear_error(assets, demo_data, tmp_path, monkeypatch):
    import importlib.util

    cfg = _deep_cfg(assets, demo_data, tmp_path)
    budget = _nf4_b1(cfg) * memory.FRAGMENTATION * 0.6
    plan = _plan(cfg, budget)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else find_spec(name, *a))
    with pytest.raises(ResourceError, match="pip install accelerate"):
        memory.text_encoder_runtime(plan, Runtime(torch.device("cuda", 0), torch.bfloat16))
    without = _plan(cfg, budget)  # the planner then offers no offload and says what would fit
    assert not without.fits and "install accelerate" in without.note


def _rows(cfg) -> dict[str, np.ndarray]:
    from stages.core.artifacts import read_manifest
    from stages.core.rowstore import RowStore

    out = cfg.run_dir / "captions.zarr"
    rows = read_manifest(out)["rows"]
    store = RowStore.open(out)
    return {cid: store.read_row(row) for cid, row in rows.items()}


def _force_offload(monkeypatch, device_gb: float) -> None:
    """An offload plan on a machine without a budget to plan for (CPU; on CPU the tier below is the
    disk): the stage then loads through the real offload path."""
    def plan_stage(cfg, family, stage, log):
        plan = memory.StagePlan(stage, memory.Budget(None, "cpu"), {
            "text_encoder_precision": cfg.captions.text_encoder_precision, "batch_size": cfg.captions.batch_size,
            "offload_gb": 0.0, "gpu_weights_gb": device_gb, "gpu_layers": 0, "layers": 0}, 0.0, True)
        log.emit("plan", **plan.to_dict())
        return memory.with_plan(cfg, plan), plan

    monkeypatch.setattr(memory, "plan_stage", plan_stage)


@pytest.mark.parametrize("family", ["qwen-image", "flux"])
def test_offloaded_encoder_writes_bit_identical_rows_on_cpu(family, assets, demo_data, tmp_path, monkeypatch):
    """The same captions encoded whole and with most of the encoder offloaded (accelerate's hooks copy
    each offloaded module's weights in for its forward): the same rows, bit for bit, and the same
    fingerprint. The offloaded load is checked to really be dispatched (on CPU the tier below is the disk)."""
    from stages import encode_captions
    from stages.core.model_source import model_source
    from stages.families.text_encoders import load_text_model

    whole = make_cfg(family, assets, demo_data, tmp_path / "whole", **{"device": "cpu"})
    encode_captions.run(whole)
    component = get_family(family).text_offload_components[0]
    size = sum(p.numel() * 4 for p in memory.meta_component(model_source(whole), component).parameters())
    device_gb = size * 0.6 / memory.GB
    cls = type(memory.meta_component(model_source(whole), component))
    model = load_text_model(cls, model_source(whole), component, whole.captions,
                            OffloadLoad(torch.device("cpu"), torch.float32, device_bytes=int(device_gb * memory.GB)))
    # really offloaded: the tiny Qwen2.5-VL keeps its first modules and offloads the rest; the tiny T5's
    # embedding (tied into its encoder) is half of it, so all of it is offloaded
    assert set(model.hf_device_map.values()) == ({"cpu", "disk"} if family == "qwen-image" else {"disk"})
    del model
    offloaded = make_cfg(family, assets, demo_data, tmp_path / "offloaded", **{"device": "cpu"})
    _force_offload(monkeypatch, device_gb)
    encode_captions.run(offloaded)
    events = [json.loads(line) for line in (offloaded.run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "plan" and e["settings"].get("gpu_weights_gb") == device_gb for e in events)
    want, got = _rows(whole), _rows(offloaded)
    assert want.keys() == got.keys() and len(want) > 1
    for cid in want:
        for field, array in want[cid].items():
            assert np.array_equal(array, got[cid][field]), (cid, field)
    assert encode_captions.fingerprint_parts(offloaded) == encode_captions.fingerprint_parts(whole)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_encoder_on_cuda_writes_bit_identical_rows(assets, demo_data, tmp_path, monkeypatch):
    """On a GPU: a bf16 Qwen-Image encoder with part of its layers in CPU memory writes the rows the
    whole bf16 encoder writes, bit for bit."""
    from stages import encode_captions
    from stages.core.model_source import model_source
    from stages.families.text_encoders import load_text_model
    from transformers import Qwen2_5_VLForConditionalGeneration

    sets = {"device": "cuda", "captions.text_encoder_precision": "bf16"}
    whole = make_cfg("qwen-image", assets, demo_data, tmp_path / "whole", **sets)
    encode_captions.run(whole)
    size = sum(p.numel() * 2 for p in memory.meta_component(model_source(whole), "text_encoder").parameters())
    device_gb = size * 0.6 / memory.GB
    model = load_text_model(Qwen2_5_VLForConditionalGeneration, model_source(whole), "text_encoder", whole.captions,
                            OffloadLoad(torch.device("cuda", 0), torch.bfloat16, device_bytes=int(device_gb * memory.GB)))
    assert {0, "cpu"} <= set(model.hf_device_map.values())
    del model
    offloaded = make_cfg("qwen-image", assets, demo_data, tmp_path / "offloaded", **sets)
    _force_offload(monkeypatch, device_gb)
    encode_captions.run(offloaded)
    want, got = _rows(whole), _rows(offloaded)
    assert want.keys() == got.keys()
    for cid in want:
        for field, array in want[cid].items():
            assert np.array_equal(array, got[cid][field]), (cid, field)
    assert encode_captions.fingerprint_parts(offloaded) == encode_captions.fingerprint_parts(whole)


def test_auto_budget_does_not_offload_to_stay_under_trains_peak(assets, demo_data, tmp_path):
    """Under an "auto" budget the cache stages plan for train's predicted peak, but never by offloading
    layers: a free GPU then encodes whole (offload only when the free memory itself forces it)."""
    import shutil

    cfg = _deep_cfg(assets, demo_data, tmp_path, **{"train.batch_size": 3, "data.resolution": 512})
    shutil.copytree(tiny_model(assets, FAMILIES["qwen-image"]) / "transformer", tmp_path / "deep-qwen" / "transformer",
                    dirs_exist_ok=True)
    family, src = get_family("qwen-image"), ModelSource(cfg.model)
    train = memory.plan_train(cfg, family, src, memory.Budget(1000.0, "cap")).predicted_peak_gb * memory.FRAGMENTATION
    assert train < _nf4_b1(cfg) * memory.FRAGMENTATION  # train's peak only an offload plan would fit
    assert _plan(cfg, train).fits and _plan(cfg, train).settings.get("offload_gb")  # what it would have taken
    plan = memory.plan_for(cfg, family, src, memory.Budget(1000.0, "auto"), "encode-captions")
    assert plan.fits and "offload_gb" not in plan.settings
