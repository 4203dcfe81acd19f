"""A tiled latents cache is never read as an untiled one (tiling moved the posterior mean of
random-weight VAEs by 24-81 % relative RMS on the H200, bench/results/tiling-h200.json).

The stages run in-process on CPU, planning as on a GPU: `memory.plans_for_gpu` says CUDA and
`memory.resolve_budget` reports a simulated free memory (or the cap) without touching CUDA, while
every tensor stays on the CPU. VAE tiles are 32 px so the demo's 64 px images really tile.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import make_cfg
from stages import cache_latents, encode_captions, train
from stages.core import memory
from stages.core.artifacts import ArtifactError, read_manifest
from stages.core.config import command
from stages.core.model_source import ModelSource
from stages.core.rowstore import RowStore
from stages import registry
from stages.core.stage import staleness
from stages.families import get_family


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def emit(self, event: str, **fields) -> None:
        self.events.append((event, fields))

    def warnings(self) -> list[str]:
        return [f["message"] for e, f in self.events if e == "warning"]


@pytest.fixture
def gpu(monkeypatch):
    """Plan as on a GPU with `gpu["free"]` GB free; returns the dict (change it between stages)."""
    state = {"free": 1000.0}

    def budget(setting, device, enforce=True, stage=None):
        value = memory.parse_budget(setting)
        if value == "auto":
            return memory.Budget(state["free"] - memory.AUTO_MARGIN_GB, "auto")
        return memory.Budget(value, "cap")

    monkeypatch.setattr(memory.planning, "plans_for_gpu", lambda cfg: True)
    monkeypatch.setattr(memory.budget, "resolve_budget", budget)
    monkeypatch.setattr(memory.calibration, "VAE_TILE_PIXELS", {"AutoencoderKL": 32})
    return state


def _cfg(assets, demo_data, tmp_path, **overrides):
    # fp32 everywhere: CPU runs what it plans; the captions' fingerprint does not ask the planner
    return make_cfg("flux", assets, demo_data, tmp_path, **{"latents.vae_precision": "fp32",
                                                             "captions.text_encoder_precision": "fp32", **overrides})


def _tiled_budget(cfg) -> float:
    """A budget just above the fp32 tiled encode's peak, below every untiled plan's."""
    plan = memory.plan_latents(cfg, get_family("flux"), ModelSource(cfg.model), memory.Budget(1000.0, "cap"))
    peaks = {(t["vae_precision"], t["sliced"], t["tiled"]): t["predicted_peak_gb"] for t in plan.tried}
    assert peaks[("fp32", True, True)] < min(p for (_, _, tiled), p in peaks.items() if not tiled)
    return peaks[("fp32", True, True)] * memory.FRAGMENTATION * 1.0001


def _means(cfg) -> dict[str, np.ndarray]:
    manifest = read_manifest(cache_latents.artifact_dir(cfg))
    out = cache_latents.artifact_dir(cfg)
    return {i: np.asarray(RowStore.open(out / loc["bucket"]).group["mean"][loc["row"]])
            for i, loc in manifest["index"].items()}


def test_a_capped_tiled_cache_is_what_train_expects_and_stale_for_an_untiled_config(assets, demo_data, tmp_path, gpu):
    cfg = _cfg(assets, demo_data, tmp_path)
    encode_captions.run(cfg)
    capped = _cfg(assets, demo_data, tmp_path, **{"gpu.vram_budget_gb": _tiled_budget(cfg)})
    manifest = cache_latents.run(capped)
    assert manifest["fingerprint_parts"]["vae_tiled"] is True and "memory_forced" not in manifest
    assert staleness(registry.get("cache-latents"), capped) == (True, [])
    train.check_upstream(capped)  # the same cap: train expects these tiled latents
    tiled_means = _means(capped)
    # the same cache for a config that does not tile (auto, plenty free): stale, and every row re-encoded
    ok, reasons = staleness(registry.get("cache-latents"), cfg)
    assert not ok and "vae_tiled: True -> False" in reasons, reasons
    with pytest.raises(ArtifactError, match="vae_tiled: True -> False"):
        train.check_upstream(cfg)
    manifest = cache_latents.run(cfg)
    assert manifest["fingerprint_parts"]["vae_tiled"] is False
    assert manifest["encoded_this_run"] == len(manifest["index"]) == len(tiled_means)
    untiled_means = _means(cfg)
    assert all(not np.allclose(untiled_means[i], tiled_means[i]) for i in tiled_means)  # tiling really changed them
    assert staleness(registry.get("cache-latents"), cfg) == (True, [])


def test_free_memory_forcing_a_tile_is_recorded_warned_and_accepted_by_train(assets, demo_data, tmp_path, gpu):
    cfg = _cfg(assets, demo_data, tmp_path)
    encode_captions.run(cfg)
    gpu["free"] = _tiled_budget(cfg) + memory.AUTO_MARGIN_GB  # "auto": only a tiled encode fits what is free
    assert cache_latents.layout_parts(cfg)["vae_tiled"] is False  # the config's own layout (what train expects) is untiled
    manifest = cache_latents.run(cfg)
    forced = manifest["memory_forced"]
    assert forced["parts"] == {"vae_tiled": True} and manifest["fingerprint_parts"]["vae_tiled"] is True
    need = memory.plan_latents(cfg, get_family("flux"), ModelSource(cfg.model), memory.Budget(1000.0, "cap"))
    need = next(t["predicted_peak_gb"] for t in need.tried if t["sliced"] and not t["tiled"] and t["vae_precision"] == "fp32")
    assert forced["message"].startswith(f"the free GPU memory forced a tiled encode on cache-latents: rerun it with "
                                        f"{need * memory.FRAGMENTATION + memory.AUTO_MARGIN_GB:.1f} GB of GPU memory free")
    assert f"the 'auto' budget was {gpu['free'] - memory.AUTO_MARGIN_GB:.2f} GB" in forced["message"]
    events = [json.loads(line) for line in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "warning" and e["message"] == forced["message"] for e in events)
    # status and `run` count it stale, with the reason; train uses it and says so
    assert staleness(registry.get("cache-latents"), cfg) == (False, [forced["message"]])
    log = Recorder()
    train.check_upstream(cfg, log)
    assert log.warnings() == [f"training on latents.zarr as it is: {forced['message']} "
                              f"(`{command(cfg, 'cache-latents')}`)"]
    # a rerun with as little free memory re-encodes nothing (no loop), and train still accepts it
    again = cache_latents.run(cfg)
    assert again["encoded_this_run"] == 0 and again["fingerprint"] == manifest["fingerprint"]
    train.check_upstream(cfg)
    # any other change is not excused by the forced tile
    with pytest.raises(ArtifactError, match="seed: 0 -> 1"):
        train.check_upstream(_cfg(assets, demo_data, tmp_path, seed=1))
    # with enough free memory the tiled rows are stale: all re-encoded untiled, nothing forced any more
    tiled = _means(cfg)
    gpu["free"] = 1000.0
    rebuilt = cache_latents.run(cfg)
    assert rebuilt["encoded_this_run"] == len(rebuilt["index"]) and "memory_forced" not in rebuilt
    assert rebuilt["fingerprint_parts"]["vae_tiled"] is False
    assert all(not np.allclose(m, tiled[i]) for i, m in _means(cfg).items())
    assert staleness(registry.get("cache-latents"), cfg) == (True, [])


def test_gpus_that_plan_different_encodes_refuse_to_share_one_cache(assets, demo_data, tmp_path, gpu, monkeypatch):
    """Under "auto" each rank plans from its own GPU's free memory; a rank that would tile while rank
    0 does not (simulated: the gathered plans differ) stops the stage before any row is written."""
    from stages.core import distributed
    from stages.core.errors import ResourceError

    gather = distributed.all_gather
    other = ("0" * 16, {"vae_precision": "fp32", "sliced": True, "tiled": True})
    monkeypatch.setattr(distributed, "all_gather",
                        lambda obj, d: [obj, other] if isinstance(obj, tuple) else gather(obj, d))
    cfg = _cfg(assets, demo_data, tmp_path)
    with pytest.raises(ResourceError, match=r"planned VAE settings that give different latents .*rank 1: \{'vae_precision': "
                                            r"'fp32', 'sliced': True, 'tiled': True\}.*set gpu.vram_budget_gb"):
        cache_latents.run(cfg)
    assert read_manifest(cache_latents.artifact_dir(cfg)) is None


def test_only_free_memory_forces_and_a_lower_precision_is_named_too(assets, demo_data, tmp_path, gpu):
    """`forced_by_memory`: an "auto" plan that lowers the VAE to bf16 is forced (named as such); the
    same plan under a cap is not (train plans the same cap, so it expects it); nor is a roomy one."""
    cfg = _cfg(assets, demo_data, tmp_path)
    family, src = get_family("flux"), ModelSource(cfg.model)
    roomy = memory.plan_latents(cfg, family, src, memory.Budget(1000.0, "cap"))
    bf16 = next(t["predicted_peak_gb"] for t in roomy.tried if t["vae_precision"] == "bf16" and not t["tiled"])
    gb = bf16 * memory.FRAGMENTATION * 1.0001
    auto = memory.plan_for(cfg, family, src, memory.Budget(gb, "auto"), "cache-latents")
    assert auto.settings == {"vae_precision": "bf16", "sliced": True, "tiled": False}
    assert memory.forced_by_memory(cfg, auto).startswith("the free GPU memory forced the VAE in bf16 on cache-latents")
    assert memory.forced_by_memory(cfg, memory.plan_for(cfg, family, src, memory.Budget(gb, "cap"), "cache-latents")) is None
    assert memory.forced_by_memory(cfg, memory.plan_for(cfg, family, src, memory.Budget(1000.0, "auto"), "cache-latents")) is None
