"""fp8 base weights (stages/core/fp8.py) and fp8_scaled checkpoints (stages/core/fp8_checkpoint.py).

torch's `_scaled_mm` runs on the CPU too, so the fp8 math is checked here; what needs fp8 tensor
cores (a tiny family trained in fp8 against bf16, graphs and compile, its export loaded) is
tests/stages/test_trainer_paths.py's `fp8 and cuda` test.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import make_cfg, tiny_model
from stages.core.config import TrainConfig
from stages.core.errors import ResourceError
from stages.core.fp8 import (FP8_MAX, Fp8Linear, fp8_bytes, inside_repeated_blocks, quantize_denoiser_fp8,
                             require_fp8_device)
from stages.core.caches import lora_dir

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
# where the fp8 matmuls run: torch 2.13's CPU build has `_scaled_mm`, torch 2.11's (the GPU machine) has not
MATMUL_DEVICE = "cuda" if FP8_GPU else "cpu"


def _linear(out_f: int = 96, in_f: int = 64, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f)
    with torch.no_grad():
        lin.weight.mul_(torch.logspace(-3, 1, out_f)[:, None])  # rows 4 decades apart in magnitude
    return lin


def test_weights_round_trip_within_e4m3_error():
    lin = _linear()
    fp8 = Fp8Linear.from_linear(lin, "cpu")
    w, back = lin.weight.detach(), fp8.dense_weight(torch.float32)
    scale = fp8.weight_scale[:, None]
    # e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself; below
    # the smallest normal (2^-6 * scale) the step is 2^-9 * scale, so at most half of that
    bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10)
    assert ((back - w).abs() <= bound * 1.001).all()
    assert (back - w).abs().max() > 0  # it is quantized, not a copy
    assert fp8.weight.dtype == torch.float8_e4m3fn


def test_one_scale_per_output_channel():
    lin = _linear()
    fp8 = Fp8Linear.from_linear(lin, "cpu")
    assert fp8.weight_scale.shape == (96,) and fp8.weight_scale.dtype == torch.float32
    torch.testing.assert_close(fp8.weight_scale, lin.weight.detach().abs().amax(dim=1) / FP8_MAX)
    with torch.no_grad():
        lin.weight[5] *= 10
    again = Fp8Linear.from_linear(lin, "cpu")
    changed = (again.weight_scale != fp8.weight_scale).nonzero().flatten().tolist()
    assert changed == [5]
    assert torch.equal(again.weight.view(torch.uint8), fp8.weight.view(torch.uint8))  # same codes, row 5 too


def test_memory_is_one_byte_per_weight_plus_a_scale_per_row():
    lin = _linear(96, 64)
    fp8 = Fp8Linear.from_linear(lin, "cpu")
    assert fp8_bytes(fp8) == 96 * 64 + 4 * 96
    assert [n for n, _ in fp8.named_parameters()] == []  # frozen: buffers only, nothing for the optimizer


def test_forward_and_input_gradient_match_dense():
    lin = _linear(96, 64).to(MATMUL_DEVICE, torch.bfloat16)
    fp8 = Fp8Linear.from_linear(lin, MATMUL_DEVICE)
    for rows in (40, 3):  # fp8 matmul, and the dequantized path for a handful of rows (modulation layers)
        x = torch.randn(2, rows, 64, dtype=torch.bfloat16, device=MATMUL_DEVICE, requires_grad=True)
        y, ref = fp8(x), lin(x)
        grad = torch.randn_like(ref)
        (dx,), (dx_ref,) = torch.autograd.grad(y, x, grad), torch.autograd.grad(ref, x, grad)
        assert y.dtype == dx.dtype == torch.bfloat16
        assert _rel(y, ref) < 0.06 and _rel(dx, dx_ref) < 0.06  # measured 0.037 (weights and rows both e4m3)


def test_model_cast_keeps_fp8_weights():
    fp8 = Fp8Linear.from_linear(_linear(), "cpu")
    codes = fp8.weight.view(torch.uint8).clone()
    fp8.to(torch.bfloat16)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight_scale.dtype == torch.float32
    assert torch.equal(fp8.weight.view(torch.uint8), codes)


from stages.families.base import BatchMeta  # noqa: E402

NO_GEOMETRY = BatchMeta(None, None, None)  # FLUX's loss reads only the (absent) loss mask of the batch meta


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---- a tiny FLUX: which layers, LoRA on top, the error on a machine without fp8 ---------------------------


def _flux(assets, dtype=torch.bfloat16):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(str(tiny_model(assets, "flux-dev")), subfolder="transformer",
                                                  torch_dtype=dtype)


def test_only_linears_inside_repeated_blocks_become_fp8(assets):
    model = quantize_denoiser_fp8(_flux(assets), inside_repeated_blocks(_flux(assets)), "cpu", min_width=16)
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 and all(n.startswith(("transformer_blocks.", "single_transformer_blocks.")) for n in fp8)
    for kept in ("x_embedder", "context_embedder", "proj_out", "norm_out.linear"):
        assert type(model.get_submodule(kept)) is nn.Linear
    assert "transformer_blocks.0.attn.to_q" in fp8 and "transformer_blocks.0.norm1.linear" in fp8
    assert model.dtype == torch.bfloat16  # diffusers' model.dtype (the family casts inputs to it)


def _lora_step(model, attention: str = "train") -> float:
    """A rank-4 LoRA on `model` (its B filled, so every adapter weight gets a gradient), one FLUX loss and its
    backward on MATMUL_DEVICE; asserts each adapter weight is fp32 with a non-zero finite gradient (naming the
    ones that are not) and returns the loss.

    `attention`: "train", under the train stage's torch flags (runtime.cudnn_attention = false: no cuDNN SDPA);
    "guard", cuDNN SDPA allowed with the stage's one-gradient-layout guard (runtime.cudnn_attention = true);
    "torch", torch's own defaults. On the H200 (torch 2.11) torch's defaults pick cuDNN's SDPA, and it gave these
    tiny models NaN gradients in the double block's attention (query, key and value), bf16 and fp8 alike, 3 of 3
    times, with the guard as without it; with the train stage's flags 3 of 3 were finite
    (bench/results/fp8-tiny-probe-modes-h200.json): the NaN is cuDNN's, not fp8's."""
    from stages.core import lora
    from stages.core.runtime import torch_flags
    from stages.families.flux.family import Flux

    if attention != "torch":
        with torch_flags(False, False, disable_cudnn_attention=attention == "train"):
            return _lora_step(model, "torch")

    model.to(MATMUL_DEVICE).requires_grad_(False)
    torch.manual_seed(0)
    params = lora.attach_lora(model, lora.lora_config(4, 4, 0.0, list(Flux.default_lora_targets)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.05)
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 16, 8, 8, generator=g)
    cond = {"prompt_embeds": torch.randn(2, 16, 32, generator=g), "pooled": torch.randn(2, 32, generator=g)}
    x0, noise, cond = x0.to(MATMUL_DEVICE), noise.to(MATMUL_DEVICE), {k: v.to(MATMUL_DEVICE) for k, v in cond.items()}
    t = torch.full((2,), 0.5, device=MATMUL_DEVICE)
    loss = Flux().loss(model, x0, noise, t, cond, NO_GEOMETRY, TrainConfig(guidance_scale=1.0))
    loss.mean().backward()
    bad = [(n, p.dtype, None if p.grad is None else float(p.grad.abs().sum())) for n, p in model.named_parameters()
           if p.requires_grad and not (p.dtype == torch.float32 and p.grad is not None and p.grad.abs().sum() > 0)]
    assert params and not bad, bad
    return float(loss.mean())


def test_lora_wraps_fp8_base_and_trains(assets):
    """peft wraps an Fp8Linear as any Linear; the LoRA weights stay fp32 and get gradients, the base
    none, and one loss is within a few percent of the bf16 base's with the same LoRA."""
    from peft.tuners.lora import Linear as LoraLinear

    fp8 = _flux(assets)
    quantize_denoiser_fp8(fp8, inside_repeated_blocks(fp8), MATMUL_DEVICE, min_width=16)
    losses = {"bf16": _lora_step(_flux(assets)), "fp8": _lora_step(fp8)}
    to_q = fp8.transformer_blocks[0].attn.to_q
    assert isinstance(to_q, LoraLinear) and isinstance(to_q.base_layer, Fp8Linear)
    assert abs(losses["fp8"] - losses["bf16"]) / losses["bf16"] < 0.05


