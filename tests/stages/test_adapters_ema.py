"""EMA of the adapter weights, adapter types and per-module rank/alpha, on tiny models.

EMA: the saved EMA is the running average the formula gives (checked against the saved weights of
consecutive steps), a resumed run with EMA on ends bit-identical to an uninterrupted one (weights
and EMA), `export-lora --ema` exports the EMA and refuses a run that has none. Invalid settings
are ConfigErrors before any model loads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import comfy_name, demo_config_path, once, run_beside, trained_denoiser
from stages.core.caches import export_dir, lora_dir

EMA = {"train.ema_decay": 0.9}
SHORT = {"train.steps": 3, "train.batch_size": 2, "runtime.checkpoint_every": 1, "runtime.keep_checkpoints": 0}


def new_run(built, name: str, **overrides):
    return run_beside(built, name, **{**SHORT, **overrides})


def weights(folder: Path, name: str = "adapter_model.safetensors") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / name))


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@once
def test_ema_average_resume_and_export(built_run):
    from stages import export_lora, train
    from stages.core.artifacts import ArtifactError

    cfg = new_run(built_run, "ema", **EMA)
    train.run(cfg)
    lora = lora_dir(cfg)
    w = {s: weights(lora / f"checkpoint-{s}") for s in (1, 2, 3)}
    e = {s: weights(lora / f"checkpoint-{s}", "ema_model.safetensors") for s in (1, 2, 3)}
    assert same(e[3], weights(lora / "final", "ema_model.safetensors"))
    d = cfg.train.ema_decay
    for s in (2, 3):  # ema_s = d * ema_(s-1) + (1 - d) * w_s
        for k in w[s]:
            torch.testing.assert_close(e[s][k], d * e[s - 1][k] + (1 - d) * w[s][k], rtol=0, atol=1e-7)
    for k in (k for k in w[1] if "lora_B" in k):  # B starts at zero, so ema_1 = (1 - d) * w_1
        torch.testing.assert_close(e[1][k], (1 - d) * w[1][k], rtol=0, atol=1e-8)
        assert not torch.equal(e[3][k], w[3][k])

    # resume from checkpoint-1: the same weights and EMA as the uninterrupted run
    resumed = new_run(built_run, "ema-resumed", **EMA)
    shutil.copytree(lora / "checkpoint-1", lora_dir(resumed) / "checkpoint-1")
    train.run(resumed, resume=True)
    for name in ("adapter_model.safetensors", "ema_model.safetensors"):
        assert same(weights(lora_dir(resumed) / "final", name), weights(lora / "final", name)), name

    # export --ema: the EMA under diffusers' keys (its scale folded into lora_B); the plain export stays the weights
    saved_cfg = lora_config_of(lora / "final")
    plain = export_lora.run(cfg)
    exported = weights(export_dir(cfg), "pytorch_lora_weights.safetensors")
    assert not plain.get("ema") and _values(exported) == _values(export_lora.scale_folded(w[3], saved_cfg)[0])
    cfg.export.ema = True
    assert export_lora.run(cfg)["ema"] is True  # another fingerprint: rewritten, not "up to date"
    assert _values(weights(export_dir(cfg), "pytorch_lora_weights.safetensors")) \
        == _values(export_lora.scale_folded(e[3], saved_cfg)[0])

    no_ema = new_run(built_run, "no-ema", **{"train.steps": 1})
    train.run(no_ema)
    no_ema.export.ema = True
    with pytest.raises(ArtifactError, match="holds no EMA of the adapter .*train.ema_decay"):
        export_lora.run(no_ema)


def lora_config_of(folder: Path) -> dict:
    from stages.core import lora

    return lora.load_adapter_files(folder)[1]


def _values(state: dict[str, torch.Tensor]) -> list[tuple]:
    """The tensors of a state dict, key names aside (diffusers' file renames peft's keys)."""
    return sorted((tuple(t.shape), t.double().sum().item(), t.double().abs().sum().item()) for t in state.values())


@pytest.mark.parametrize("overrides, message", [
    ({"train.ema_decay": 1.0}, r"'train.ema_decay' = 1.0 must be in \[0, 1\)"),
    ({"runtime.ema_device": "cuda", "train.ema_decay": 0.9, "device": "cpu"}, "'runtime.ema_device' = 'cuda' but 'device' = 'cpu'"),
    ({"runtime.ema_device": "cpu"}, r"'runtime.ema_device' = 'cpu' but 'train.ema_decay' = 0"),
])
def test_invalid_settings_are_config_errors(overrides, message):
    from stages.core.config import load_config
    from stages.core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(demo_config_path("flux"), overrides)


# ---- adapter types and per-module rank/alpha ---------------------------------------------------

TARGETS = ["attn.to_q", "attn.to_out.0"]  # FLUX: to_q is a member of BFL's fused qkv, to_out.0 a module of its own
PATTERNS = {"train.rank_pattern": {"to_out.0": 2}, "train.alpha_pattern": {"to_out.0": 3.0}}
LYCORIS_KEY = r"lora_unet_[a-z0-9_]+\.(lokr_w1|lokr_w1_a|lokr_w1_b|lokr_w2|lokr_w2_a|lokr_w2_b|hada_w1_a|hada_w1_b|" \
              r"hada_w2_a|hada_w2_b|alpha|diff)"


def _comfy_delta(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """A LyCORIS module's weight delta as ComfyUI's weight_adapter (lokr.py, loha.py) builds it,
    written out here independently of stages/core/kohya.py."""
    alpha = parts.get("alpha")
    if "diff" in parts:
        return parts["diff"]
    if "hada_w1_a" in parts:
        dim = parts["hada_w1_b"].shape[0]
        delta = (parts["hada_w1_a"] @ parts["hada_w1_b"]) * (parts["hada_w2_a"] @ parts["hada_w2_b"])
        return delta * (float(alpha) / dim if alpha is not None else 1.0)
    dim = None
    w1, w2 = parts.get("lokr_w1"), parts.get("lokr_w2")
    if w1 is None:
        dim, w1 = parts["lokr_w1_b"].shape[0], parts["lokr_w1_a"] @ parts["lokr_w1_b"]
    if w2 is None:
        dim, w2 = parts["lokr_w2_b"].shape[0], parts["lokr_w2_a"] @ parts["lokr_w2_b"]
    return torch.kron(w1, w2) * (float(alpha) / dim if alpha is not None and dim is not None else 1.0)


@once
@pytest.mark.parametrize("adapter", ["lora", "dora", "lokr", "loha"])
def test_adapter_types_train_resume_and_export(built_run, adapter):
    from safetensors.torch import load_file

    from stages import export_lora, train
    from stages.core import lora
    from stages.families import get_family

    overrides = {"train.adapter": adapter, "train.target_modules": TARGETS, "train.rank": 4, "train.alpha": 8.0,
                 "train.steps": 2, **PATTERNS}
    cfg = new_run(built_run, f"adapter-{adapter}", **overrides)
    train.run(cfg)
    final = lora_dir(cfg) / "final"
    state, saved_cfg = lora.load_adapter_files(final)
    assert lora.adapter_type(saved_cfg) == adapter and saved_cfg["rank_pattern"] == {"to_out.0": 2}
    resumed = new_run(built_run, f"adapter-{adapter}-resumed", **overrides)
    shutil.copytree(lora_dir(cfg) / "checkpoint-1", lora_dir(resumed) / "checkpoint-1")
    train.run(resumed, resume=True)
    assert same(weights(lora_dir(resumed) / "final"), weights(final))

    family = get_family(cfg.family)
    model = trained_denoiser(cfg, final)
    cfg.export.verify = True  # every file checked: in diffusers' loader, and in ComfyUI's key map
    cfg.export.format = "kohya" if adapter in ("lokr", "loha") else "diffusers"
    manifest = export_lora.run(cfg)
    comfy = comfy_name(cfg)
    strengths = manifest["checks"][comfy]
    assert strengths["keys_loaded"] == strengths["keys"] and 0.99 < strengths["strength_min"] <= strengths["strength_max"] < 1.01
    if adapter in ("lora", "dora"):  # diffusers' own loader, output against the in-memory adapter
        from stages.families import pipeline_class
        from test_family import _denoiser_output

        assert manifest["files"] == [export_lora.DIFFUSERS_FILE, comfy]
        pipe = pipeline_class(family).from_pretrained(cfg.model)
        denoiser = getattr(pipe, family.lora_prefix)
        base = _denoiser_output(cfg, family, denoiser)
        pipe.load_lora_weights(str(export_dir(cfg)), weight_name=export_lora.DIFFUSERS_FILE)
        got, want = _denoiser_output(cfg, family, denoiser), _denoiser_output(cfg, family, model)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - base).abs().max() > 1e-4, "the adapter changed nothing: the test cannot tell files apart"
        return
    # LoKr/LoHa: the ComfyUI file, and with --format kohya LyCORIS key names in kohya's layout, whose
    # delta a LyCORIS reader builds equals peft's
    assert manifest["files"] == [comfy, "lora_lycoris.safetensors"]
    tensors = load_file(str(export_dir(cfg) / "lora_lycoris.safetensors"))
    import re

    assert all(re.fullmatch(LYCORIS_KEY, k) for k in tensors), sorted(tensors)[:6]
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name, part = key.rsplit(".", 1)
        modules.setdefault(name, {})[part] = tensor
    layers = dict(model.named_modules())
    checked = set()
    for path in (n for n in layers if n.endswith(tuple(TARGETS)) and hasattr(layers[n], "get_delta_weight")):
        name, index, count = family.kohya_layout.name(path)
        delta = _comfy_delta(modules["lora_unet_" + name])
        out = layers[path].get_delta_weight("default").shape[0]
        rows = delta[index * out:(index + 1) * out] if count > 1 else delta
        if count > 1:
            assert "diff" in modules["lora_unet_" + name]  # fused: the full delta
        else:
            assert "diff" not in modules["lora_unet_" + name]  # own module: the factors themselves
            assert {"lokr_w1", "hada_w1_a"} & set(modules["lora_unet_" + name])
        torch.testing.assert_close(rows, layers[path].get_delta_weight("default").float(), rtol=1e-5, atol=1e-6)
        assert rows.abs().max() > 0
        checked.add((path, count > 1))
    assert {fused for _, fused in checked} == {True, False} and len(checked) == len(modules)  # every module, both kinds
    if adapter == "lokr":  # rank 2 (rank_pattern) decomposes w2, so the file's alpha / dim scale is exercised too
        assert any({"lokr_w2_a", "alpha"} <= set(parts) for parts in modules.values())


def test_adapter_settings_are_config_errors():
    from stages.core.config import load_config
    from stages.core.errors import ConfigError

    cases = [({"train.adapter": "lycoris"}, "train.adapter"),
             ({"train.rank_pattern": {"to_q": 0}}, r"'train.rank_pattern.to_q' = 0 must be >= 1"),
             ({"train.alpha_pattern": {"(to_q": 4.0}}, r"'train.alpha_pattern' key '\(to_q' is not a regular expression"),
             ({"train.rank_pattern": ["to_q"]}, "'train.rank_pattern' must be a table"),
             ({"train.adapter": "dora", "export.format": "kohya"}, "DoRA has no kohya form")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(demo_config_path("flux"), overrides)
