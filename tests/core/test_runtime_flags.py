"""The speed flags: validated by the config before anything runs, set for a stage and restored after.

    .venv/bin/python -m pytest -q tests/core/test_runtime_flags.py

`test_cuda_flags_restored` needs a CUDA GPU and is skipped elsewhere.
"""

from __future__ import annotations

import pytest
from pathlib import Path
import torch

from conftest import FAMILIES, tiny_model
from stages.core.config import ConfigError, load_config
from stages.core.runtime import global_flags, torch_flags

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---- config validation of the flags ---------------------------------------------------------


@pytest.mark.parametrize("key, bad", [
    ("train.base_precision", "int8"), ("runtime.compile_transformer", "maybe"), ("train.optimizer", "sgd"),
    ("captions.text_encoder_precision", "fp8"), ("latents.vae_precision", "nf4"),
])
def test_flag_values_are_validated(key, bad):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, {"model": "x", key: bad})


def test_flag_typo_names_nearest_key():
    with pytest.raises(ConfigError, match="did you mean 'runtime.compile_transformer'"):
        load_config(None, {"model": "x", "train.compile_transformers": "on"})


def test_flag_errors_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config(None, {"model": "x", "train.base_precision": "int8", "runtime.enable_tf32": "perhaps"})
    assert "train.base_precision" in str(err.value) and "runtime.enable_tf32" in str(err.value)


# ---- global torch state ---------------------------------------------------------------------


def test_torch_flags_set_and_restored():
    before = global_flags()
    with torch_flags(enable_tf32=True, cudnn_benchmark=True, disable_cudnn_attention=True) as notes:
        inside = global_flags()
        assert inside["float32_matmul_precision"] == "high" and inside["matmul_tf32"] and inside["cudnn_tf32"]
        assert inside["cudnn_benchmark"] is True and inside["cudnn_sdp"] is False
        assert notes and "cuDNN's is off" in notes[0]
    assert global_flags() == before


def test_the_attention_notice_is_info_only_where_cudnn_would_run():
    """Train notes that cuDNN attention is off only on a GPU where PyTorch would use it (Hopper and up),
    and says nothing once it is allowed or off a GPU; the note is an info line, never a warning."""
    from stages.core.events import EVENT_SCHEMA, terminal_line, validate_event
    from stages.core.runtime import attention_notice

    assert attention_notice(False, (9, 0)) and attention_notice(False, (10, 0))
    assert attention_notice(True, (9, 0)) is None and attention_notice(False, (8, 0)) is None
    assert attention_notice(False, None) is None
    record = {"event": "info", "stage": "train", "message": attention_notice(False, (9, 0))}
    assert "info" in EVENT_SCHEMA and terminal_line(record, 0, Path("."))[0].startswith("note: attention")
    assert validate_event({"ts": 1.0, "run": "r", **record}) == []


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
        # runtime.cudnn_attention = true: cuDNN SDPA left as it was, and a warning that says what to do if it crashes
        assert global_flags()["cudnn_sdp"] == before["cudnn_sdp"]
        assert len(notes) == 1 and "runtime.cudnn_attention = false" in notes[0]
    assert global_flags() == before



# ---- cuDNN attention: one output-gradient layout per cached backward graph ----------------------------------


def layout_spy(sdpa, layouts: dict):
    """`sdpa` recording, per attention call that takes a gradient, its query/key/value shape and strides (what
    torch keys cuDNN's cached backward graph by) and the strides of the output gradient that reaches `sdpa`'s
    own backward (also used by bench/attention_layouts.py)."""

    def spy(*args, **kwargs):
        q, k, v = (kwargs.get(n, a) for n, a in zip(("query", "key", "value"), args + (None,) * 3))
        out = sdpa(*args, **kwargs)
        if out.requires_grad:
            seen = layouts.setdefault((tuple(q.shape), q.stride(), k.stride(), v.stride()), set())
            out.register_hook(lambda grad: seen.add(grad.stride()))
        return out
    return spy


