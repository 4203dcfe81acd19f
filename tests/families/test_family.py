"""Training-math equivalences, run for every family on its tiny real architecture.

cached = uncached, batched = single, export round trip, ids not positions, LR schedule, it learns.
`built_run` (conftest) has already run the four stages in-process on the demo config.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from stages import cache_latents, train
from stages.core import aspect_buckets, image_io, lora, video
from stages.core.events import EventLog, read_events
from stages.core.model_source import ModelSource, stored_dtypes
from stages.core.runtime import make_runtime
from stages.core.schema import Bucket
from stages.train.trainer import Trainer, build_data
from conftest import FAMILIES, ROOT, trained_denoiser
from stages.families import get_family, pipeline_class
from stages.core.caches import export_dir


def _trainer(cfg):
    t = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
    t.setup_model()
    return t


def _on_the_fly(cfg, family, vae, item, bucket: object, k: int):
    """Encode variant k of an item with the VAE now, exactly as cache-latents planned it."""
    b = Bucket.parse(str(bucket))  # a Bucket or its "WxH" (clips: "WxHxFf") name
    info = video.probe(item.image_path) if item.is_clip else None
    size = (info.width, info.height) if info else image_io.image_size(item.image_path)
    variants = aspect_buckets.plan_variants(item.image_id, size, b, cfg.data.cache_variants, cfg.seed,
                                     cfg.data.random_flip, cfg.data.crop, cfg.data.crop_zoom)
    if info:  # a clip: its frames from this variant's start
        pixels = cache_latents._clip_pixels(item, info, variants, b, cfg.data, cfg)[1][k:k + 1]
    else:
        pixels = cache_latents._pixels(image_io.load_image(item.image_path, cfg.data.background), [variants[k]], b)
    with torch.no_grad():
        return family.encode_posterior(vae, pixels)


@pytest.fixture(scope="module")
def vae_of(built_run):
    family = get_family(built_run.family)
    return family, family.load_vae(ModelSource(built_run.model), make_runtime("cpu", "fp32"))


def test_cached_equals_uncached(built_run, vae_of):
    cfg = built_run
    family, vae = vae_of
    trainer = _trainer(cfg)
    pair_index = 1
    pair = trainer.data.pairs[pair_index]
    item = next(it for it in cache_latents.scan_items(cfg) if it.key == pair.key)
    g = torch.Generator().manual_seed(7)
    for k in (0, 1):  # variant 1 is flipped
        mean, logvar = _on_the_fly(cfg, family, vae, item, pair.bucket, k)
        batch = trainer.data.load([pair_index], [k])
        # the cache encoded all variants in one VAE batch, this encodes one: float32 kernels for
        # different batch sizes round differently (~1e-4 on this random VAE), hence the tolerance
        torch.testing.assert_close(batch.mean, mean.float(), rtol=1e-4, atol=3e-4)
        torch.testing.assert_close(batch.logvar, logvar.float(), rtol=1e-4, atol=3e-4)
        eps, noise = torch.randn(mean.shape, generator=g), torch.randn(mean.shape, generator=g)
        t = family.sample_timesteps(1, tuple(mean.shape[-2:]), g, cfg.train)
        with torch.no_grad():
            cached = trainer.compute_loss(batch, eps, noise, t)
            batch.mean, batch.logvar = mean.float(), logvar.float()
            uncached = trainer.compute_loss(batch, eps, noise, t)
        torch.testing.assert_close(cached, uncached, rtol=1e-4, atol=1e-5)


def _perturb_lora(model, seed=0):
    """Make the LoRA up-projections non-zero so gradients reach both LoRA matrices."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def test_batched_equals_single(built_run):
    trainer = _trainer(built_run)
    _perturb_lora(trainer.model)
    bucket, members = max(trainer.data.buckets().items(), key=lambda kv: len(kv[1]))
    assert len(members) >= 4, f"bucket {bucket} needs 4 items for this test"
    idx = members[:4]
    g = torch.Generator().manual_seed(3)
    batch = trainer.data.load(idx, [0, 1, 2, 3])
    eps, noise = torch.randn(batch.mean.shape, generator=g), torch.randn(batch.mean.shape, generator=g)
    t = trainer.family.sample_timesteps(4, tuple(batch.mean.shape[-2:]), g, built_run.train)

    def loss_and_grads(sel):
        trainer.model.zero_grad(set_to_none=True)
        b = trainer.data.load([idx[i] for i in sel], [sel_i for sel_i in sel])
        loss = trainer.compute_loss(b, eps[sel], noise[sel], t[sel])
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.params]

    full_loss, full_grads = loss_and_grads([0, 1, 2, 3])
    singles = [loss_and_grads([i]) for i in range(4)]
    torch.testing.assert_close(full_loss, sum(s[0] for s in singles) / 4, rtol=1e-5, atol=1e-6)
    for j, g_full in enumerate(full_grads):
        torch.testing.assert_close(g_full, sum(s[1][j] for s in singles) / 4, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in full_grads)


