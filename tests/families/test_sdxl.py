"""SDXL family: DDPM/min-SNR math, the UNet's conditioning, caption parity, export into the pipeline.

    .venv/bin/python -m pytest tests/families/test_sdxl.py -q

Expected values are written out from the formulas (SDXL's scaled-linear betas, min-SNR-gamma, the
pipeline's `_get_add_time_ids` layout), not taken from the code under test.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import demo_config_path, tiny_model
from stages import export_lora, train
from stages.core import aspect_buckets, dataset, image_io, lora
from stages.core.config import ConfigError, load_config
from stages.core.model_source import ModelError, ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family
from stages.families.sdxl import family as sdxl
from stages.families.base import BatchMeta
from stages.core.caches import export_dir

GAMMA = 5.0


@pytest.fixture(scope="module")
def model(assets):
    return tiny_model(assets, "sdxl")


# conftest's built_run (the four stages in-process on the demo config), for SDXL only
sdxl_run = pytest.mark.parametrize("built_run", ["sdxl"], indirect=True)


def _alphas_cumprod() -> torch.Tensor:
    """SDXL's training schedule: scaled_linear betas 0.00085 .. 0.012 over 1000 steps, in float64."""
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, dim=0)


def _unet(family, model, **train_overrides):
    tcfg = load_config(None, {"model": str(model), **{f"train.{k}": v for k, v in train_overrides.items()}}).train
    unet = family.load_denoiser(ModelSource(str(model)), "fp32", make_runtime("cpu", "fp32"), tcfg)
    return unet, tcfg


# ---- the DDPM math ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction"])
def test_min_snr_weights_match_the_formula(model, kind):
    from diffusers.training_utils import compute_snr

    family = get_family("sdxl")
    sched = family.load_noise_schedule(ModelSource(str(model)))
    t = torch.tensor([0, 10, 100, 250, 500, 750, 999])
    ab = _alphas_cumprod()[t]
    snr = ab / (1 - ab)
    expected = torch.minimum(snr, torch.full_like(snr, GAMMA)) / (snr if kind == "epsilon" else snr + 1)
    got_snr = sdxl.snr(sched.alphas_cumprod, t)
    torch.testing.assert_close(got_snr.double(), snr, rtol=1e-4, atol=0)
    torch.testing.assert_close(got_snr, compute_snr(sched, t), rtol=1e-5, atol=0)
    got = sdxl.min_snr_weights(got_snr, GAMMA, kind)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-7)
    # both sides of the min are exercised: low t is clipped (snr >> gamma), high t is not
    assert snr[0] > GAMMA > snr[-1]
    if kind == "epsilon":
        assert got[-1] == pytest.approx(1.0) and got[0] < 0.01
    assert torch.equal(sdxl.min_snr_weights(got_snr, 0.0, kind), torch.ones_like(got_snr))


def test_min_snr_epsilon_at_zero_terminal_snr_is_finite():
    w = sdxl.min_snr_weights(torch.tensor([0.0, 0.5, 50.0]), GAMMA, "epsilon")
    torch.testing.assert_close(w, torch.tensor([1.0, 1.0, 0.1]))


@pytest.mark.parametrize("kind,offset", [("epsilon", 0.0), ("v_prediction", 0.0), ("epsilon", 0.1)])
def test_loss_is_the_min_snr_weighted_ddpm_objective(model, kind, offset):
    family = get_family("sdxl")
    unet, tcfg = _unet(family, model, prediction_type=kind, snr_gamma=GAMMA, noise_offset=offset)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 4, 8, 12, generator=g), torch.randn(2, 4, 8, 12, generator=g)
    t = torch.tensor([30, 700])
    cond = {"prompt_embeds": torch.randn(2, 77, 96, generator=g), "pooled": torch.randn(2, 64, generator=g)}
    # original (h, w), crop (top, left), target (h, w) of two samples, as the latent cache stores them
    meta = BatchMeta(torch.tensor([[90, 130], [60, 60]]), torch.tensor([[3, 5], [0, 0]]),
                     torch.tensor([[16, 24], [16, 24]]))

    torch.manual_seed(1)  # noise offset draws from torch's global RNG (saved in checkpoints)
    with torch.no_grad():
        got = family.loss(unet, x0, noise, t, cond, meta, tcfg)

    torch.manual_seed(1)
    if offset:
        noise = noise + offset * torch.randn(2, 4, 1, 1)
    ab = _alphas_cumprod()[t].float().view(-1, 1, 1, 1)
    x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
    target = noise if kind == "epsilon" else ab.sqrt() * noise - (1 - ab).sqrt() * x0
    time_ids = torch.tensor([[90, 130, 3, 5, 16, 24], [60, 60, 0, 0, 16, 24]], dtype=torch.float32)
    with torch.no_grad():
        pred = unet(x_t, t, encoder_hidden_states=cond["prompt_embeds"],
                    added_cond_kwargs={"text_embeds": cond["pooled"], "time_ids": time_ids}).sample
    snr = (ab / (1 - ab)).flatten()
    weight = snr.clamp(max=GAMMA) / (snr if kind == "epsilon" else snr + 1)
    expected = ((pred - target) ** 2).mean(dim=(1, 2, 3)) * weight
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_sample_timesteps_are_uniform_integers_over_the_schedule(model):
    family = get_family("sdxl")
    family.load_noise_schedule(ModelSource(str(model)))
    t = family.sample_timesteps(20000, (8, 8), torch.Generator().manual_seed(0), None)
    assert t.dtype == torch.int64 and int(t.min()) == 0 and int(t.max()) == 999
    assert abs(float(t.float().mean()) - 499.5) < 10


