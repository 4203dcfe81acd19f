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



@cuda
def test_cuda_flags_restored():
    before = global_flags()
    with torch_flags(True, True, True):
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
    assert global_flags() == before
