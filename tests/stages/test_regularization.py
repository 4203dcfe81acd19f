"""train.preservation (differential output preservation) and train.assistant_adapter on the tiny FLUX run:
the preservation target is the base denoiser's own output, weight 0 trains exactly the plain run, a resume
stays bit-exact with it on; the assistant LoRA is merged into the base for training only and never exported.

    .venv/bin/python -m pytest -q tests/stages/test_regularization.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import losses_and_lora, run_beside
from stages.core import flow, lora
from stages.core.errors import ConfigError
from stages.core.caches import lora_dir

flux_run = pytest.mark.parametrize("built_run", ["flux"], indirect=True)


def _trainer(built, name: str, **overrides):
    """A set-up Trainer of a run beside `built`; with preservation = blank_prompt its caption cache gains the
    empty caption's row (encode-captions adds just that row)."""
    from stages import encode_captions
    from stages.core.events import EventLog
    from stages.train.trainer import Trainer

    cfg = run_beside(built, name, **overrides)
    if cfg.train.preservation == "blank_prompt":
        encode_captions.run(cfg)
    trainer = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
    torch.manual_seed(0)
    trainer.setup_model()
    return trainer


def _randomize_adapter(trainer) -> None:
    """LoRA B starts at zero (the adapter is then the identity): give it weights so adapter on and off differ."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@flux_run
def test_preservation_target_is_the_base_denoisers_output(built_run):
    trainer = _trainer(built_run, "dop-target", **{"train.preservation": "blank_prompt"})
    _randomize_adapter(trainer)
    trainer.model.eval()
    _, (batch, eps, noise, t) = trainer.draw_next()
    assert batch.blank_cond is not None and batch.blank_cond["prompt_embeds"].shape == batch.cond["prompt_embeds"].shape
    blank = dataclasses.replace(batch, cond=batch.blank_cond)
    got = trainer.base_prediction(blank, eps, noise, t)

    plain = trainer.family.load_denoiser(trainer.src, trainer.precision, trainer.rt, trainer.tcfg)  # no LoRA at all
    with torch.no_grad(), flow.captured_prediction() as seen:
        trainer._per_sample_loss(plain, blank, eps, noise, t)
    assert torch.equal(got, seen[0])
    with torch.no_grad(), flow.captured_prediction() as adapted:
        trainer._per_sample_loss(trainer.model, blank, eps, noise, t)
    assert not torch.allclose(adapted[0], got)  # the adapter is back on after it, and changes the output
    # the preservation loss is the loss of the adapter's prediction against exactly that target
    with torch.no_grad():
        want = flow.per_sample_loss(adapted[0], got, None, trainer.tcfg, t).mean()
        torch.testing.assert_close(trainer.preservation_loss(batch, eps, noise, t), want)


@flux_run
def test_preservation_weight_zero_trains_the_plain_run(built_run):
    plain = losses_and_lora(_trainer(built_run, "dop-off"), 3)
    zero = losses_and_lora(_trainer(built_run, "dop-zero", **{"train.preservation": "blank_prompt",
                                                              "train.preservation_weight": 0.0}), 3)
    on = losses_and_lora(_trainer(built_run, "dop-on", **{"train.preservation": "blank_prompt"}), 3)
    assert torch.equal(zero[0], plain[0]) and torch.equal(zero[1], plain[1])
    assert not torch.equal(on[1], plain[1])  # the term trains something once the adapter is not zero


@flux_run
def test_regularization_items_train_toward_the_base_prediction(built_run):
    """Role "regularization" rows: loss against the base model's prediction on their caption, times the
    weight; the other rows of the batch keep their plain loss."""
    trainer = _trainer(built_run, "dop-dataset", **{"train.batch_size": 2})
    _randomize_adapter(trainer)
    trainer.model.eval()
    for _ in range(8):
        _, (batch, eps, noise, t) = trainer.draw_next()
        if len(batch.keys) == 2:
            break
    with torch.no_grad():
        plain = trainer._per_sample_loss(trainer.model, batch, eps, noise, t)
        base = trainer.base_prediction(batch, eps, noise, t)
        with flow.captured_prediction() as adapted:
            trainer._per_sample_loss(trainer.model, batch, eps, noise, t)
        toward_base = flow.per_sample_loss(adapted[0], base, None, trainer.tcfg, t)
        batch.regularization = torch.tensor([True, False])
        for weight in (0.0, 0.5):
            trainer.tcfg = dataclasses.replace(trainer.tcfg, preservation="dataset", preservation_weight=weight)
            got = trainer.compute_loss(batch, eps, noise, t)
            torch.testing.assert_close(got, (weight * toward_base[0] + plain[1]) / 2)


def test_regularization_datasets_need_preservation_dataset(tmp_path):
    from stages.core.config import load_config

    def config(preservation: str, roles: tuple[str, ...]) -> None:
        tables = "".join(f'[[datasets]]\npath = "d{i}"\nrole = "{r}"\n' for i, r in enumerate(roles))
        (tmp_path / "c.toml").write_text(f'model = "m"\n[train]\npreservation = "{preservation}"\n{tables}')
        load_config(tmp_path / "c.toml")

    config("dataset", ("train", "regularization"))
    with pytest.raises(ConfigError, match="no \\[\\[datasets\\]\\] table has role = 'regularization'"):
        config("dataset", ("train",))
    with pytest.raises(ConfigError, match="set train.preservation = 'dataset'"):
        config("off", ("train", "regularization"))
    with pytest.raises(ConfigError, match="'datasets\\[0\\].role' = 'mask' is not one of 'train', 'regularization'"):
        config("off", ("mask",))


@flux_run
def test_resume_is_bit_exact_with_preservation(built_run, monkeypatch):
    from stages import encode_captions, train
    from stages.core import faults
    from test_resume import STOP_AT, TRAIN, adapter, assert_same_adapter, run_events

    on = {**TRAIN, "train.preservation": "blank_prompt", "train.preservation_weight": 0.5}
    whole = run_beside(built_run, "dop-whole", **on)
    encode_captions.run(whole)
    train.run(whole)
    stopped = run_beside(built_run, "dop-stopped", **on)
    encode_captions.run(stopped)
    monkeypatch.setenv(faults.ENV, f"train:{STOP_AT}:TERM")
    assert train.run(stopped)["step"] == STOP_AT
    monkeypatch.delenv(faults.ENV)
    train.run(stopped, resume=True)
    assert_same_adapter(adapter(lora_dir(stopped) / "final"), adapter(lora_dir(whole) / "final"))
    want = {e["step"]: e["loss"] for e in run_events(whole, "step") if e["step"] > STOP_AT}
    assert {e["step"]: e["loss"] for e in run_events(stopped, "step")} == want


# ---- train.assistant_adapter ---------------------------------------------------------------------------

ASSISTANT_TARGETS = ["ff.net.2"]  # modules the trained adapter (attention q and k there) does not touch


def _assistant_file(built, folder):
    """A random diffusers LoRA file of the tiny FLUX transformer, written as export-lora writes one."""
    from stages.core.caches import write_diffusers
    from stages.core.runtime import make_runtime
    from stages.families import get_family
    from stages.core.model_source import model_source

    family = get_family("flux")
    model = family.load_denoiser(model_source(built), "fp32", make_runtime("cpu", "fp32"), built.train)
    config = lora.lora_config(4, 2.0, 0.0, ASSISTANT_TARGETS)
    lora.attach_lora(model, config)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"pipeline_class": family.pipeline_class, "lora_prefix": family.lora_prefix, "family": "flux"}
    return write_diffusers(lora.adapter_state_dict(model), lora.config_dict(config), manifest, folder), family


@flux_run
def test_assistant_is_merged_into_the_base(built_run, tmp_path):
    from peft.tuners.tuners_utils import BaseTunerLayer

    from stages.core.model_source import model_source
    from stages.core.runtime import make_runtime

    file, family = _assistant_file(built_run, tmp_path / "assistant")
    load = lambda: family.load_denoiser(model_source(built_run), "fp32", make_runtime("cpu", "fp32"), built_run.train)  # noqa: E731
    merged, unmerged, base = load(), load(), load()
    assert lora.merge_assistant(merged, str(tmp_path / "assistant"), "transformer", "fp32") > 0
    assert not any(isinstance(m, BaseTunerLayer) for m in merged.modules())
    assert not any(p.requires_grad for p in merged.parameters())
    unmerged.load_lora_adapter(str(file.parent), weight_name=file.name, prefix="transformer")
    w = "transformer_blocks.0.ff.net.2.weight"
    assert not torch.equal(merged.state_dict()[w], base.state_dict()[w])
    layer = merged.transformer_blocks[0].ff.net[2]
    x = torch.randn(1, 16, layer.in_features)
    torch.testing.assert_close(layer(x), unmerged.transformer_blocks[0].ff.net[2](x))
    with pytest.raises(ConfigError, match="train.assistant_adapter is merged into the base weights, which a nf4 base"):
        lora.merge_assistant(load(), str(file), "transformer", "nf4")


@flux_run
def test_assistant_trains_is_fingerprinted_and_never_exported(built_run, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from stages import export_lora, train
    from stages.core.artifacts import fingerprint, read_manifest
    from stages.train.stage import fingerprint_parts

    file, _ = _assistant_file(built_run, tmp_path / "assistant")
    cfg = run_beside(built_run, "assistant", **{"train.steps": 2, "train.assistant_adapter": str(file),
                                                "train.target_modules": ["attn.to_q", "attn.to_k"]})
    parts = fingerprint_parts(cfg)
    assert parts["assistant"]["path"] == str(file) and len(parts["assistant"]["sha256"]) == 64
    train.run(cfg)
    final = read_manifest(lora_dir(cfg) / "final")
    assert final["assistant_adapter"] == parts["assistant"]

    def never(*args, **kwargs):
        raise AssertionError("the assistant adapter was loaded outside training")

    monkeypatch.setattr(lora, "merge_assistant", never)
    export_lora.run(cfg)
    trained = load_file(str(lora_dir(cfg) / "final" / lora.ADAPTER_WEIGHTS))
    exported = [p for p in export_lora.artifact_dir(cfg).rglob("*.safetensors")]
    assert exported
    for path in exported:
        keys = load_file(str(path)).keys()
        assert keys and not any("ff.net.2" in k or "ff_net_2" in k or "mlp" in k for k in keys), path
    diffusers_file = [p for p in exported if "comfyui" not in p.name and "kohya" not in p.name][0]
    assert len(load_file(str(diffusers_file))) == len(trained)

    # sample renders the base and the exported LoRA: every adapter it loads is the trained one
    from diffusers.loaders.peft import PeftAdapterMixin

    from stages import sample
    from stages.core.config import SampleConfig

    loaded, original = [], PeftAdapterMixin.load_lora_adapter

    def spy(self, source, *args, **kwargs):
        loaded.append(sorted(source) if isinstance(source, dict) else [str(source), kwargs.get("weight_name")])
        return original(self, source, *args, **kwargs)

    monkeypatch.setattr(PeftAdapterMixin, "load_lora_adapter", spy)
    sample.run(dataclasses.replace(cfg, sample=SampleConfig(prompts=["a blue square"], seeds=[0], steps=2, width=32,
                                                            height=32)))
    assert loaded and not any("ff.net.2" in k or str(file) in k or file.name == k for keys in loaded for k in keys if k)

    # its content is fingerprinted: another file at the same path is another base
    other, _ = _assistant_file(built_run, tmp_path / "other")
    file.write_bytes(other.read_bytes().replace(b"lorapipe", b"LORAPIPE"))
    assert fingerprint(fingerprint_parts(cfg)) != fingerprint(parts)


@flux_run
def test_new_keys_are_fingerprinted(built_run):
    from stages.core.artifacts import fingerprint
    from stages.train.stage import fingerprint_parts

    base = fingerprint(fingerprint_parts(built_run))
    for key, value in (("preservation", "blank_prompt"), ("preservation_weight", 0.5)):
        changed = run_beside(built_run, f"fp-{key}", **{f"train.{key}": value})
        assert fingerprint(fingerprint_parts(changed)) != base, key


def test_distilled_model_ids_get_an_info_line():
    from stages.train.trainer import distilled_note

    assert "train.assistant_adapter" in distilled_note("Tongyi-MAI/Z-Image-Turbo")
    assert "base checkpoint" in distilled_note("black-forest-labs/FLUX.1-schnell")
    assert distilled_note("black-forest-labs/FLUX.1-dev") is None


def test_auto_precision_with_an_assistant_leaves_out_the_quantized_bases():
    from conftest import ROOT
    from stages.core.config import load_config
    from stages.core.memory.train import _base_precisions
    from stages.families import get_family

    for assistant, want in (("", True), ("de-distill.safetensors", False)):
        cfg = load_config(ROOT / "configs" / "demo.toml", {"train.base_precision": "auto",
                                                             "train.assistant_adapter": assistant})
        precisions, _, _ = _base_precisions(cfg, get_family("flux"), 0.0, 0)
        assert precisions[0] == "bf16" and ("nf4" in precisions) == want, (assistant, precisions)


@flux_run
def test_a_regularization_dataset_trains_end_to_end(built_run):
    """Two [[datasets]] tables over the same images, one of role regularization: its items reach the loss
    flagged, the run trains, and the role is in the fingerprint."""
    from stages import cache_latents, encode_captions, train
    from stages.core.events import EventLog
    from stages.train.stage import fingerprint_parts
    from stages.train.trainer import Trainer

    tables = [{"path": built_run.data.path, "name": "subject"},
              {"path": built_run.data.path, "name": "class", "role": "regularization"}]
    cfg = run_beside(built_run, "dop-datasets", datasets=tables,
                     **{"train.preservation": "dataset", "train.steps": 2, "train.batch_size": 2})
    encode_captions.run(cfg)
    cache_latents.run(cfg)
    assert [s.get("role") for s in fingerprint_parts(cfg)["sampling"]] == [None, "regularization"]
    trainer = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
    assert {p.key.split("/")[0]: p.regularization for p in trainer.data.pairs} == {"subject": False, "class": True}
    flagged = [trainer.draw_next()[1][0] for _ in range(12)]
    assert any(b.regularization is not None and bool(b.regularization.any()) for b in flagged)
    assert all(b.regularization is None or b.regularization.tolist() == [k.startswith("class/") for k in b.keys]
               for b in flagged)
    assert train.run(cfg)["complete"]