def test_prediction_type_auto_reads_the_scheduler_config(model, tmp_path):
    folder = tmp_path / "vpred"
    shutil.copytree(model / "scheduler", folder / "scheduler")
    path = folder / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "prediction_type": "v_prediction"}))
    family = get_family("sdxl")
    family.load_noise_schedule(ModelSource(str(folder)))
    tcfg = load_config(None, {"model": "x"}).train
    assert family.prediction_type(tcfg) == "v_prediction"
    tcfg.prediction_type = "epsilon"
    assert family.prediction_type(tcfg) == "epsilon"  # an explicit setting wins

    path.write_text(json.dumps({**json.loads(path.read_text()), "prediction_type": "sample"}))
    family.load_noise_schedule(ModelSource(str(folder)))
    tcfg.prediction_type = "auto"
    with pytest.raises(ModelError, match="train.prediction_type"):
        family.prediction_type(tcfg)


# ---- latents and buckets ------------------------------------------------------------------------


def test_latent_normalization_with_and_without_latents_mean_std():
    from diffusers import AutoencoderKL

    family = get_family("sdxl")
    z = torch.randn(2, 4, 3, 5)
    mean, std = [0.5, -0.2, 0.1, 0.0], [2.0, 1.5, 0.8, 1.0]
    kw = dict(block_out_channels=(32,), latent_channels=4, norm_num_groups=32, scaling_factor=0.5)
    plain = family.latent_normalization(AutoencoderKL(**kw))
    assert plain == {"scaling_factor": 0.5, "latents_mean": None, "latents_std": None}
    torch.testing.assert_close(family.normalize_latents(z, plain), z * 0.5)

    stats = family.latent_normalization(AutoencoderKL(**kw, latents_mean=mean, latents_std=std))
    json.dumps(stats)  # stored in the latents manifest
    m, s = torch.tensor(mean).view(1, 4, 1, 1), torch.tensor(std).view(1, 4, 1, 1)
    x = family.normalize_latents(z, stats)
    torch.testing.assert_close(x, (z - m) * 0.5 / s)
    torch.testing.assert_close(family.denormalize_latents(x, stats), z)


def test_pixel_multiple_lets_every_unet_level_divide(model, tmp_path):
    family = get_family("sdxl")
    assert family.pixel_multiple(ModelSource(str(model))) == 4  # VAE 2 x UNet 2 (one downsampler)
    real = tmp_path / "sdxl-shaped"  # SDXL base 1.0: 4 VAE blocks (x8), 3 UNet levels (x4)
    for comp, blocks in (("vae", [128, 256, 512, 512]), ("unet", [320, 640, 1280])):
        (real / comp).mkdir(parents=True)
        (real / comp / "config.json").write_text(json.dumps({"block_out_channels": blocks}))
    assert family.pixel_multiple(ModelSource(str(real))) == 32

    unet, tcfg = _unet(family, model)
    buckets = aspect_buckets.make_buckets(64, family.pixel_multiple(ModelSource(str(model))), 3.0)
    for bw, bh in buckets[::3] + buckets[-1:]:  # the square, both extremes and between (18 in all)
        h, w = bh // 2, bw // 2  # the tiny VAE halves
        with torch.no_grad():
            out = unet(torch.zeros(1, 4, h, w), torch.tensor([10]), encoder_hidden_states=torch.zeros(1, 77, 96),
                       added_cond_kwargs={"text_embeds": torch.zeros(1, 64), "time_ids": torch.zeros(1, 6)}).sample
        assert out.shape == (1, 4, h, w), (bw, bh)


# ---- captions -----------------------------------------------------------------------------------


