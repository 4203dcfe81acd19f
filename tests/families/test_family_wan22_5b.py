"""Wan 2.2 TI2V-5B against its own diffusers pipeline (WanPipeline), on the tiny real architecture.

    .venv/bin/python -m pytest tests/families/test_family_wan22_5b.py -q

- caption rows equal `encode_prompt`'s embeds: umT5 states, zero past each caption's tokens, at the length asked;
- one training forward sees exactly what the pipeline hands its transformer at the same noisy latents
  (timestep = sigma x 1000 per latent token, the full-length text rows) and gives the same prediction;
- the flow target noise - x0 is what UniPC's flow_prediction turns back into x0; the training sigmas lie on
  the scheduler's flow_shift curve; latent normalization is the decode's inverse;
- the VAE posterior of a clip, untiled and tiled (what the latents planner may choose), stays within a
  measured bound; ComfyUI's Wan names for the trained modules.
"""

from __future__ import annotations

import diffusers
import pytest
import torch

from conftest import FAMILIES, tiny_model
from stages.core import comfyui, flow
from stages.core.config import CaptionsConfig, TrainConfig
from stages.core.memory.apply import apply_vae_plan
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family
from stages.families.base import BatchMeta

CAPTIONS = ["a red circle", "a  large blue square &amp; a green triangle moving right across a white background"]
CPU = make_runtime("cpu", "fp32")


@pytest.fixture(scope="module")
def wan(assets):
    folder = tiny_model(assets, FAMILIES["wan2.2-5b"])
    pipe = diffusers.WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return get_family("wan2.2-5b"), folder, pipe


def _encode(family, folder, max_len):
    return family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=max_len), CPU)


@pytest.mark.parametrize("max_len", [64, 8])  # 8 cuts the long caption
def test_text_encoding_matches_pipeline(wan, max_len):
    family, folder, pipe = wan
    ours = _encode(family, folder, max_len).encode(CAPTIONS)["prompt_embeds"]
    with torch.no_grad():
        theirs, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, max_sequence_length=max_len,
                                       device="cpu")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    tokens = pipe.tokenizer(CAPTIONS[:1], padding="max_length", max_length=max_len).attention_mask[0]
    assert not ours[0, sum(tokens):].any() and ours[0, :sum(tokens)].abs().sum(-1).gt(0).all(), "zero past the caption"


def test_training_forward_is_the_pipelines(wan):
    """The pipeline's first denoising step, captured at its transformer, against one training loss at that sigma."""
    family, folder, pipe = wan
    embeds = _encode(family, folder, 16).encode(CAPTIONS[:1])["prompt_embeds"]
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 48, 3, 4, 6, generator=g)  # 9 frames of 48 x 32 px
    seen = {}

    def hook(module, args, kwargs, out):
        seen.setdefault("kwargs", kwargs)
        seen.setdefault("out", out[0])

    handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(prompt_embeds=embeds, guidance_scale=1.0, num_frames=9, height=32, width=48, latents=latents.clone(),
                 num_inference_steps=2, output_type="latent")
    finally:
        handle.remove()
    given = seen["kwargs"]["timestep"]
    sigma = pipe.scheduler.sigmas[0].reshape(1).float()
    assert given.shape == family.timestep(sigma, latents, (1, 2, 2)).shape == (1, 3 * 2 * 3)
    assert torch.equal(family.timestep(sigma, latents, (1, 2, 2)).long(), given), "UniPC's t: sigma x 1000, cast"
    sigma = given[0, :1].float() / 1000  # train at the sigma of the t the transformer saw
    x0 = torch.randn(latents.shape, generator=g)
    noise = (latents - (1 - sigma) * x0) / sigma  # so that flow.noisy_latents(x0, noise, sigma) is the pipeline's
    with flow.captured_prediction() as box, torch.no_grad():
        family.loss(pipe.transformer, x0, noise, sigma, {"prompt_embeds": embeds}, _meta(1), TrainConfig())
    torch.testing.assert_close(box[0], seen["out"], rtol=1e-4, atol=1e-4)


def test_flow_target_is_unipc_flow_prediction(wan):
    _, _, pipe = wan
    scheduler = diffusers.UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(4)
    scheduler._step_index = 1
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(1, 48, 2, 4, 4, generator=g), torch.randn(1, 48, 2, 4, 4, generator=g)
    sigma = scheduler.sigmas[1]
    x_t = flow.noisy_latents(x0, noise, sigma.reshape(1))
    back = scheduler.convert_model_output(flow.flow_target(x0, noise), sample=x_t)
    torch.testing.assert_close(back, x0, rtol=1e-5, atol=1e-5)


