"""Wan 2.2 T2V-A14B against its own diffusers pipeline (WanPipeline with two experts), on the tiny real architecture.

    .venv/bin/python -m pytest tests/families/test_family_wan22_14b.py -q

- caption rows equal `encode_prompt`'s embeds;
- train.expert loads the expert the pipeline runs on its side of boundary_ratio, and one training forward there
  sees what the pipeline hands that expert at the same noisy latents (timestep sigma x 1000 per sample) and gives
  the same prediction, for either expert;
- training sigmas lie on the scheduler's flow_shift curve, each expert's only on its own side of the boundary,
  stratified draws included;
- the Wan 2.1 VAE: 16 channels, 8 px and 4 frames a latent cell, normalization the decode's inverse;
- the config checks (no expert, DoRA on the low expert, an expert on a one-denoiser family, timestep_min/max, frames);
- a low-noise run end to end: its export loads into transformer_2 only (`load_into_transformer_2`), applies the
  trained delta there, passes export --verify, names its ComfyUI file for the expert, and `sample` renders through
  both experts with the LoRA on the low-noise one; the planners count one expert to train and two to sample;
- train.expert = "both": one run trains high's adapter then low's (lora/high/, lora/low/), each on its own sigmas,
  stops and resumes in the low phase, skips a finished expert, equals single-expert runs (high -> "both" trains
  low alone; "low" finds it up to date); its export writes each expert's files, which load in WanPipeline with
  every key and the trained delta on the right expert, and `sample` puts each LoRA on its own expert; its kohya
  files are named for their expert (`lora_high_noise_kohya.safetensors`), which the export's up-to-date check and
  removal of a replaced adapter's files find.
"""

from __future__ import annotations

import json

import diffusers
import pytest
import torch

from conftest import FAMILIES, run_beside, tiny_model, trained_denoiser
from stages.core import flow
from stages.core.config import CaptionsConfig, TrainConfig
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family
from stages.families.base import BatchMeta
from stages.core.caches import export_dir, lora_dir

NAME = "wan2.2-14b"
CAPTIONS = ["a red circle", "a  large blue square &amp; a green triangle moving right across a white background"]
CPU = make_runtime("cpu", "fp32")


@pytest.fixture(scope="module")
def wan(assets):
    folder = tiny_model(assets, FAMILIES[NAME])
    pipe = diffusers.WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return get_family(NAME), folder, pipe


def _meta(b: int) -> BatchMeta:
    z = torch.zeros(b, 2, dtype=torch.long)
    return BatchMeta(z, z, z)


def test_text_encoding_matches_pipeline(wan):
    family, folder, pipe = wan
    encoder = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=16), CPU)
    ours = encoder.encode(CAPTIONS)["prompt_embeds"]
    with torch.no_grad():
        theirs, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, max_sequence_length=16, device="cpu")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("expert, component", [("high", "transformer"), ("low", "transformer_2")])