def test_a_mixed_base_holds_its_first_blocks_in_fp8_and_the_rest_in_nf4(assets):
    """An fp8 plan that keeps only its first blocks in fp8 (the budget's choice, stages/core/memory/train.py):
    those blocks' Linears are Fp8Linear, every other Linear (the other blocks, the embedders, the
    modulation, proj_out) is bitsandbytes' nf4 as diffusers' load makes it. peft wraps both kinds; the
    LoRA weights get gradients in both; one loss is within a few percent of the bf16 base's."""
    import bitsandbytes as bnb
    from peft.tuners.lora import Linear as LoraLinear

    from stages.core import blockswap
    from stages.core.fp8 import quantize_fp8_nf4

    mixed = _flux(assets)
    blocks = blockswap.repeated_blocks(mixed)
    assert len(blocks) >= 2
    quantize_fp8_nf4(mixed, 1, MATMUL_DEVICE, double_quant=True, min_width=16)
    first = {id(m) for m in blocks[0].modules()}
    kinds = {n: type(m) for n, m in mixed.named_modules() if isinstance(m, nn.Linear)}
    assert {kinds[n] for n, m in mixed.named_modules() if id(m) in first and n in kinds} == {Fp8Linear}
    assert {k for n, k in kinds.items() if not n.startswith("transformer_blocks.0.")} == {bnb.nn.Linear4bit}
    assert getattr(mixed, "is_loaded_in_4bit", False)  # what peft reads to wrap the nf4 layers
    losses = {"bf16": _lora_step(_flux(assets)), "fp8+nf4": _lora_step(mixed)}
    fp8_q, nf4_q = mixed.transformer_blocks[0].attn.to_q, blocks[-1].attn.to_q
    assert isinstance(fp8_q, LoraLinear) and isinstance(fp8_q.base_layer, Fp8Linear)
    assert isinstance(nf4_q.base_layer, bnb.nn.Linear4bit)
    assert abs(losses["fp8+nf4"] - losses["bf16"]) / losses["bf16"] < 0.05, losses