def test_captions_match_the_pipelines_encode_prompt(model):
    from diffusers import StableDiffusionXLPipeline

    family = get_family("sdxl")
    ccfg = load_config(demo_config_path("sdxl"), {"model": str(model)}).captions
    encoder = family.load_text_encoder(ModelSource(str(model)), ccfg, make_runtime("cpu", "fp32"))
    texts = ["a small red circle at the left on a white background", "a large blue square " * 30]
    got = encoder.encode(texts)
    pipe = StableDiffusionXLPipeline.from_pretrained(str(model))
    embeds, _, pooled, _ = pipe.encode_prompt(texts, device="cpu", do_classifier_free_guidance=False)
    assert got["prompt_embeds"].shape == (2, 77, 32 + 64) and got["pooled"].shape == (2, 64)
    torch.testing.assert_close(got["prompt_embeds"], embeds)
    torch.testing.assert_close(got["pooled"], pooled)
    counts = encoder.token_counts(texts)
    assert counts[0] < 77 < counts[1]  # the long one is reported as truncated

    ccfg.max_sequence_length = 512
    with pytest.raises(ConfigError, match="captions.max_sequence_length = 77"):
        family.load_text_encoder(ModelSource(str(model)), ccfg, make_runtime("cpu", "fp32"))


# ---- the cached geometry reaches the UNet -------------------------------------------------------


@sdxl_run
def test_add_time_ids_follow_each_variants_crop(built_run):
    from stages.train.trainer import build_data

    cfg, family = built_run, get_family("sdxl")
    data, manifest = build_data(cfg)
    unet, _ = _unet(family, cfg.model)
    seen = []
    unet.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["added_cond_kwargs"]["time_ids"].clone()), with_kwargs=True)
    items = {it.key: it for it in dataset.scan(cfg.data.path)}
    n_var, crops = cfg.data.cache_variants, {}
    for bucket, members in data.buckets().items():
        bw, bh = (int(x) for x in bucket.split("x"))
        # every variant of every item of the bucket in one batch: one UNet forward per bucket
        variants = [v for v in range(n_var) for _ in members]
        batch = data.load(members * n_var, variants)
        x0 = family.normalize_latents(batch.mean, manifest["normalization"])
        with torch.no_grad():
            t = torch.full((len(variants),), 500)
            family.loss(unet, x0, torch.randn_like(x0), t, batch.cond, batch.meta, cfg.train)
        for row, key, v in zip(seen.pop().tolist(), batch.keys, variants):
            it = items[key]
            w, h = image_io.image_size(it.image_path)
            plan = aspect_buckets.plan_variants(it.image_id, (w, h), (bw, bh), n_var, cfg.seed, cfg.data.random_flip,
                                         cfg.data.crop, cfg.data.crop_zoom)[v]
            # a flipped variant's crop starts where the mirrored box does in the mirrored image
            left = plan.resized[0] - plan.crop_left - bw if plan.flip else plan.crop_left
            assert row == [h, w, plan.crop_top, left, bh, bw], (key, v)
            crops.setdefault(key, set()).add((plan.crop_top, plan.crop_left))
    assert any(len(c) > 1 for c in crops.values()), "no variants with different crops: the test proves nothing"


# ---- export -------------------------------------------------------------------------------------


@sdxl_run
def test_export_loads_into_stable_diffusion_xl_pipeline(built_run):
    run = built_run
    from diffusers import StableDiffusionXLPipeline
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open

    export = export_dir(run) / export_lora.DIFFUSERS_FILE
    adapter, adapter_cfg = lora.load_adapter_files(train.artifact_dir(run))
    with safe_open(str(export), "pt") as f:
        keys = set(f.keys())
        metadata = f.metadata() or {}
    assert keys and all(k.startswith("unet.") for k in keys), sorted(keys)[:3]
    assert {k.removeprefix("unet.") for k in keys} == set(adapter)
    stored = json.loads(metadata["lora_adapter_metadata"])  # the adapter config, under the UNet's prefix
    # the trained scale (alpha / r != 1) is folded into lora_B: the file's alpha is the rank
    assert stored["unet.r"] == adapter_cfg["r"] == stored["unet.lora_alpha"] != adapter_cfg["lora_alpha"]

    pipe = StableDiffusionXLPipeline.from_pretrained(str(run.model))
    pipe.load_lora_weights(str(export.parent), weight_name=export.name)
    state = get_peft_model_state_dict(pipe.unet, adapter_name="default_0")
    loaded = {k.replace(".default_0", ""): v for k, v in state.items()}
    assert set(loaded) == set(adapter), "missing or unexpected keys after load_lora_weights"
    folded, _ = export_lora.scale_folded(adapter, adapter_cfg)
    for k, v in folded.items():
        torch.testing.assert_close(loaded[k], v)
    scalings = {m.scaling["default_0"] for m in pipe.unet.modules() if "default_0" in getattr(m, "scaling", {})}
    assert scalings == {1.0}  # with lora_B carrying alpha / r, every reader applies the trained delta
    for enc in (pipe.text_encoder, pipe.text_encoder_2):
        assert not any("lora" in n for n, _ in enc.named_parameters())