def _capture(model):
    """Record the denoiser's raw output of its next forward."""
    out = {}

    def hook(module, args, output):
        y = output[0] if isinstance(output, tuple) else getattr(output, "sample", output)
        out["y"] = (torch.stack(y) if isinstance(y, list) else y).detach().clone()

    return out, model.register_forward_hook(hook)


def _denoiser_output(cfg, family, model, seed=5):
    """The denoiser's raw prediction on two cached items with fixed noise and timesteps."""
    data, lat_manifest = build_data(cfg)
    members = data.buckets()[str(data.pairs[0].bucket)][:2]
    batch = data.load(members, [0] * len(members))
    g = torch.Generator().manual_seed(seed)
    x0 = family.normalize_latents(batch.mean, lat_manifest["normalization"])
    noise = torch.randn(x0.shape, generator=g)
    t = family.sample_timesteps(x0.shape[0], tuple(x0.shape[-2:]), g, cfg.train)
    out, handle = _capture(model)
    with torch.no_grad():
        family.loss(model, x0, noise, t, batch.cond, batch.meta, cfg.train)
    handle.remove()
    return out["y"]


def test_export_round_trip(built_run):
    from peft.utils import get_peft_model_state_dict

    from stages import export_lora
    from safetensors import safe_open

    cfg = built_run
    family = get_family(cfg.family)
    export = export_dir(cfg)
    final = train.artifact_dir(cfg)
    adapter, adapter_cfg = lora.load_adapter_files(final)
    assert adapter_cfg["r"] != adapter_cfg["lora_alpha"], "use lora_alpha != rank so the metadata matters"

    pipe = pipeline_class(family).from_pretrained(cfg.model)
    denoiser = getattr(pipe, family.lora_prefix)
    base_out = _denoiser_output(cfg, family, denoiser)
    pipe.load_lora_weights(str(export), weight_name="pytorch_lora_weights.safetensors")

    with safe_open(str(export / "pytorch_lora_weights.safetensors"), "pt") as f:
        file_keys = {k.removeprefix(f"{family.lora_prefix}.") for k in f.keys()}
        assert "lora_adapter_metadata" in (f.metadata() or {}) or any("metadata" in k for k in (f.metadata() or {}))
    loaded = {k.replace(".default_0", "").replace(".default", ""): v for k, v in get_peft_model_state_dict(denoiser, adapter_name="default_0").items()}
    assert file_keys == set(adapter), "exported keys differ from the trained adapter's"
    assert set(loaded) == set(adapter), "pipeline loaded a different set of LoRA keys (missing/unexpected)"
    folded, _ = export_lora.scale_folded(adapter, adapter_cfg)  # the file carries alpha / rank in lora_B
    for k, v in folded.items():
        torch.testing.assert_close(loaded[k].float(), v)

    expected = _denoiser_output(cfg, family, trained_denoiser(cfg, final))
    got = _denoiser_output(cfg, family, denoiser)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - base_out).abs().max() > 1e-4, "the LoRA changed nothing: the test cannot tell files apart"


