"""The GPU path's plumbing, on CPU: speed flags, torch state restore, fallbacks, CUDA-graph wrapper.

    .venv/bin/python -m pytest -q tests/test_gpu_plumbing.py

What needs a GPU (nf4 weights, real CUDA graph capture) is in the tests marked `cuda`, which run on
the GPU machine (bench/RESULTS.md names the run) and are skipped elsewhere.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_cfg
from stages.core import fastpath
from stages.core.config import ConfigError, load_config
from stages.core.events import EventLog
from stages.core.runtime import global_flags, make_runtime, torch_flags
from stages.core.stage import UserError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---- config validation of the flags ---------------------------------------------------------


@pytest.mark.parametrize("key, bad", [
    ("train.base_precision", "int8"), ("train.compile_transformer", "maybe"), ("train.optimizer", "sgd"),
    ("captions.text_encoder_precision", "fp8"), ("latents.vae_precision", "nf4"),
])
def test_flag_values_are_validated(key, bad):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, {"model": "x", key: bad})


def test_flag_typo_names_nearest_key():
    with pytest.raises(ConfigError, match="did you mean 'train.compile_transformer'"):
        load_config(None, {"model": "x", "train.compile_transformers": "on"})


def test_flag_errors_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config(None, {"model": "x", "train.base_precision": "int8", "train.enable_tf32": "perhaps"})
    assert "train.base_precision" in str(err.value) and "train.enable_tf32" in str(err.value)


# ---- global torch state ---------------------------------------------------------------------


def test_torch_flags_set_and_restored():
    before = global_flags()
    with torch_flags(enable_tf32=True, cudnn_benchmark=True, disable_cudnn_attention=True) as notes:
        inside = global_flags()
        assert inside["float32_matmul_precision"] == "high" and inside["matmul_tf32"] and inside["cudnn_tf32"]
        assert inside["cudnn_benchmark"] is True and inside["cudnn_sdp"] is False
        assert notes and "cuDNN SDPA is off" in notes[0]
    assert global_flags() == before


def test_torch_flags_restored_after_error():
    before = global_flags()
    with pytest.raises(RuntimeError, match="boom"):
        with torch_flags(enable_tf32=False, cudnn_benchmark=True, disable_cudnn_attention=True):
            raise RuntimeError("boom")
    assert global_flags() == before


def test_torch_flags_tf32_off_leaves_precision():
    before = global_flags()
    with torch_flags(enable_tf32=False, cudnn_benchmark=False, disable_cudnn_attention=False) as notes:
        assert global_flags()["float32_matmul_precision"] == before["float32_matmul_precision"]
        assert not notes
    assert global_flags() == before


# ---- a tiny cached run, shared by the training tests -----------------------------------------


@pytest.fixture(scope="module")
def cached(assets, demo_data, tmp_path_factory):
    """A tiny FLUX run with both caches built once (train tests reuse them)."""
    from stages import cache_latents, encode_captions

    cfg = make_cfg("flux", assets, demo_data, tmp_path_factory.mktemp("gpu-plumbing"), **{"run": "plumb"})
    encode_captions.run(cfg)
    cache_latents.run(cfg)
    return cfg


def _cfg(cached, **overrides):
    base = {"model": cached.model, "data.path": cached.data.path, "artifacts": cached.artifacts, "device": "cpu",
            "run": cached.run, "train.steps": 4, "train.checkpoint_every": 0, "train.warmup_steps_excluded": 1}
    base.update(overrides)
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "demo.toml", base)
    shutil.rmtree(cfg.run_dir / "lora", ignore_errors=True)
    return cfg


def _events(cfg, event=None):
    lines = [json.loads(line) for line in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in lines if event is None or e["event"] == event]


def _trainer(cfg):
    """A Trainer with its model set up, seeded as `fit` seeds it (the LoRA init draws from torch's RNG)."""
    from stages.trainer import Trainer

    tr = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "train"))
    torch.manual_seed(cfg.seed)
    tr.setup_model()
    return tr


def test_train_stage_restores_global_state(cached):
    from stages import train

    cfg = _cfg(cached, **{"train.enable_tf32": True, "train.cudnn_benchmark": True, "train.steps": 2})
    torch.set_float32_matmul_precision("highest")
    before = global_flags()
    manifest = train.run(cfg)
    assert manifest["step"] == 2
    assert global_flags() == before
    runtime = manifest["runtime"]
    assert runtime["enable_tf32"] and runtime["cudnn_benchmark"] and runtime["cuda_graphs"]["plan"].startswith("off")


def test_nf4_on_cpu_is_a_clear_error(cached):
    from stages import train

    cfg = _cfg(cached, **{"train.base_precision": "nf4"})
    before = global_flags()
    with pytest.raises(UserError, match=r"train\.base_precision = 'nf4' needs a CUDA GPU.*'auto'"):
        train.run(cfg)
    assert global_flags() == before
    assert "needs a CUDA GPU" in _events(cfg, "error")[-1]["message"]