def test_training_sigmas_follow_the_scheduler_shift(wan):
    """UniPC's flow sigmas are the unshifted ones through flow_shift, the curve train.shift samples on."""
    family, _, pipe = wan
    shift = pipe.scheduler.config.flow_shift
    assert shift == 5.0
    shifted, plain = (diffusers.UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=s) for s in (shift, 1.0))
    for s in (shifted, plain):
        s.set_timesteps(10)
    # (UniPC nudges a first sigma of 1 down by 1e-6, for its logs)
    torch.testing.assert_close(shifted.sigmas[:-1].double(), flow.shift_sigmas(plain.sigmas[:-1].double(), shift),
                               rtol=0, atol=2e-6)
    t = family.sample_timesteps(4096, (4, 4), torch.Generator().manual_seed(0), TrainConfig(shift=shift))
    assert t.min() > 0 and t.max() <= 1 and float(t.median()) > 0.75, "shift 5 puts most draws at high noise"


def test_latent_normalization_inverts_the_decode(wan):
    family, _, pipe = wan
    norm = family.latent_normalization(pipe.vae)
    z = torch.randn(2, 48, 3, 2, 2)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 48, 1, 1, 1)
    std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 48, 1, 1, 1)
    x = family.normalize_latents(z, norm)
    torch.testing.assert_close(x / std + mean, z, rtol=1e-5, atol=1e-5)  # the pipeline's decode line
    torch.testing.assert_close(family.denormalize_latents(x, norm), z, rtol=1e-5, atol=1e-5)
    assert family.pixel_multiple(ModelSource(str(wan[1]))) == 16


def test_tiled_encode_of_a_clip_is_close_to_untiled(wan):
    """The planner may tile the encode under a small budget: measured on the tiny VAE, 9 frames of 96 x 64 px
    in 32 px tiles: the posterior mean moves by a bounded amount, and the shapes do not change."""
    family, folder, _ = wan
    vae = family.load_vae(ModelSource(str(folder)), CPU)
    pixels = torch.rand(1, 3, 9, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mean, logvar = family.encode_posterior(vae, pixels)
    assert mean.shape == logvar.shape == (1, 48, 3, 8, 12)
    apply_vae_plan(vae, type("Plan", (), {"settings": {"tiled": True, "sliced": True}})(), tile_px=32)
    assert vae.use_tiling and vae.tile_sample_min_height == 32
    tiled, _ = family.encode_posterior(vae, pixels)
    error = (tiled - mean).abs().mean() / mean.abs().mean()
    print(f"tiled/untiled relative mean error {float(error):.4f}")
    assert tiled.shape == mean.shape and 0 < float(error) < 0.25, float(error)  # measured 0.147


def test_config_checks_frames_and_shift(tmp_path):
    from stages.core.config import load_config
    from stages.core.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, {"family": "wan2.2-5b", "model": str(tmp_path), "data.frames": 32,
                           "train.dynamic_shift": True})
    assert "data.frames = 32" in str(e.value) and "33" in str(e.value) and "train.dynamic_shift" in str(e.value)
    with pytest.raises(ConfigError, match=r"sample.frames = 6: .*set it to 5 or 9, or 0 for data.frames"):
        load_config(None, {"family": "wan2.2-5b", "model": str(tmp_path), "sample.frames": 6})
    assert load_config(None, {"family": "wan2.2-5b", "model": str(tmp_path), "sample.frames": 9}).sample.frames == 9


def test_comfyui_names(wan):
    family, _, pipe = wan
    config = dict(pipe.transformer.config)
    write = lambda m: comfyui.write_name(family.comfyui_layout, m, config)  # noqa: E731
    assert write("blocks.1.attn1.to_q") == "diffusion_model.blocks.1.self_attn.q"
    assert write("blocks.0.attn2.to_out.0") == "diffusion_model.blocks.0.cross_attn.o"
    assert write("blocks.0.ffn.net.0.proj") == "diffusion_model.blocks.0.ffn.0"
    assert write("condition_embedder.time_proj") == "diffusion_model.time_projection.1"


def _meta(b: int) -> BatchMeta:
    z = torch.zeros(b, 2, dtype=torch.long)
    return BatchMeta(z, z, z)


def test_frames_drive_the_latents_and_train_plans(wan, tmp_path):
    """Frames x resolution in the planners: a 33-frame clip plans more VAE work than a still of the same size, and
    the train step counts every latent frame's tokens (9 frames: 3 latent frames)."""
    from stages.core import memory
    from stages.core.config import load_config
    from stages.core.memory.sizes import latent_frames, sample_tokens

    family, folder, _ = wan
    assert [latent_frames(family, f) for f in (1, 5, 9, 33, 81)] == [1, 2, 3, 9, 21]
    assert sample_tokens(family, 832, 480, 81) == 26 * 15 * 21  # Wan 2.2 5B: 32 px a token, 21 latent frames

    def peaks(frames: int) -> tuple[float, float]:
        cfg = load_config(None, {"family": "wan2.2-5b", "model": str(folder), "data.frames": frames,
                                 "data.resolution": 256, "artifacts": str(tmp_path)})
        src, cap = ModelSource(str(folder)), memory.Budget(1000.0, "cap")
        return (memory.plan_latents(cfg, family, src, cap).predicted_peak_gb,
                memory.plan_train(cfg, family, src, cap).predicted_peak_gb)

    (lat1, train1), (lat33, train33) = peaks(1), peaks(33)
    assert lat33 > lat1 and train33 > train1
