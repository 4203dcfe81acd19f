"""A pipeline folder built one stage's components at a time (bench/staged.py), as the bench does for
FLUX.2 dev, whose 112.6 GB the 1-GPU host cannot hold whole.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/bench/test_bench_staged.py

- a stand-in keeps a component's identity (what encode-captions and cache-latents fingerprinted, and
  train rechecks) while its weights are gone: same size and edges, a hole in between;
- the Runner builds exactly what each stage loads (the real `bench.py build` child process), writes a
  complete model_index.json and the other modules' configs (no weights) from the first build, and
  stands in what the next stage does not read; the real stages run in-process on that folder:
  encode-captions with no VAE or transformer weights there, train and export with the text encoder
  and the VAE stood in (their caches still up to date), and the export loads into Flux2Pipeline
  through bench/verify_export.py;
- the staged plan builds each component once and records fp8 as skipped at full size, with why.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench import staged
from bench.bench import Runner, _short_plan, plan, run_args
from conftest import FAMILIES, make_cfg, tiny_model
from stages.core.model_source import ModelSource
from stages.core.caches import export_dir

FAMILY = "flux2"


def test_a_stand_in_keeps_the_identity_and_drops_the_weights(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text("{}")
    (folder / "transformer" / "config.json").write_text('{"_class_name": "X", "width": 3}')
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    save_file({"w": torch.randn(2_000_000)}, str(weights))  # 8 MB: a middle the identity never reads
    before, size, data = ModelSource(str(folder)).identity(("transformer",)), weights.stat().st_size, weights.read_bytes()

    freed = staged.stand_in(folder, "transformer")

    assert ModelSource(str(folder)).identity(("transformer",)) == before
    after = weights.read_bytes()
    assert len(after) == size and after[:staged.EDGE] == data[:staged.EDGE] and after[-staged.EDGE:] == data[-staged.EDGE:]
    assert after[staged.EDGE:-staged.EDGE] == bytes(size - 2 * staged.EDGE) != data[staged.EDGE:-staged.EDGE]
    assert weights.stat().st_blocks * 512 < 3 * staged.EDGE and freed > size - 3 * staged.EDGE  # a hole, not zeros
    assert (folder / "transformer" / "config.json").read_text() == '{"_class_name": "X", "width": 3}'
    assert json.loads((folder / staged.STATE_FILE).read_text()) == {"transformer": "stand-in"}


def _runner(tmp_path: Path, models: Path, tiny: bool) -> Runner:
    return Runner(run_args(work=str(tmp_path / "w"), out=str(tmp_path / "out.json"), tiny=tiny, models=str(models)))


def _dirs(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_dir()}


def test_each_stage_runs_on_a_folder_holding_its_own_components(tmp_path: Path, assets: Path, demo_data: Path) -> None:
    from bench.verify_export import verify
    from stages import cache_latents, encode_captions, export_lora, train

    runner = _runner(tmp_path, tmp_path / "models", tiny=True)
    folder = runner.ensure_model(FAMILY, "encode")
    assert staged.read_state(folder, FAMILY) == {"text_encoder": "built", "vae": "config", "transformer": "config"}
    assert _dirs(folder) == {"tokenizer", "scheduler", "text_encoder", "vae", "transformer"}
    for name in ("vae", "transformer"):  # no weights, only what a stage may read of another component
        assert [f.name for f in (folder / name).iterdir()] == ["config.json"]
    reference = tiny_model(assets, FAMILIES[FAMILY])  # the whole tiny pipeline, saved by save_pretrained
    assert json.loads((folder / "model_index.json").read_text()) == json.loads((reference / "model_index.json").read_text())
    for name in ("text_encoder", "tokenizer"):  # the same seed: a rebuild makes the same files (same identity)
        assert {f.name: f.read_bytes() for f in (folder / name).iterdir()} == \
            {f.name: f.read_bytes() for f in (reference / name).iterdir()}
    cfg = make_cfg(FAMILY, assets, demo_data, tmp_path / "artifacts", model=str(folder), **{"train.steps": 2})
    encode_captions.run(cfg)

    assert runner.ensure_model(FAMILY, "latents") == folder
    assert staged.read_state(folder, FAMILY) == {"text_encoder": "stand-in", "vae": "built", "transformer": "config"}
    cache_latents.run(cfg)

    runner.ensure_model(FAMILY, "train")
    assert staged.read_state(folder, FAMILY) == {"text_encoder": "stand-in", "vae": "stand-in", "transformer": "built"}
    train.run(cfg)  # its upstream check recomputes the text encoder's and the VAE's identities: still the caches'
    export_lora.run(cfg)
    loaded = verify(str(folder), export_dir(cfg))
    assert loaded["ok"] and loaded["tensors_in_file"] > 0 and loaded["denoiser"] == "Flux2Transformer2DModel"

    assert runner.to_build(FAMILY, "export") == [] and runner.to_build(FAMILY, "encode") == ["text_encoder"]
    builds = json.loads((tmp_path / "out.json").read_text())["builds"]
    assert list(builds) == ["flux2/text_encoder", "flux2/vae", "flux2/transformer"]
    assert set(builds["flux2/transformer"]["stood_in_bytes_freed"]) == {"vae"}


def test_the_staged_plan_builds_each_component_once(tmp_path: Path) -> None:
    items = plan(FAMILY)
    ids = [i.id.split("/", 1)[1] for i in items]
    assert ids[:9] == ["encode/nf4", "latents/512", "latents/1024", "latents/512-ref1", "train/nf4-512-b1",
                       "export/nf4-512-b1", "verify/nf4-512-b1", "train/nf4-1024-b1", "train/nf4-512-b4"]
    assert ids[-2:] == ["train/fp8-1024-b1", "train/fp8-1024-b4"]  # the fp8 load streams the shards: no longer skipped for the host's RAM
    components = [staged.stage_components(FAMILY, i.kind) for i in items]
    assert [c for n, c in enumerate(components) if n == 0 or c != components[n - 1]] == \
        [("text_encoder",), ("vae",), ("transformer",)]  # never built twice
    assert sorted(i.id for i in items) == sorted(i.id for i in _short_plan(FAMILY))  # regrouped, nothing lost
