"""The trainer's GPU-path plumbing, on a tiny cached FLUX run on CPU: torch state restored, clear
errors for what needs a GPU, compile fallbacks, gradient checkpointing, read-ahead and resume.

    .venv/bin/python -m pytest -q tests/stages/test_trainer_paths.py

What needs a GPU (nf4 weights, real CUDA graph capture) is in the tests marked `cuda`, which run on
the GPU machine and are skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import losses_and_lora, lora_vector, make_cfg
from stages.core import fastpath
from stages.core.config import load_config
from stages.core.errors import UserError
from stages.core.events import EventLog
from stages.core.runtime import global_flags, make_runtime, torch_flags
from stages.core.caches import export_dir, lora_dir

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

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
            "run": cached.run, "train.steps": 4, "runtime.checkpoint_every": 0, "runtime.warmup_steps_excluded": 1}
    base.update(overrides)
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo.toml", base)
    shutil.rmtree(lora_dir(cfg), ignore_errors=True)
    return cfg


def _events(cfg, event=None):
    lines = [json.loads(line) for line in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in lines if event is None or e["event"] == event]


def _trainer(cfg):
    """A Trainer with its model set up, seeded as `fit` seeds it (the LoRA init draws from torch's RNG)."""
    from stages.train.trainer import Trainer

    tr = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "train"))
    torch.manual_seed(cfg.seed)
    tr.setup_model()
    return tr


def test_caption_tokens_multiple_is_named_where_the_family_does_not_cut_captions(cached):
    """FLUX.1's T5 rows have one length, so runtime.caption_tokens_multiple has nothing to round: train says so
    instead of ignoring it; families that cut captions to the batch's longest declare it."""
    from stages.families import get_family

    _trainer(_cfg(cached, **{"runtime.caption_tokens_multiple": 64}))
    notes = [e["message"] for e in _events(cached, "info") if "caption_tokens_multiple" in e.get("message", "")]
    assert notes == ["runtime.caption_tokens_multiple = 64 changes nothing for flux: its batches are not cut to "
                     "their longest caption"]
    cutting = {"qwen-image", "qwen-image-edit", "qwen-image-edit-2511", "krea2", "chroma", "ernie-image", "ideogram4"}
    assert all(get_family(name).captions_cut_to_longest for name in cutting)
    assert not any(get_family(name).captions_cut_to_longest for name in ("flux", "qwen-image-2.1", "z-image", "sdxl"))


def test_a_diverged_loss_stops_train_with_what_to_change_and_keeps_the_checkpoints(cached):
    """A learning rate far too high makes the loss non-finite within a few steps: train stops with a
    UserError (one line in the terminal, no traceback) naming the step and the settings to change, and the
    checkpoint written before it stays."""
    from stages import train
    from stages.core.errors import TrainingDiverged, UserError

    cfg = _cfg(cached, **{"train.learning_rate": 1e30, "train.lr_warmup_steps": 0, "train.max_grad_norm": 0.0,
                          "train.steps": 8, "runtime.checkpoint_every": 1})
    with pytest.raises(TrainingDiverged) as err:
        train.run(cfg)
    assert isinstance(err.value, UserError)
    step = int(str(err.value).split(" at step ")[1].split(":")[0])
    assert 1 < step <= 8 and "lower train.learning_rate (now 1e+30)" in str(err.value)
    assert "set train.max_grad_norm" in str(err.value) and "cudnn_attention" not in str(err.value)
    from stages.train.checkpoints import complete_checkpoints, step_of

    assert max(step_of(c) for c in complete_checkpoints(lora_dir(cfg))) == step - 1


def test_train_stage_restores_global_state(cached):
    from stages import train

    cfg = _cfg(cached, **{"runtime.enable_tf32": True, "runtime.cudnn_benchmark": True, "train.steps": 2})
    torch.set_float32_matmul_precision("highest")
    before = global_flags()
    manifest = train.run(cfg)
    assert manifest["step"] == 2
    assert global_flags() == before
    runtime = manifest["runtime"]
    assert runtime["enable_tf32"] and runtime["cudnn_benchmark"] and runtime["cuda_graphs"]["plan"].startswith("off")