def test_training_forward_is_the_experts(wan, expert, component):
    """Every transformer call of a 4-step render, captured: the pipeline runs `transformer` at t >= 875 and
    `transformer_2` below; the expert train.expert loads reproduces that expert's prediction at its first step."""
    family, folder, pipe = wan
    tcfg = TrainConfig(expert=expert, shift=pipe.scheduler.config.flow_shift)
    embeds = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=16),
                                      CPU).encode(CAPTIONS[:1])["prompt_embeds"]
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 3, 4, 6, generator=g)  # 9 frames of 48 x 32 px
    calls = []
    hooks = [getattr(pipe, c).register_forward_hook(
        lambda m, a, k, out, c=c: calls.append((c, k["timestep"].clone(), k["hidden_states"].clone(), out[0])),
        with_kwargs=True) for c in ("transformer", "transformer_2")]
    try:
        with torch.no_grad():
            pipe(prompt_embeds=embeds, guidance_scale=1.0, num_frames=9, height=32, width=48, latents=latents.clone(),
                 num_inference_steps=4, output_type="latent")
    finally:
        for h in hooks:
            h.remove()
    assert [c for c, *_ in calls] == ["transformer"] * 2 + ["transformer_2"] * 2  # t 999, 900 | 750, 500 at shift 3
    assert all((t >= 875).all() == (c == "transformer") for c, t, *_ in calls)
    _, given, x_t, out = next(call for call in calls if call[0] == component)
    assert given.shape == (1,) and torch.equal(family.timestep(given.float() / 1000, latents, (1, 2, 2)), given.float())
    sigma = given.float() / 1000
    x0 = torch.randn(latents.shape, generator=g)
    noise = (x_t - (1 - sigma) * x0) / sigma  # so that flow.noisy_latents(x0, noise, sigma) is what the expert saw
    model = family.load_denoiser(ModelSource(str(folder)), "fp32", CPU, tcfg)
    with flow.captured_prediction() as box, torch.no_grad():
        family.loss(model, x0, noise, sigma, {"prompt_embeds": embeds}, _meta(1), tcfg)
    torch.testing.assert_close(box[0], out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("buckets", [0, 8])
def test_each_expert_draws_only_its_own_sigmas(wan, buckets):
    """On the scheduler's flow_shift curve, each expert only on its side of the boundary, covering it."""
    family, _, pipe = wan
    shift, boundary = pipe.scheduler.config.flow_shift, pipe.config.boundary_ratio
    assert (shift, boundary) == (3.0, 0.875)
    table = flow.sigma_table(shift)
    for expert in ("high", "low"):
        tcfg = TrainConfig(expert=expert, shift=shift, timestep_density="uniform", timestep_buckets=buckets)
        t = family.sample_timesteps(8192, (4, 4), torch.Generator().manual_seed(0), tcfg, first=0)
        assert torch.isin(t, table).all(), "every sigma is a row of the shifted table"
        runs_high = t * 1000 >= boundary * 1000  # WanPipeline: t >= boundary_ratio x num_train_timesteps
        assert runs_high.all() if expert == "high" else not runs_high.any()
        side = table[table >= boundary] if expert == "high" else table[table < boundary]
        assert float(t.max()) == float(side.max()) and float(t.min()) == float(side.min()), "the whole side is drawn"


def test_wan21_vae_and_normalization(wan):
    family, folder, pipe = wan
    vae = family.load_vae(ModelSource(str(folder)), CPU)
    pixels = torch.rand(1, 3, 9, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mean, logvar = family.encode_posterior(vae, pixels)
    assert mean.shape == logvar.shape == (1, 16, 3, 8, 12)  # 8 px and 4 frames a latent cell, 16 channels
    assert family.encode_posterior(vae, pixels[:, :, 0])[0].shape == (1, 16, 1, 8, 12)  # an image: one frame
    norm = family.latent_normalization(pipe.vae)
    z = torch.randn(2, 16, 3, 2, 2)
    mean_c = torch.tensor(pipe.vae.config.latents_mean).view(1, 16, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 16, 1, 1, 1)
    x = family.normalize_latents(z, norm)
    torch.testing.assert_close(x / inv_std + mean_c, z, rtol=1e-5, atol=1e-5)  # the pipeline's decode line
    assert family.pixel_multiple(ModelSource(str(folder))) == 16


@pytest.mark.parametrize("overrides, wanted", [
    ({"train.expert": ""}, ["train.expert = ''", "'both'", "'high'", "'low'"]),
    ({"train.expert": "low", "train.timestep_max": 0.5}, ["train.timestep_min/max", "leave them 0 and 1"]),
    ({"train.expert": "high", "data.frames": 32}, ["data.frames = 32", "33"]),
    ({"family": "flux", "train.expert": "high"}, ["train.expert = 'high'", "one denoiser", "remove train.expert"]),
])
def test_config_checks(tmp_path, overrides, wanted):
    from stages.core.config import load_config
    from stages.core.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, {"family": NAME, "model": str(tmp_path), **overrides})
    assert all(w in str(e.value) for w in wanted), e.value


def test_presets_match_the_pipeline(wan):
    from stages.core.config import load_config

    _, folder, pipe = wan
    for preset in ("configs/wan2.2-14b.toml", "configs/demo-wan2.2-14b.toml"):
        cfg = load_config(preset, {"model": str(folder)})
        assert cfg.train.expert == "both" and cfg.train.shift == pipe.scheduler.config.flow_shift  # one adapter each
    preset = load_config("configs/wan2.2-14b.toml", {"model": str(folder)})
    assert preset.model == str(folder) and preset.run == NAME


@pytest.mark.parametrize("built_run", [NAME], indirect=True)
def test_low_noise_run_exports_and_samples_on_transformer_2(built_run):
    from stages import export_lora, sample, train
    from stages.core.comfyui_file import comfyui_file_name
    from stages.core.events import Progress
    from test_family import _denoiser_output

    cfg = run_beside(built_run, "low", **{"train.expert": "low", "train.steps": 3, "export.verify": True})
    family = get_family(NAME)
    train.run(cfg)
    manifest = export_lora.run(cfg)  # --verify: the diffusers file in WanPipeline's loader, the ComfyUI file's keys
    comfy = comfyui_file_name(cfg.run, tag="low_noise")
    assert manifest["files"] == [export_lora.DIFFUSERS_FILE, comfy] and comfy.endswith("_low_noise_comfyui.safetensors")
    assert manifest["checks"][comfy]["keys_loaded"] == manifest["checks"][comfy]["keys"]

    in_memory = trained_denoiser(cfg, lora_dir(cfg) / "final")
    pipe = diffusers.WanPipeline.from_pretrained(cfg.model)
    pipe.set_progress_bar_config(disable=True)
    base_low, base_high = (_denoiser_output(cfg, family, getattr(pipe, c)) for c in ("transformer_2", "transformer"))
    cfg.sample.steps, cfg.sample.seeds = 4, [0]
    file = export_dir(cfg) / export_lora.DIFFUSERS_FILE
    with Progress("sample", 2, "images") as bar:
        base_clip = sample.render_column(pipe, cfg, ["a red circle"], (64, 64), bar)
        labels, cells, _ = sample.render_columns(pipe, cfg, [("LoRA", [(file, family.lora_load_kwargs(cfg.train))])],
                                                 ["a red circle"], (64, 64), None)
    assert pipe.get_list_adapters() == {"transformer_2": ["col0"]}, "the LoRA sits on the low-noise expert only"
    got = _denoiser_output(cfg, family, pipe.transformer_2)
    torch.testing.assert_close(got, _denoiser_output(cfg, family, in_memory), rtol=1e-5, atol=1e-5)
    assert (got - base_low).abs().max() > 1e-4, "the LoRA changed nothing: the test cannot tell files apart"
    torch.testing.assert_close(_denoiser_output(cfg, family, pipe.transformer), base_high, rtol=0, atol=0)
    assert labels == ["base", "LoRA"] and len(cells[1][0]) == 5  # a 5-frame clip through both experts
    import numpy as np

    assert np.array_equal(np.asarray(cells[0][0][0]), np.asarray(base_clip[0][0]))
    assert not np.array_equal(np.asarray(cells[1][0][-1]), np.asarray(cells[0][0][-1])), "the LoRA shows in the clip"


@pytest.mark.parametrize("built_run", [NAME], indirect=True)
def test_a_dora_low_expert_file_folds_transformer_2s_weights(built_run):
    """DoRA's ComfyUI file carries m x ||W|| / ||W + dW|| from the base it trained on: for the low-noise expert
    transformer_2's weights. Read through the ComfyUI check with transformer_2 as the base, every module gets
    peft's own merged delta of the trained adapter; with `transformer`'s weights it would not."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import load_file

    from stages import export_lora, train
    from stages.core import comfyui
    from stages.core.comfyui_file import comfyui_file_name
    from stages.core.verify import comfyui_key_map

    cfg = run_beside(built_run, "dora-low", **{"train.expert": "low", "train.adapter": "dora", "train.steps": 2,
                                               "export.verify": True})
    train.run(cfg)
    manifest = export_lora.run(cfg)  # --verify passes: every file applies the trained delta in its reader
    final = lora_dir(cfg) / "final"
    trained_on = trained_denoiser(cfg, final)
    bases = {c: {n: m.weight.detach().clone() for n, m in getattr(pipe_part, "named_modules")()
                 if isinstance(m, torch.nn.Linear)}
             for c, pipe_part in (("transformer", diffusers.WanTransformer3DModel.from_pretrained(cfg.model, subfolder="transformer")),
                                  ("transformer_2", diffusers.WanTransformer3DModel.from_pretrained(cfg.model, subfolder="transformer_2")))}
    merged = {}
    for name, module in trained_on.named_modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
            merged[name] = module.get_base_layer().weight.detach() - bases["transformer_2"][name]
    tensors = load_file(str(export_dir(cfg) / comfyui_file_name(cfg.run, tag="low_noise")))
    assert any(k.endswith(".dora_scale") for k in tensors)
    kmap = comfyui_key_map(cfg, json.loads((final / "manifest.json").read_text()))
    right = comfyui.check("low", tensors, kmap, merged, base=bases["transformer_2"].__getitem__)
    assert right.problems() == [] and sorted(right.strength) == sorted(merged), right.problems()
    assert all(abs(r - 1) < 1e-3 and e < 1e-3 for r, e in right.strength.values()), right.strength
    wrong = comfyui.check("high", tensors, kmap, merged, base=bases["transformer"].__getitem__)
    assert any(e > 1e-2 for _, e in wrong.strength.values()), "the two experts' bases must differ for this to tell"
    assert manifest["checks"]


def _adapter(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("built_run", [NAME], indirect=True)
def test_both_experts_train_in_one_run_on_their_own_sigmas_stop_and_resume_in_the_second(built_run, monkeypatch):
    """train.expert = "both": high's adapter, then low's, in one `train` on the same caches, each only on its side of
    the boundary. Stopped in the low phase (SIGTERM after its 2nd step) and resumed, it ends with the adapters of a
    run that trained high alone and then switched to "both" (which trains low only): each expert's adapter is a
    single-expert run's, and the resume is exact. A finished both-run is up to date, and so is "low" alone."""
    import pipeline
    from stages import registry, run_settings, train
    from stages.core import faults
    from stages.core.stage import staleness
    from stages.families.wan22_14b.family import Wan22_14B

    drawn: list[tuple[str, torch.Tensor]] = []
    draw = Wan22_14B.sample_timesteps
    monkeypatch.setattr(Wan22_14B, "sample_timesteps", lambda self, n, hw, g, tcfg, first=None: drawn.append(
        (tcfg.expert, t := draw(self, n, hw, g, tcfg, first))) or t)
    steps = {"train.steps": 3, "runtime.checkpoint_every": 2, "runtime.log_every": 1}
    cfg = run_beside(built_run, "both", **{"train.expert": "both", **steps})
    high, low = registry.each_expert(cfg)
    monkeypatch.setenv(faults.ENV, "train:5:TERM")  # high's 3 steps, then low's 2nd
    stopped = train.run(cfg)
    assert stopped["stopped"] and stopped["expert"] == "low" and stopped["step"] == 2
    assert stopped["experts"]["high"]["complete"] and stopped["experts"]["high"]["step"] == 3
    order = [e for e, _ in drawn]  # each step's draw (and the next one's, read ahead while it runs)
    assert order == sorted(order) and order.count("high") >= 3 and order.count("low") >= 2, order  # high, then low
    assert all((t >= 0.875).all() if e == "high" else (t < 0.875).all() for e, t in drawn), "each on its own side"
    ok, reasons = staleness(registry.get("train"), cfg)
    assert not ok and reasons == [r for r in reasons if r.startswith("expert low: ")] and "--resume" in reasons[0]
    assert pipeline._train_calls(cfg, False) == [["--resume"]]
    high_final = (lora_dir(high) / "final" / "manifest.json").stat().st_mtime_ns

    monkeypatch.delenv(faults.ENV)
    done = train.run(cfg, resume=True)  # high is up to date, low continues from its checkpoint-2
    assert done["experts"]["high"]["up_to_date"] and done["complete"] and done["step"] == 3
    assert (lora_dir(high) / "final" / "manifest.json").stat().st_mtime_ns == high_final
    assert {e for e, _ in drawn[len(order):]} == {"low"}  # the resume trains low's third step alone
    assert train.run(cfg)["up_to_date"], "a finished both-run trains nothing"
    assert staleness(registry.get("train"), low)[0], "switching to train.expert = 'low' finds low up to date"
    assert run_settings.made_stale(cfg, low) == [] and run_settings.made_stale(high, cfg) == ["train"]  # `config`'s diff

    switch = run_beside(built_run, "switch", **{"train.expert": "high", **steps})
    train.run(switch)
    switch = _same_run(switch, "both")
    assert pipeline._train_calls(switch, False) == [["--resume"]]  # `lorapipe run`: low is new, high up to date
    trained = train.run(switch)  # high from the single-expert run is up to date; only low trains
    assert trained["experts"]["high"]["up_to_date"] and not trained["experts"]["low"].get("up_to_date")
    for unit, expert in zip(registry.each_expert(switch), ("high", "low")):
        assert _same(_adapter(lora_dir(unit) / "final"), _adapter(lora_dir(cfg, expert) / "final")), expert

    other = _same_run(switch, "low")
    other.train.learning_rate *= 2
    kept = sorted((p.name, p.stat().st_mtime_ns) for p in lora_dir(switch, "high").rglob("*"))
    train.run(other, restart=True)  # low of other settings: `run` restarts low alone, never the up-to-date high
    assert sorted((p.name, p.stat().st_mtime_ns) for p in lora_dir(switch, "high").rglob("*")) == kept
    assert pipeline._train_calls(switch, False) == [["--once", "train.expert=low", "--restart"]]


@pytest.mark.parametrize("built_run", [NAME], indirect=True)
def test_both_run_exports_each_expert_and_samples_each_lora_on_its_own(built_run, tmp_path):
    """export-lora of a both-run writes each expert's files (export/high/, export/low/, their ComfyUI files named for
    the expert, checked by --verify); in WanPipeline's own load_lora_weights each diffusers file loads every key it
    holds, none missing or added, onto its expert only (the low one with load_into_transformer_2=True), and applies
    exactly the trained delta there; `sample` puts each LoRA on its own expert in every column."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from stages import export_lora, registry, sample, train
    from stages.core.artifacts import read_manifest
    from stages.core.comfyui_file import comfyui_file_name
    from test_family import _denoiser_output

    cfg = run_beside(built_run, "both-export", **{"train.expert": "both", "train.steps": 3, "export.verify": True,
                                                 "runtime.checkpoint_every": 2, "sample.every_n_checkpoints": 1})
    train.run(cfg)
    export_lora.run(cfg)
    family, units = get_family(NAME), registry.each_expert(cfg)
    components = {"high": "transformer", "low": "transformer_2"}

    def trained(unit):  # the expert with its trained adapter, in memory
        return _denoiser_output(unit, family, trained_denoiser(unit, lora_dir(unit) / "final"))

    want = {unit.train.expert: trained(unit) for unit in units}
    pipe = diffusers.WanPipeline.from_pretrained(cfg.model)
    base = {unit.train.expert: _denoiser_output(unit, family, getattr(pipe, components[unit.train.expert]))
            for unit in units}
    for unit in units:
        expert, folder = unit.train.expert, export_dir(unit)
        comfy = comfyui_file_name(cfg.run, tag=f"{expert}_noise")
        manifest = read_manifest(folder)
        assert manifest["files"] == [export_lora.DIFFUSERS_FILE, comfy], manifest["files"]
        assert manifest["checks"][comfy]["keys_loaded"] == manifest["checks"][comfy]["keys"] > 0
        pipe.load_lora_weights(str(folder), adapter_name=expert, **({"load_into_transformer_2": True} if expert == "low" else {}))
        file = load_file(str(folder / export_lora.DIFFUSERS_FILE))
        loaded = get_peft_model_state_dict(getattr(pipe, components[expert]), adapter_name=expert)
        assert sorted(f"transformer.{k}" for k in loaded) == sorted(file), "keys missing or unexpected"
        assert all(torch.equal(v, file[f"transformer.{k}"]) for k, v in loaded.items())
    assert pipe.get_list_adapters() == {"transformer": ["high"], "transformer_2": ["low"]}
    for expert, component in components.items():
        got = _denoiser_output(units[0] if expert == "high" else units[1], family, getattr(pipe, component))
        torch.testing.assert_close(got, want[expert], rtol=1e-5, atol=1e-5)
        assert (got - base[expert]).abs().max() > 1e-4, "the LoRA changed nothing: the test cannot tell files apart"

    columns = sample.adapters(cfg, tmp_path)
    assert [(label, len(files)) for label, files in columns] == [("checkpoint-2", 2), ("LoRA (step 3)", 2)]
    cfg.sample.steps, cfg.sample.seeds = 4, [0]
    pipe = diffusers.WanPipeline.from_pretrained(cfg.model)
    pipe.set_progress_bar_config(disable=True)
    labels, cells, _ = sample.render_columns(pipe, cfg, columns, ["a red circle"], (64, 64), None)
    assert labels == ["base", "checkpoint-2", "LoRA (step 3)"] and len(cells[2][0]) == 5
    assert pipe.get_list_adapters() == {"transformer": ["col0", "col1"], "transformer_2": ["col0", "col1"]}
    for unit in units:  # the final column is the active one: each expert carries its own LoRA
        got = _denoiser_output(unit, family, getattr(pipe, components[unit.train.expert]))
        torch.testing.assert_close(got, want[unit.train.expert], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("built_run", [NAME], indirect=True)
def test_each_experts_kohya_file_is_named_for_it(built_run):
    """--format kohya on a both-run: each expert's kohya file is named for it, as its ComfyUI file is, so the two
    never share a name. The export's up-to-date check finds them; an export without kohya keeps them while the
    adapter is the same, and one of a new adapter removes that expert's by name."""
    import dataclasses

    from stages import export_lora, registry, train
    from stages.core.artifacts import read_manifest
    from stages.core.events import read_events
    from stages.core.stage import staleness

    cfg = run_beside(built_run, "both-kohya", **{"train.expert": "both", "train.steps": 2, "runtime.checkpoint_every": 0,
                                                "export.format": "kohya"})
    train.run(cfg)
    export_lora.run(cfg)
    units = registry.each_expert(cfg)
    kohya = {unit.train.expert: [f for f in read_manifest(export_dir(unit))["files"] if export_lora.file_format(f) == "kohya"]
             for unit in units}
    assert kohya == {"high": ["lora_high_noise_kohya.safetensors"], "low": ["lora_low_noise_kohya.safetensors"]}
    assert all((export_dir(unit) / kohya[unit.train.expert][0]).is_file() for unit in units)
    assert staleness(registry.get("export-lora"), cfg) == (True, [])
    written = {unit.train.expert: (export_dir(unit) / "manifest.json").stat().st_mtime_ns for unit in units}
    export_lora.run(cfg)
    assert {u.train.expert: (export_dir(u) / "manifest.json").stat().st_mtime_ns for u in units} == written, "up to date"

    low = _same_run(cfg, "low")
    low.train.learning_rate *= 2
    train.run(low, restart=True)  # a new low adapter; high's is the same
    diffusers_only = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, format="diffusers"))
    export_lora.run(diffusers_only)
    assert (export_dir(units[0]) / kohya["high"][0]).is_file(), "kept: of the same adapter"
    assert not (export_dir(units[1]) / kohya["low"][0]).exists(), "removed: of the adapter the export replaced"
    warnings = [e["message"] for e in read_events(cfg.run_dir) if e["event"] == "warning"]
    assert any(m.startswith("removed export/low/lora_low_noise_kohya.safetensors, the kohya file") for m in warnings), warnings