def test_ids_not_positions(built_run, vae_of):
    """Every batch of a shuffled epoch pairs each latent with its own image and its own caption."""
    cfg = built_run
    family, vae = vae_of
    trainer = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
    encoder = family.load_text_encoder(ModelSource(cfg.model), cfg.captions, make_runtime("cpu", "fp32"))
    items = {it.key: it for it in cache_latents.scan_items(cfg)}  # as the family keys them
    assert len({it.caption for it in items.values()}) == len(items), "captions must be distinct"
    seen = set()
    for _ in range(len(trainer.sampler.epoch_batches(0))):
        _, indices = trainer.sampler.next()
        batch = trainer.data.load(indices, [i % cfg.data.cache_variants for i in range(len(indices))])
        for i, key in enumerate(batch.keys):
            seen.add(key)
            sees = family.text_sees_controls  # edit families whose text reads the controls
            expected = encoder.encode([items[key].caption], **({"controls": [[image_io.load_image(p) for p in
                                                                             items[key].controls]]} if sees else {}))
            for name, value in expected.items():
                torch.testing.assert_close(batch.cond[name][i:i + 1].float(), value.float(), rtol=1e-4, atol=1e-5,
                                           msg=f"caption field {name} of {key} belongs to another item")
            mean, _ = _on_the_fly(cfg, family, vae, items[key], trainer.data.pairs[indices[i]].bucket, i % cfg.data.cache_variants)
            torch.testing.assert_close(batch.mean[i:i + 1], mean.float(), rtol=1e-4, atol=3e-4)
    assert seen == set(items), "one epoch must visit every item"
    assert trainer.sampler.epoch_batches(0) != trainer.sampler.epoch_batches(1), "epochs must reshuffle"


def _expected_lr(tcfg, k: int) -> float:
    """LR of the k-th update (0-based) for linear warmup + half-cosine decay to 0, written out
    independently of diffusers (its "cosine" is one half cosine whatever lr_num_cycles says)."""
    base, w, n = tcfg.learning_rate, tcfg.lr_warmup_steps, tcfg.steps
    if k < w:
        return base * k / max(1, w)
    progress = (k - w) / max(1, n - w)
    return base * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


# the edit demos' own learning test trains their full schedule on their demo models (tests/e2e/test_edit_demo.py)
@pytest.mark.parametrize("built_run", sorted(set(FAMILIES) - {"flux-kontext", "qwen-image-edit"}), indirect=True)
def test_lr_schedule_and_it_learns(built_run, tmp_path):
    """The full demo schedule: events report the configured LR each step, and the loss falls."""
    from stages.core.config import load_config

    src = built_run
    run_dir = tmp_path / src.run
    for name in ("captions.zarr", "latents.zarr"):
        shutil.copytree(src.run_dir / name, run_dir / name)
    cfg = load_config(None, {**_flat(src.to_dict()), "artifacts": str(tmp_path)})
    cfg.train.steps = load_config(_demo(src.family)).train.steps
    assert cfg.train.lr_scheduler == "cosine" and cfg.train.lr_warmup_steps > 0
    train.run(cfg)
    steps = [e for e in read_events(run_dir) if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, cfg.train.steps + 1))
    for e in steps:
        assert e["lr"] == pytest.approx(_expected_lr(cfg.train, e["step"] - 1), rel=1e-6, abs=1e-12), e
    losses = [e["loss"] for e in steps]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.85 * first, f"loss did not fall: first 10 steps {first:.4f}, last 10 {last:.4f}"


def _demo(family):
    from stages.demo import demo_config

    return demo_config(family)


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---- config checks, made from the config alone before any model loads -------------------------


def _preset(name: str, **overrides):
    from stages.core.config import load_config

    return load_config(_demo(name), {"model": "unused", **overrides})


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_shipped_configs_pass_their_family_checks(name):
    from pathlib import Path

    from stages.core.config import load_config
    from stages.families import config_errors

    presets = [p for p in sorted(Path(_demo(name)).parent.glob("*.toml")) if load_config(p).family == name]
    assert presets, f"no config of family {name} in configs/"
    for path in presets:
        assert config_errors(load_config(path)) == [], path