def test_the_cudnn_attention_opt_in_trains_the_same_losses_and_restores_attention(cached):
    """runtime.cudnn_attention = true routes the stage's attention through the one-gradient-layout guard
    (stages/core/runtime.py cudnn_safe_sdpa): same losses as without it, and torch's SDPA is its own again after."""
    import torch.nn.functional as F

    from stages import train

    plain = F.scaled_dot_product_attention
    losses = {}
    for opt_in in (False, True):
        cfg = _cfg(cached, **{"runtime.cudnn_attention": opt_in, "train.steps": 3})
        train.run(cfg)
        losses[opt_in] = [e["loss"] for e in _events(cfg, "step")][-3:]
        assert F.scaled_dot_product_attention is plain
    assert losses[True] == losses[False] and len(losses[True]) == 3


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


def test_compile_auto_stays_eager_on_cpu(cached):
    """`auto` compiles on CUDA only: inductor's CPU build costs more than it gives on a CPU run."""
    assert _trainer(_cfg(cached, **{"runtime.compile_transformer": "auto"})).compiled is False
    assert _trainer(_cfg(cached, **{"runtime.compile_transformer": "off"})).compiled is False


@cuda
def test_compile_auto_compiles_an_nf4_base_on_cuda(cached):
    tr = _trainer(_cfg(cached, **{"device": "cuda", "train.base_precision": "nf4", "runtime.compile_transformer": "auto"}))
    assert tr.compiled is True


def test_compile_setup_failure_falls_back_to_eager(cached, monkeypatch):
    import diffusers

    def broken(self, *a, **k):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(diffusers.ModelMixin, "compile_repeated_blocks", broken)
    cfg = _cfg(cached, **{"runtime.compile_transformer": "on", "train.steps": 2})
    from stages import train

    manifest = train.run(cfg)
    assert manifest["compiled"] is False and manifest["step"] == 2
    warnings = [e["message"] for e in _events(cfg, "warning")]
    assert any("regional compile failed, running eager: no compiler here" in m for m in warnings)


@pytest.mark.parametrize("keep_attention", [False, True])
def test_compiled_step_failure_falls_back_to_eager_with_same_loss(cached, monkeypatch, keep_attention):
    """A compile error that only shows at the first call (as inductor's do) reruns the step eager; with
    runtime.keep_attention too (its compiled checkpoint fails the same way, and the eager one takes over)."""
    sets = {"runtime.keep_attention": keep_attention, "runtime.gradient_checkpointing": True}
    eager = _trainer(_cfg(cached, **sets))
    expected = [eager.step()[0] for _ in range(2)]

    def failing_compile(fn, *args, **kwargs):
        def call(*a, **k):
            raise RuntimeError("inductor exploded")
        return call

    monkeypatch.setattr(torch, "compile", failing_compile)
    cfg = _cfg(cached, **{"runtime.compile_transformer": "on", **sets})
    tr = _trainer(cfg)
    assert tr.compiled
    got = [tr.step()[0] for _ in range(2)]
    assert not tr.compiled
    assert got == expected
    assert any("compiled step failed, falling back to eager" in e["message"] for e in _events(cfg, "warning"))


# ---- gradient checkpointing without RNG bookkeeping ------------------------------------------


def _loss_and_grads(cfg, checkpoint_fn: object = "default") -> tuple[float, list[torch.Tensor]]:
    """One step's loss and LoRA gradients (with `checkpoint_fn` set when given)."""
    tr = _trainer(cfg)
    if checkpoint_fn != "default":
        tr.model.enable_gradient_checkpointing(checkpoint_fn)
    indices, (batch, eps, noise, t) = tr.draw_next()
    loss = tr.compute_loss(batch, eps, noise, t)
    loss.backward()
    return float(loss), [p.grad.clone() for p in tr.params]