def test_the_mixed_base_on_cpu_is_the_fp8_error(assets):
    """The fp8 part of a mixed base needs fp8 tensor cores as a whole fp8 base does: the same error."""
    from stages.core.model_source import ModelSource
    from stages.core.runtime import MixedLoad
    from stages.families.flux.family import Flux

    rt = MixedLoad(torch.device("cpu"), torch.bfloat16, fp8_blocks=1)
    with pytest.raises(ResourceError, match=r"train\.base_precision = 'fp8' needs a CUDA GPU"):
        Flux().load_denoiser(ModelSource(str(tiny_model(assets, "flux-dev"))), "fp8", rt,
                             SimpleNamespace(nf4_double_quant=True))


def test_fp8_on_cpu_is_a_clear_error(assets):
    from stages.core.model_source import ModelSource
    from stages.core.runtime import make_runtime
    from stages.families.flux.family import Flux

    rt = make_runtime("cpu", "fp8")
    with pytest.raises(ResourceError, match=r"train\.base_precision = 'fp8' needs a CUDA GPU of compute capability "
                                            r"8\.9.*but this stage runs on cpu\. Set .*'nf4'.*'bf16'"):
        Flux().load_denoiser(ModelSource(str(tiny_model(assets, "flux-dev"))), "fp8", rt,
                             SimpleNamespace(nf4_double_quant=True))


def test_fp8_on_an_older_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ResourceError, match=r"'NVIDIA A100-SXM4-80GB' is 8\.0\. Set train\.base_precision = 'nf4'"):
        require_fp8_device(torch.device("cuda"))


# ---- fp8_scaled single files ------------------------------------------------------------------------------


def _save_fp8_scaled(model: nn.Module, path) -> dict[str, torch.Tensor]:
    """`model`'s weights in ComfyUI's fp8_scaled layout: each 2-D weight as e4m3 with one fp32
    scale per tensor (`.scale_weight`), a `scaled_fp8` marker; the rest bf16."""
    from safetensors.torch import save_file

    state, dense = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for k, v in model.state_dict().items():
        if k.endswith(".weight") and v.dim() == 2:
            scale = v.float().abs().max() / FP8_MAX
            state[k] = (v.float() / scale).to(torch.float8_e4m3fn)
            state[k.removesuffix(".weight") + ".scale_weight"] = scale.reshape(1)
            dense[k] = state[k].float() * scale
        else:
            state[k] = dense[k] = v.to(torch.bfloat16)
    save_file(state, str(path))
    return dense