def _attention_layouts(model, guard: bool) -> tuple[dict, torch.Tensor, list[torch.Tensor]]:
    """One forward and backward of a tiny real transformer: `layout_spy`'s record of every attention call; with
    `guard`, through the train stage's `runtime.cudnn_attention = true` wrapper."""
    import torch.nn.functional as F

    plain, layouts = F.scaled_dot_product_attention, {}
    spy = layout_spy(plain, layouts)

    c, g = model.config, torch.Generator().manual_seed(0)
    img, txt = 64, 8
    kw = dict(hidden_states=torch.randn(1, img, c.in_channels, generator=g),
              encoder_hidden_states=torch.randn(1, txt, c.joint_attention_dim, generator=g), timestep=torch.full((1,), 0.5),
              guidance=torch.ones(1) if c.guidance_embeds else None)
    if "pooled_projection_dim" in c:  # FLUX.1: pooled text, ids (tokens, 3)
        kw.update(pooled_projections=torch.randn(1, c.pooled_projection_dim, generator=g), img_ids=torch.zeros(img, 3),
                  txt_ids=torch.zeros(txt, 3))
    else:  # FLUX.2: ids (batch, tokens, 4)
        kw.update(img_ids=torch.zeros(1, img, 4), txt_ids=torch.zeros(1, txt, 4))
    model.zero_grad(set_to_none=True)
    F.scaled_dot_product_attention = spy
    try:
        with torch_flags(False, False, disable_cudnn_attention=not guard):
            out = model(**kw, return_dict=False)[0]
            (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    finally:
        F.scaled_dot_product_attention = plain
    return layouts, out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", ["flux", "flux2-klein"])
def test_cudnn_attention_backward_sees_one_gradient_layout_per_cached_graph(assets, family):
    """torch caches cuDNN's attention backward by query/key/value layout only and keeps the output-gradient
    strides it was built with. FLUX.1's single-stream blocks (attention output concatenated with the MLP's)
    hand a sliced gradient under the same key as the double blocks' dense one: the crash FLUX.1 Kontext had
    with cuDNN. Under `runtime.cudnn_attention = true` every key sees one layout, and nothing else changes."""
    import diffusers

    folder = tiny_model(assets, FAMILIES[family])
    cls = __import__("json").loads((folder / "transformer" / "config.json").read_text())["_class_name"]
    model = getattr(diffusers, cls).from_pretrained(str(folder), subfolder="transformer")
    plain, out, grads = _attention_layouts(model, guard=False)
    guarded, out_g, grads_g = _attention_layouts(model, guard=True)
    mixed = {k for k, v in plain.items() if len(v) > 1}
    # FLUX.2's single blocks take their value from a fused projection: another key, one layout each (klein ran)
    assert bool(mixed) == (family == "flux"), plain
    assert guarded.keys() == plain.keys() and all(len(v) == 1 for v in guarded.values()), guarded
    torch.testing.assert_close(out_g, out, rtol=0, atol=0)
    assert len(grads_g) == len(grads) and all(torch.equal(a, b) for a, b in zip(grads_g, grads))


@cuda
def test_cuda_flags_restored():
    before = global_flags()
    with torch_flags(True, True, True):
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
    assert global_flags() == before


def test_device_auto_is_told_without_importing_torch(tmp_path):
    """`status` of a run with device = "auto" imports no torch to learn its device type: "cpu" where no GPU can be
    seen (every GPU hidden here), and where one can, "cuda" for a CUDA build of torch and "cpu" for a CPU build,
    read from torch's version.py. The fake torch below fails if it is imported."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = ("import sys\nfrom stages.core import runtime\n"
            "if sys.argv[1] == 'gpu':\n    runtime.nvidia_gpu_possible = lambda: True\n"
            "print(runtime.device_type('auto'), 'torch' in sys.modules)")

    def told(gpu: str, build: str | None) -> list[str]:
        fake = tmp_path / str(build) / "torch"
        fake.mkdir(parents=True, exist_ok=True)
        (fake / "__init__.py").write_text("raise ImportError('torch was imported')\n")
        (fake / "version.py").write_text(f"from typing import Optional\n__version__ = '2.11.0'\n"
                                         f"cuda: Optional[str] = {build!r}\n")
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{fake.parent}:{root}", "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.run([sys.executable, "-c", code, gpu], cwd=root, capture_output=True, text=True,
                              timeout=60, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    assert told("hidden", "13.0") == ["cpu", "False"]
    assert told("gpu", "13.0") == ["cuda", "False"]
    assert told("gpu", None) == ["cpu", "False"]