def _assert_same(a: tuple[float, list[torch.Tensor]], b: tuple[float, list[torch.Tensor]]) -> None:
    assert a[0] == b[0]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_checkpointing_with_dropout_replays_its_random_masks(cached):
    """With LoRA dropout the recompute must draw the same masks as the forward did: checkpointing on
    gives the loss and LoRA gradients of checkpointing off (a checkpoint function that skips the
    RNG bookkeeping would draw new masks in the recompute and change the gradients)."""
    off, on = (_loss_and_grads(_cfg(cached, **{"train.dropout": 0.25, "runtime.gradient_checkpointing": ckpt}))
               for ckpt in (False, True))
    _assert_same(off, on)


def test_checkpoint_without_rng_state_same_gradients(cached):
    """runtime.gradient_checkpointing with the fast checkpoint function: same loss and LoRA gradients."""
    cfg = _cfg(cached, **{"runtime.gradient_checkpointing": True})
    _assert_same(_loss_and_grads(cfg, None), _loss_and_grads(cfg, fastpath.checkpoint_function(0.0)))


def _attention_calls(cfg) -> tuple[tuple[float, list[torch.Tensor]], int]:
    """A step's loss and LoRA gradients, and how many attention kernels (forward, recompute and backward)
    it ran, counted by torch's profiler: the aten attention ops that allocated their outputs (a kept output
    handed back by the checkpoint's policy allocates nothing). The step before it (compiled: the compile's
    own tracing) is not counted."""
    from torch.profiler import profile

    tr = _trainer(cfg)
    for profiled in (False, True):
        tr.optimizer.zero_grad(set_to_none=True)
        with profile() if profiled else contextlib.nullcontext() as prof:
            loss = tr.compute_loss(*tr.draw_next()[1])
            loss.backward()
    calls = sum(1 for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")
                and any(c.name.startswith("aten::empty") for c in e.cpu_children))
    assert tr._runtime_summary()["keep_attention"] is cfg.runtime.keep_attention  # what the manifest reports
    return (float(loss), [p.grad.clone() for p in tr.params]), calls


@pytest.mark.parametrize("compiled,dropout", [("off", 0.0), ("off", 0.25), ("on", 0.0)])
def test_keep_attention_skips_the_recompute_of_attention_and_trains_the_same(cached, compiled, dropout, monkeypatch):
    """runtime.keep_attention: a checkpointed block keeps its attention output, so the step runs one attention
    kernel fewer per block (none recomputed) and gives full checkpointing's loss and LoRA gradients: bit for
    bit eager, with LoRA dropout too (the recompute replays the forward's masks); compiled (the policy inside
    torch.compile; aot_eager on the CPU, the partitioner inductor's compile uses too, in seconds rather than
    minutes) within float rounding."""
    from stages.core import blockswap

    if compiled == "on":
        real = torch.compile
        monkeypatch.setattr(torch, "compile", lambda *a, **k: real(*a, **{**k, "backend": "aot_eager"}))
    runs = {keep: _attention_calls(_cfg(cached, **{"runtime.gradient_checkpointing": True, "runtime.keep_attention": keep,
                                                   "runtime.compile_transformer": compiled, "train.dropout": dropout}))
            for keep in (False, True)}
    blocks = len(blockswap.repeated_blocks(_trainer(_cfg(cached)).model))
    (full, full_calls), (kept, kept_calls) = runs[False], runs[True]
    assert full_calls - kept_calls == blocks > 0
    if compiled == "off":
        _assert_same(full, kept)
    else:
        assert kept[0] == pytest.approx(full[0], rel=1e-5)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(full[1], kept[1]))


# ---- read-ahead keeps resume exact ------------------------------------------------------------