def test_fp8_scaled_checkpoint_converts_once_and_loads(assets, tmp_path):
    from diffusers import FluxTransformer2DModel

    from stages.core.fp8_checkpoint import dense_checkpoint, is_fp8_scaled

    original = _flux(assets, torch.float32)
    src = tmp_path / "flux-fp8_scaled.safetensors"
    expected = _save_fp8_scaled(original, src)
    assert is_fp8_scaled(src)
    dense = dense_checkpoint(src, tmp_path / "cache")
    assert dense.parent.parent == tmp_path / "cache" / "fp8_scaled" and not is_fp8_scaled(dense)
    first = dense.stat().st_mtime_ns
    assert dense_checkpoint(src, tmp_path / "cache") == dense and dense.stat().st_mtime_ns == first  # cached
    folder = str(tiny_model(assets, "flux-dev"))
    loaded = FluxTransformer2DModel.from_single_file(str(dense), config=folder, subfolder="transformer",
                                                     torch_dtype=torch.bfloat16)
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v.to(torch.bfloat16), rtol=0, atol=0)  # exactly weight * scale
    assert _rel(got["transformer_blocks.0.attn.to_q.weight"], original.state_dict()["transformer_blocks.0.attn.to_q.weight"]) < 0.06


def test_fp8_scaled_single_file_model_trains_through_the_stages(assets, demo_data, tmp_path):
    """`model` = an fp8_scaled file with `model_base` = the pipeline folder: the stages take text
    encoders and VAE from the base, the train stage converts the file once into the artifacts' model
    cache and trains on exactly weight * scale."""
    from diffusers import FluxTransformer2DModel

    from stages import cache_latents, encode_captions, train
    from stages.core.model_source import model_source

    src = tmp_path / "flux-fp8_scaled.safetensors"
    expected = _save_fp8_scaled(_flux(assets, torch.float32), src)
    cfg = make_cfg("flux", assets, demo_data, tmp_path / "runs", **{
        "model": str(src), "model_base": str(tiny_model(assets, "flux-dev")), "train.steps": 2,
        "runtime.checkpoint_every": 0})
    for stage in (encode_captions, cache_latents, train):
        stage.run(cfg)
    converted = list((tmp_path / "runs" / ".model-cache" / "fp8_scaled").glob("*/model.safetensors"))
    assert len(converted) == 1 and (lora_dir(cfg) / "final").is_dir()
    first = converted[0].stat().st_mtime_ns
    loaded = model_source(cfg).load(FluxTransformer2DModel, "transformer", torch_dtype=torch.bfloat16).state_dict()
    assert converted[0].stat().st_mtime_ns == first  # read from the cache, not converted again
    for k, v in expected.items():
        torch.testing.assert_close(loaded[k], v.to(torch.bfloat16), rtol=0, atol=0)


def test_fp8_scaled_reader_refuses_pickles(tmp_path):
    from stages.core.errors import ModelError
    from stages.core.fp8_checkpoint import dense_checkpoint

    bad = tmp_path / "model.ckpt"
    torch.save({"w": torch.zeros(1)}, bad)
    with pytest.raises(ModelError, match="model.ckpt' is not a safetensors file"):
        dense_checkpoint(bad, tmp_path / "cache")


# ---- the bench script the GPU machine runs ---------------------------------------------------------------


def test_the_fp8_bench_runs_every_item_on_the_cpu(tmp_path):
    """bench/fp8.py --smoke: every item it runs on the H200 (the text encoder, the bf16/fp8 fidelity
    runs, the step times) runs on a narrow FLUX on the CPU without error, so a device call does not
    find the script broken (it was: the family loss's batch meta)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "fp8.json"
    cmd = [sys.executable, "bench/fp8.py", "--smoke", "--out", str(out)]
    subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["errors"] == {} and set(res["fidelity"]) == {"bf16", "fp8"}
    assert res["fidelity"]["fp8"]["steps"] == 1 and "vs_bf16" in res["fidelity"]["fp8"]
    assert set(res["step"]) == {"fp8", "bf16"} and "text_encoder" in res