def _same_run(cfg, expert: str):
    """The same run folder with train.expert changed, as `--set train.expert=...` by name would give it."""
    import dataclasses

    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, expert=expert))


def test_planners_count_frames_and_both_experts_to_sample(wan, tmp_path):
    """Tokens at 16 px and 4 frames a cell; sample's plan holds both experts' weights (the pipeline loads both)."""
    from stages.core import memory
    from stages.core.config import load_config
    from stages.core.memory import calibration as cal
    from stages.core.memory.sizes import latent_frames, meta_component, sample_tokens, weight_bytes

    family, folder, _ = wan
    assert [latent_frames(family, f) for f in (1, 9, 33, 81)] == [1, 3, 9, 21]
    assert sample_tokens(family, 832, 480, 81) == 52 * 30 * 21  # Wan 2.2 A14B: 16 px a token, 21 latent frames
    src = ModelSource(str(folder))
    cfg = load_config("configs/demo-wan2.2-14b.toml", {"model": str(folder), "artifacts": str(tmp_path),
                                                       "sample.precision": "bf16", "sample.cpu_offload": False})
    one_expert = type("OneExpert", (type(family),), {"denoiser_components": ("transformer",)})()
    two, one = (memory.plan_sample(cfg, f, src, memory.Budget(1000.0, "cap")).predicted_peak_gb * cal.GB
                for f in (family, one_expert))
    expert = weight_bytes(meta_component(src, "transformer_2"), "bf16")
    assert expert > 0 and two - one == pytest.approx(expert, rel=1e-6), "the second expert's weights are counted"
    from stages import plan

    train = next(p for p in plan.plans(cfg, 80.0)["stages"] if p["stage"] == "train")  # "both": one expert's plan
    assert train["note"].startswith("runs 2 times, once per expert (high, low), each holding one expert with this plan")