def test_resume_with_read_ahead_is_exact(cached):
    from safetensors.torch import load_file

    from stages import train

    straight = train.run(_cfg(cached, **{"train.steps": 6, "runtime.checkpoint_every": 3, "run": cached.run}))
    want = load_file(str(Path(cached.artifacts) / cached.run / "lora" / "final" / "adapter_model.safetensors"))
    cfg = _cfg(cached, **{"train.steps": 6, "runtime.checkpoint_every": 3})
    tr = _trainer(cfg)
    for _ in range(3):
        tr.step()
    tr.save_checkpoint(3)  # a batch is pending (read ahead) at this point
    del tr
    resumed = train.run(cfg, resume=True)
    got = load_file(str(lora_dir(cfg) / "final" / "adapter_model.safetensors"))
    assert resumed["loss_last"] is not None and straight["step"] == resumed["step"] == 6
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


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
                              "runtime.gradient_checkpointing": True})
        with torch_flags(True, False, True):
            tr = _trainer(cfg)
            start = lora_vector(tr)
            losses, weights = losses_and_lora(tr)
        runs.append((losses, weights, tr.denoiser))
    (l0, w0, _), (l1, w1, _), (l2, w2, graphed) = runs
    assert isinstance(graphed, fastpath.GraphedDenoiser) and graphed.summary()["replays"] >= 4
    assert l2[0] == l0[0]
    # Two eager nf4 runs can be bit-identical while the graphed one moves the 5th/6th loss by ~1e-5
    # (kernels may pick other algorithms at the graph pool's addresses). Adam turns such a difference in
    # a near-zero gradient into up to a whole step of one weight, so the weights are held to 1% of how
    # far training moved them: a wrong weight, input or stale buffer moves them by a large part of it.
    assert (l2 - l0).abs().max() <= max(10 * (l1 - l0).abs().max(), 2e-5)
    assert (w2 - w0).norm() <= max(10 * (w1 - w0).norm(), 0.01 * (w0 - start).norm())




@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs a CUDA GPU with fp8 tensor cores (compute capability >= 8.9)")
def test_an_fp8_run_on_cuda_trains_like_bf16_under_graphs_and_compile_and_its_export_loads(cached, monkeypatch):
    """train.base_precision = "fp8" on the tiny FLUX, its block Linears made fp8 (fp8.MIN_WIDTH lowered to
    16: the tiny model's are narrower than the 256 a real run quantizes): its eager losses stay within 1 %
    of a bf16 run's from the same LoRA and batches (the issue's fidelity bound), CUDA graphs give the
    eager run's first loss bit for bit, graphs and regional compile keep every loss within compiled
    rounding (1 %), and the export loads into FluxPipeline with the adapter's keys, none missing or
    unexpected."""
    import diffusers
    from safetensors.torch import load_file

    from stages import export_lora, train
    from stages.core import fp8

    monkeypatch.setattr(fp8, "MIN_WIDTH", 16)
    runs = {}
    for precision, graphs, compiled in (("bf16", "off", "off"), ("fp8", "off", "off"), ("fp8", "on", "off"),
                                        ("fp8", "off", "on"), ("fp8", "on", "on")):
        monkeypatch.setenv(fastpath.ENV, graphs)
        cfg = _cfg(cached, **{"device": "cuda", "train.base_precision": precision, "train.steps": 6,
                              "runtime.gradient_checkpointing": True, "runtime.compile_transformer": compiled})
        with torch_flags(True, False, True):
            tr = _trainer(cfg)
            assert (sum(isinstance(m, fp8.Fp8Linear) for m in tr.model.modules()) >= 8) == (precision == "fp8")
            runs[precision, graphs, compiled] = losses_and_lora(tr)[0]
    bf16, eager = runs.pop(("bf16", "off", "off")), runs["fp8", "off", "off"]
    assert torch.isfinite(bf16).all() and ((eager - bf16).abs() / bf16.abs()).max() < 0.01, (eager, bf16)
    assert runs["fp8", "on", "off"][0] == eager[0]
    assert all((losses - eager).abs().max() <= 0.01 * eager.abs().max() for losses in runs.values()), runs
    # the caches were encoded on the CPU (fp32 text encoders): the same precision keeps them fresh on CUDA
    cfg = _cfg(cached, **{"device": "cuda", "train.base_precision": "fp8", "train.steps": 2,
                          "captions.text_encoder_precision": "fp32"})
    train.run(cfg)
    export_lora.run(cfg)
    pipe = diffusers.FluxPipeline.from_pretrained(cfg.model)
    exported = load_file(str(export_dir(cfg) / export_lora.DIFFUSERS_FILE))
    pipe.load_lora_weights(str(export_dir(cfg)), weight_name=export_lora.DIFFUSERS_FILE)
    from peft.utils import get_peft_model_state_dict

    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name="default_0")
    assert len(loaded) == len(exported) > 0
    assert {k.replace(".default_0", "") for k in loaded} == {k.removeprefix("transformer.") for k in exported}


