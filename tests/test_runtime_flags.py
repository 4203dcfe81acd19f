"""The speed flags: validated by the config before anything runs, set for a stage and restored after.

    .venv/bin/python -m pytest -q tests/test_runtime_flags.py

`test_cuda_flags_restored` needs a CUDA GPU and is skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from stages.core.config import ConfigError, load_config
from stages.core.runtime import global_flags, torch_flags

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
        # train.cudnn_attention = true: cuDNN SDPA left as it was, and a warning that says what to do if it crashes
        assert global_flags()["cudnn_sdp"] == before["cudnn_sdp"]
        assert len(notes) == 1 and "train.cudnn_attention = false" in notes[0]
    assert global_flags() == before


def test_cudnn_opt_in_hands_attention_dense_tensors_and_changes_no_result():
    """train.cudnn_attention = true routes SDPA through `cudnn_safe_sdpa` for the stage (and only then): dense
    query/key/value and a dense output gradient, as a FLUX single-stream block would not give it (the attention
    output beside the MLP's in one concatenation: a sliced gradient). Same output and gradients as plain SDPA."""
    import torch.nn.functional as F

    plain = F.scaled_dot_product_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 3, 8, generator=g, requires_grad=True) for _ in range(3))  # (B, S, H, D)
    mlp = torch.randn(2, 40, 16, generator=g, requires_grad=True)

    def block(sdpa):
        seen = {}
        out = sdpa(*(t.permute(0, 2, 1, 3) for t in (q, k, v))).permute(0, 2, 1, 3).flatten(2)
        out.register_hook(lambda grad: seen.update(stride=grad.stride()))
        y = torch.cat([out, mlp], dim=2)  # the single-stream block's concatenation
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        grads = [t.grad.clone() for t in (q, k, v, mlp)]
        for t in (q, k, v, mlp):
            t.grad = None
        return y.detach(), grads, seen["stride"]

    ref, ref_grads, sliced = block(plain)
    assert sliced[1] == 24 + 16  # the attention output's gradient arrives as a slice of the concatenation's
    with torch_flags(False, False, disable_cudnn_attention=False):
        assert F.scaled_dot_product_attention is not plain and F.scaled_dot_product_attention.__wrapped__ is plain
        out, grads, _ = block(F.scaled_dot_product_attention)
    assert F.scaled_dot_product_attention is plain
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    with torch_flags(False, False, disable_cudnn_attention=True):
        assert F.scaled_dot_product_attention is plain  # cuDNN off: nothing to guard


def test_cudnn_guard_makes_the_gradient_dense():
    from stages.core.runtime import cudnn_safe_sdpa

    seen = {}

    def spy(q, k, v, **kw):
        seen["inputs"] = [t.is_contiguous() for t in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
        out.register_hook(lambda grad: seen.update(grad=grad.is_contiguous()))
        return out

    q, k, v = (torch.randn(1, 6, 2, 4, requires_grad=True) for _ in range(3))
    out = cudnn_safe_sdpa(spy)(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2).flatten(2)
    torch.cat([out, torch.zeros(1, 6, 5)], dim=2).sum().backward()
    assert seen == {"inputs": [True, True, True], "grad": True}


@cuda
def test_cuda_flags_restored():
    before = global_flags()
    with torch_flags(True, True, True):
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
    assert global_flags() == before