def test_another_boundary_is_refused(wan, tmp_path):
    """A folder whose pipeline switches experts elsewhere (Wan 2.2 I2V-A14B: 0.9) is not trained as T2V-A14B's."""
    import json

    from stages.core.errors import ModelError

    family, folder, _ = wan
    for part in folder.iterdir():
        (tmp_path / part.name).symlink_to(part)
    (tmp_path / "model_index.json").unlink()
    index = json.loads((folder / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 0.9}))
    with pytest.raises(ModelError, match="boundary_ratio 0.9.*point 'model' at a Wan2.2-T2V-A14B folder"):
        family.load_denoiser(ModelSource(str(tmp_path)), "fp32", CPU, TrainConfig(expert="low"))


def test_a_one_expert_wan_folder_is_named_before_any_stage(assets, tmp_path):
    """family = "wan2.2-14b" on a TI2V-5B folder (no transformer_2) fails before encode-captions, naming the fix."""
    from stages.core.config import load_config
    from stages.core.errors import ModelError
    from stages.families import check_model_family

    cfg = load_config(None, {"family": NAME, "model": str(tiny_model(assets, FAMILIES["wan2.2-5b"])),
                             "train.expert": "high", "artifacts": str(tmp_path)})
    with pytest.raises(ModelError, match=r"\(transformer_2: none\).*set family = 'wan2.2-5b' \(it trains this folder\)"):
        check_model_family(cfg)
    check_model_family(load_config(None, {"family": NAME, "model": str(tiny_model(assets, FAMILIES[NAME])),
                                           "train.expert": "low", "artifacts": str(tmp_path)}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("built_run", [NAME], indirect=True)
def test_both_experts_on_cuda_free_the_first_before_the_second_loads(built_run, monkeypatch):
    """On the GPU, the high expert's model, adapter and optimizer are gone from the GPU's memory when the low
    expert's trainer starts: it starts from what the first one started from (a leak holds a 14B expert twice)."""
    from stages import train
    from stages.train import trainer as trainer_module

    started: list[int] = []
    init = trainer_module.Trainer.__init__

    def recording(self, *args, **kwargs):
        torch.cuda.synchronize()
        started.append(torch.cuda.memory_allocated())
        init(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module.Trainer, "__init__", recording)
    cfg = run_beside(built_run, "both-cuda", **{"device": "cuda", "train.expert": "both", "train.steps": 2,
                                                "runtime.checkpoint_every": 0})
    done = train.run(cfg)
    assert done["experts"]["high"]["complete"] and done["experts"]["low"]["complete"]
    assert len(started) == 2 and started[1] <= started[0] + 2**20, started