def test_nf4_text_encoder_on_cpu_is_a_clear_error(cached):
    from stages.core.model_source import ModelSource
    from stages.families import get_family

    cfg = _cfg(cached, **{"captions.text_encoder_precision": "nf4"})
    with pytest.raises(UserError, match=r"captions\.text_encoder_precision = 'nf4' needs a CUDA GPU"):
        get_family("flux").load_text_encoder(ModelSource(cfg.model), cfg.captions, make_runtime("cpu", "auto"))


def test_compile_auto_means_cuda_whatever_the_base():
    from stages.trainer import compile_wanted

    assert [compile_wanted(m, True) for m in ("auto", "on", "off")] == [True, True, False]
    assert [compile_wanted(m, False) for m in ("auto", "on", "off")] == [False, True, False]


def test_compile_setup_failure_falls_back_to_eager(cached, monkeypatch):
    import diffusers

    def broken(self, *a, **k):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(diffusers.ModelMixin, "compile_repeated_blocks", broken)
    cfg = _cfg(cached, **{"train.compile_transformer": "on", "train.steps": 2})
    from stages import train

    manifest = train.run(cfg)
    assert manifest["compiled"] is False and manifest["step"] == 2
    warnings = [e["message"] for e in _events(cfg, "warning")]
    assert any("regional compile failed, running eager: no compiler here" in m for m in warnings)


def test_compiled_step_failure_falls_back_to_eager_with_same_loss(cached, monkeypatch):
    """A compile error that only shows at the first call (as inductor's do) reruns the step eager."""
    eager = _trainer(_cfg(cached))
    expected = [eager.step()[0] for _ in range(2)]

    def failing_compile(fn, *args, **kwargs):
        def call(*a, **k):
            raise RuntimeError("inductor exploded")
        return call

    monkeypatch.setattr(torch, "compile", failing_compile)
    cfg = _cfg(cached, **{"train.compile_transformer": "on"})
    tr = _trainer(cfg)
    assert tr.compiled
    got = [tr.step()[0] for _ in range(2)]
    assert not tr.compiled
    assert got == expected
    assert any("compiled step failed, falling back to eager" in e["message"] for e in _events(cfg, "warning"))


# ---- gradient checkpointing without RNG bookkeeping ------------------------------------------


def test_checkpoint_function_choice():
    assert fastpath.checkpoint_function(0.0) is fastpath._checkpoint_no_rng
    assert fastpath.checkpoint_function(0.1) is None  # dropout draws random numbers: keep diffusers' default


def test_checkpoint_without_rng_state_same_gradients(cached):
    """train.gradient_checkpointing with the fast checkpoint function: same loss and LoRA gradients."""
    results = []
    for fn in (None, fastpath.checkpoint_function(0.0)):
        tr = _trainer(_cfg(cached, **{"train.gradient_checkpointing": True}))
        tr.model.enable_gradient_checkpointing(fn)
        indices, (batch, eps, noise, t) = tr.draw_next()
        loss = tr.compute_loss(batch, eps, noise, t)
        loss.backward()
        results.append((float(loss), [p.grad.clone() for p in tr.params]))
    (l0, g0), (l1, g1) = results
    assert l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


# ---- read-ahead keeps resume exact ------------------------------------------------------------


def test_resume_with_read_ahead_is_exact(cached):
    from safetensors.torch import load_file

    from stages import train

    straight = train.run(_cfg(cached, **{"train.steps": 6, "train.checkpoint_every": 3, "run": cached.run}))
    want = load_file(str(Path(cached.artifacts) / cached.run / "lora" / "final" / "adapter_model.safetensors"))
    cfg = _cfg(cached, **{"train.steps": 6, "train.checkpoint_every": 3})
    tr = _trainer(cfg)
    for _ in range(3):
        tr.step()
    tr.save_checkpoint(3)  # a batch is pending (read ahead) at this point
    del tr
    resumed = train.run(cfg, resume=True)
    got = load_file(str(cfg.run_dir / "lora" / "final" / "adapter_model.safetensors"))
    assert resumed["loss_last"] is not None and straight["step"] == resumed["step"] == 6
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# ---- the CUDA-graph wrapper, with a stand-in for the capture --------------------------------


class _Log:
    def __init__(self):
        self.events = []

    def emit(self, event, **fields):
        self.events.append((event, fields))


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.lin.weight.requires_grad_(False)
        self.lora = torch.nn.Parameter(torch.randn(4, 4))
        self.calls = 0

    @property
    def dtype(self):
        return self.lin.weight.dtype

    def forward(self, x, scale=1.0, extra=None, return_dict=True):
        self.calls += 1
        y = (self.lin(x) + x @ self.lora) * scale
        if extra is not None:
            y = y + sum(e.sum() for e in extra)
        return (y,)


class _Half:
    def __rmul__(self, y):
        return y * 0.5


def _fake_capture(record):
    def capture(fn, sample_args, pool):
        record.append([tuple(a.shape) for a in sample_args])
        return fn  # "replay" runs the function itself: checks the argument plumbing, not CUDA
    return capture