@pytest.mark.parametrize("name, overrides, wanted", [
    ("flux", {"captions.max_sequence_length": 513}, ["'captions.max_sequence_length' = 513", "1..512"]),
    ("qwen-image", {"captions.max_sequence_length": 1025}, ["'captions.max_sequence_length' = 1025", "1..1024"]),
    ("sdxl", {"captions.max_sequence_length": 76}, ["'captions.max_sequence_length' = 76", "set it to 77"]),
    ("sdxl", {"captions.text_encoder_precision": "nf4"}, ["'captions.text_encoder_precision' = 'nf4'", "'bf16'"]),
    ("z-image", {"data.bucket_step": 15}, ["'data.bucket_step' = 15", "multiple of 2"]),
])
def test_family_config_checks_name_key_value_and_range(name, overrides, wanted):
    from stages.families import config_errors

    from stages.core.errors import ConfigError

    assert config_errors(_preset(name)) == []
    with pytest.raises(ConfigError) as err:  # loading runs the family's checks with the others
        _preset(name, **overrides)
    assert all(w in str(err.value) for w in wanted), err.value


def test_config_checks_import_no_torch():
    """The checks run while a config loads (also for `status`): the family folders' __init__ stay torch-free."""
    import subprocess
    import sys

    code = ("import sys; from stages.families import FAMILIES, config_errors, family_part, demo_variant; "
            "[family_part(f).config_errors for f in FAMILIES]; [demo_variant(f) for f in FAMILIES]; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_an_fp8_base_predicts_as_the_bf16_base_and_streams_its_load(built_run, monkeypatch):
    """train.base_precision = "fp8" for every family: the Linears inside the denoiser's repeated blocks
    become e4m3 with per-channel scales (the tiny widths made eligible: min_width 16, the one change from
    a real run), none outside them, and the prediction on two cached items stays within e4m3's error of
    the bf16 base's: 0.3-2.4 % relative RMS across the ten families (one layer's output is ~3.7 % off,
    bench/fp8.md). train's fp8 load, which streams the folder's safetensors tensor by tensor instead of
    reading the bf16 base into host memory, gives that quantized model bit for bit."""
    from stages.core import fp8

    cfg = built_run
    family, src, rt = get_family(cfg.family), ModelSource(cfg.model), make_runtime("cpu", "bf16")
    dense = family.load_denoiser(src, "bf16", rt, cfg.train)
    inside = fp8.inside_repeated_blocks(dense)
    quantized = fp8.quantize_denoiser_fp8(family.load_denoiser(src, "bf16", rt, cfg.train), inside, "cpu", min_width=16)
    made = [n for n, m in quantized.named_modules() if isinstance(m, fp8.Fp8Linear)]
    assert made and not any(inside(n, None) for n in made)  # all inside the blocks
    assert not any(type(m) is torch.nn.Linear and fp8.fp8_eligible(m, 16) and not inside(n, m)
                   for n, m in quantized.named_modules())  # every eligible block Linear was made fp8
    want, got = _denoiser_output(cfg, family, dense).float(), _denoiser_output(cfg, family, quantized).float()
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.05, rel
    # the load train makes: the folder's shards streamed tensor by tensor, never read whole in bf16
    monkeypatch.setattr(fp8, "MIN_WIDTH", 16)
    monkeypatch.setattr(fp8, "require_fp8_device", lambda device: None)  # the CPU has no fp8 matmul to refuse
    monkeypatch.setattr(ModelSource, "load", lambda *a, **k: pytest.fail("the fp8 load read the whole bf16 base"))
    streamed = fp8.load_fp8_denoiser(type(dense), src, family.denoiser_components[0], torch.device("cpu"))
    assert [n for n, m in streamed.named_modules() if isinstance(m, fp8.Fp8Linear)] == made
    from stages.core import memory  # the train planner's test of the same folder agrees: no bf16 read planned
    name = family.denoiser_components[0]
    assert fp8.streams(memory.meta_component(src, name), stored_dtypes(src.weight_files(name)))
    want_state = dict(quantized.named_buffers()) | dict(quantized.named_parameters())
    got_state = dict(streamed.named_buffers()) | dict(streamed.named_parameters())
    assert want_state.keys() == got_state.keys()
    for k, v in want_state.items():  # bit for bit, e4m3 codes and scales included
        assert got_state[k].dtype == v.dtype and torch.equal(got_state[k].view(torch.uint8), v.view(torch.uint8)), k
    assert not streamed.training and not any(p.requires_grad for p in streamed.parameters())