@cuda
def test_nf4_swap_same_losses_as_unswapped_nf4_on_cuda(cached, monkeypatch):
    """nf4 with a block swapped (quantized block by block from host memory, stages/core/nf4_blocks.py)
    trains as diffusers' nf4 load, under CUDA graphs ("auto" with room under the budget, and "on": they replay the
    swap's copies) and eager ("auto" without room: CAPTURE_ROOM raised past any GPU): the
    first loss bit for bit, later losses and the LoRA weights as close as two unswapped runs are to
    each other; the swapped block's quantized weights live in pinned host memory (their quant_state
    stays on the GPU), the resident block's on the GPU."""
    from stages.core import memory

    real = memory.plan_train

    def swap_one(*args):
        plan = real(*args)
        plan.settings = {**plan.settings, "base_precision": "nf4", "swapped_blocks": 1, "gradient_checkpointing": True}
        return plan

    runs = []
    default_room = fastpath.CAPTURE_ROOM
    for swapped, graphs, room in ((False, "off", default_room), (False, "off", default_room), (True, "auto", default_room),
                                  (True, "auto", 1e9), (True, "on", default_room)):
        monkeypatch.setenv(fastpath.ENV, graphs)
        monkeypatch.setattr(fastpath, "CAPTURE_ROOM", room)
        if swapped:
            monkeypatch.setitem(memory.PLANNERS, "train", dataclasses.replace(memory.PLANNERS["train"], plan=swap_one))
        cfg = _cfg(cached, **{"device": "cuda", "train.base_precision": "nf4", "train.steps": 4,
                              "runtime.gradient_checkpointing": True, "runtime.compile_transformer": "off"})
        with torch_flags(True, False, True):
            tr = _trainer(cfg)
            assert (tr.swap is not None) == swapped
            if swapped:
                host = [p for params in tr.swap.host.values() for p in params.values()]
                assert host and all(p.device.type == "cpu" and p.is_pinned() for p in host)
                assert all(p.quant_state.absmax.device.type == "cuda" for p in host if hasattr(p, "quant_state"))
                assert tr.model.transformer_blocks[0].attn.to_q.base_layer.weight.device.type == "cuda"
            losses, weights = losses_and_lora(tr, 4)
            if graphs == "on":
                assert isinstance(tr.denoiser, fastpath.GraphedDenoiser) and tr.denoiser.summary()["replays"] >= 2
            if swapped and graphs == "auto":  # a swap plan's "auto" captures where the budget has room for it
                summary = tr.denoiser.summary()
                assert isinstance(tr.denoiser, fastpath.GraphedDenoiser) and tr.graphs_plan == fastpath.SWAP_GRAPHS
                assert (summary["no_room"], summary["graphs"] > 0) == ((0, True) if room < 1e9 else (1, False)), summary
        runs.append((losses, weights))
    (l0, w0), (l1, w1) = runs[:2]
    for l2, w2 in runs[2:]:
        assert l2[0] == l0[0]
        assert (l2 - l0).abs().max() <= max(10 * (l1 - l0).abs().max(), 2e-5)
        assert (w2 - w0).abs().max() <= max(10 * (w1 - w0).abs().max(), 1e-5 * w0.abs().max())