def test_graphed_denoiser_captures_at_second_call_per_shape():
    model, log, record = _Model(), _Log(), []
    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=_fake_capture(record))
    x = torch.randn(2, 4)
    assert g.dtype == model.lin.weight.dtype  # attributes come from the model
    out1 = g(x, scale=2.0, return_dict=False)[0]
    assert record == [] and g.summary()["graphs"] == 0  # first sight of a shape: eager
    out2 = g(x, scale=2.0, return_dict=False)[0]
    assert record == [[(2, 4), (4, 4)]]  # inputs, then the LoRA parameter
    assert torch.equal(out1, out2)
    g(x, scale=2.0, return_dict=False)
    assert len(record) == 1 and g.summary() == {"graphs": 1, "failed": 0, "replays": 2}
    g(x, scale=3.0, return_dict=False)  # another non-tensor value is another signature: eager first
    assert g.summary()["graphs"] == 1
    g(torch.randn(3, 4), scale=2.0, return_dict=False)
    assert g.summary()["graphs"] == 1


def test_graphed_denoiser_gradients_reach_parameters():
    model, log = _Model(), _Log()
    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=_fake_capture([]))
    x = torch.randn(2, 4)
    grads = []
    for _ in range(3):
        model.lora.grad = None
        g(x, extra=[torch.ones(1)], return_dict=False)[0].square().sum().backward()
        grads.append(model.lora.grad.clone())
    assert g.summary()["replays"] == 2
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[1], grads[2])


def test_graphed_denoiser_capture_failure_runs_eager_with_warning():
    model, log = _Model(), _Log()

    def broken(fn, sample_args, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=broken)
    x = torch.randn(2, 4)
    for _ in range(4):
        g(x, return_dict=False)
    assert g.summary() == {"graphs": 0, "failed": 1, "replays": 0}
    assert model.calls == 4
    (event, fields), = log.events
    assert event == "warning" and "CUDA graph capture failed" in fields["message"] and "eager" in fields["message"]


def test_graphed_denoiser_skips_no_grad_and_odd_arguments():
    model, log, record = _Model(), _Log(), []
    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=_fake_capture(record))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            g(x, return_dict=False)
    for _ in range(3):
        g(x, scale=_Half(), return_dict=False)  # not a tensor nor a plain value: cannot be part of a key
    assert record == []


def test_graphed_denoiser_respects_max_graphs():
    model, log, record = _Model(), _Log(), []
    g = fastpath.GraphedDenoiser(model, [model.lora], log, capture=_fake_capture(record), max_graphs=1)
    for n in (2, 3):
        x = torch.randn(n, 4)
        for _ in range(3):
            g(x, return_dict=False)
    assert len(record) == 1


def test_graphs_plan(monkeypatch):
    from types import SimpleNamespace

    cpu, gpu = SimpleNamespace(is_cuda=False), SimpleNamespace(is_cuda=True)
    assert fastpath.graphs_plan(cpu, SimpleNamespace(dropout=0.0), "auto")[0] is False
    assert fastpath.graphs_plan(gpu, SimpleNamespace(dropout=0.0), "auto")[0] is True
    assert fastpath.graphs_plan(gpu, SimpleNamespace(dropout=0.1), "on") == (
        False, "off (train.dropout = 0.1: random numbers inside the denoiser)")
    assert fastpath.graphs_plan(gpu, SimpleNamespace(dropout=0.0), "off")[0] is False
    monkeypatch.setenv(fastpath.ENV, "sometimes")
    with pytest.raises(ValueError, match=fastpath.ENV):
        fastpath.graphs_mode()


# ---- on the GPU machine ----------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("precision", ["nf4", "bf16"])
def test_cuda_graphs_same_losses_as_eager(cached, precision, monkeypatch):
    """The graphed steps compute what the eager ones do: the first loss (forward only) bit for bit,
    and later losses and the LoRA weights as close as two eager runs are to each other (the
    attention backward on a GPU need not be deterministic; where it is, this demands equality)."""
    runs = []
    for mode in ("off", "off", "on"):
        monkeypatch.setenv(fastpath.ENV, mode)
        cfg = _cfg(cached, **{"device": "cuda", "train.base_precision": precision, "train.steps": 6,
                              "train.gradient_checkpointing": True})
        with torch_flags(True, False, True):
            tr = _trainer(cfg)
            losses = torch.tensor([tr.step()[0] for _ in range(6)], dtype=torch.float64)
        weights = torch.cat([v.detach().double().flatten().cpu() for k, v in sorted(tr.model.state_dict().items())
                             if "lora" in k])
        runs.append((losses, weights, tr.denoiser))
    (l0, w0, _), (l1, w1, _), (l2, w2, graphed) = runs
    assert isinstance(graphed, fastpath.GraphedDenoiser) and graphed.summary()["replays"] >= 4
    assert l2[0] == l0[0]
    assert (l2 - l0).abs().max() <= 10 * (l1 - l0).abs().max()
    assert (w2 - w0).abs().max() <= 10 * (w1 - w0).abs().max()


@cuda
def test_cuda_flags_restored():
    before = global_flags()
    with torch_flags(True, True, True):
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
    assert global_flags() == before
