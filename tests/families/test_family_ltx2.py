"""LTX-2 against its own diffusers pipeline (LTX2Pipeline), on the tiny real architecture.

    .venv/bin/python -m pytest tests/families/test_family_ltx2.py -q

- caption rows equal what the pipeline hands its transformer: Gemma's stacked hidden states of `encode_prompt`
  through the pipeline's text connectors (registers in the padding), at the length asked;
- one training forward sees the pipeline's packed latents, timestep, text rows and video positions and, with the
  audio<->video attention off (video-only training), gives the transformer's prediction; that prediction does not
  depend on the audio inputs, which it does with the attention on;
- the flow target noise - x0 is what the pipeline's velocity turns back into x0; the training sigmas lie on the
  scheduler's exp(mu) curve of the clip's token count; latent normalization is the pipeline's;
- posterior shapes of clips and stills; config checks; ComfyUI's LTX names; frames in the planners.
"""

from __future__ import annotations

import math

import diffusers
import numpy as np
import pytest
import torch

from conftest import FAMILIES, tiny_model
from stages.core import comfyui, flow
from stages.core.config import CaptionsConfig, TrainConfig
from stages.core.errors import ConfigError
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family
from stages.families.base import BatchMeta
from stages.families.ltx2.family import pack, unpack

CAPTIONS = ["a red circle", "  a large blue square and a green triangle moving right across a white background "]
CPU = make_runtime("cpu", "fp32")


@pytest.fixture(scope="module")
def ltx(assets):
    folder = tiny_model(assets, FAMILIES["ltx2"])
    pipe = diffusers.LTX2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return get_family("ltx2"), folder, pipe


def _encode(family, folder, max_len):
    return family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=max_len), CPU)


@pytest.mark.parametrize("max_len", [32, 8])  # 8 cuts the long caption
def test_text_encoding_matches_pipeline(ltx, max_len):
    family, folder, pipe = ltx
    ours = _encode(family, folder, max_len).encode(CAPTIONS)
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                max_sequence_length=max_len, device="cpu")
        video, _, video_mask = pipe.connectors(embeds, mask, padding_side="left")
    assert embeds.shape[-1] == 32 * 3, "every hidden state of the 2-layer Gemma, stacked"
    torch.testing.assert_close(ours["prompt_embeds"], video, rtol=0, atol=0)
    assert torch.equal(ours["prompt_mask"], video_mask.long()) and ours["prompt_mask"].all(), "registers fill the padding"
    assert ours["prompt_embeds"].shape == (2, max_len, 32)


def test_max_sequence_length_must_divide_by_the_registers(ltx):
    family, folder, _ = ltx
    with pytest.raises(ConfigError, match=r"captions.max_sequence_length = 12: .* multiple of 8; set it to 8"):
        _encode(family, folder, 12)


def _meta(b: int) -> BatchMeta:
    z = torch.zeros(b, 2, dtype=torch.long)
    return BatchMeta(z, z, z)


def test_training_forward_is_the_pipelines(ltx):
    """The pipeline's first denoising step, captured at its transformer; the same call with the audio<->video
    attention off against one training loss at that sigma."""
    family, folder, pipe = ltx
    rows = _encode(family, folder, 16).encode(CAPTIONS[:1])
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS[:1], do_classifier_free_guidance=False, max_sequence_length=16,
                                                device="cpu")
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(1, 8, 2, 4, 12, generator=g)  # 9 frames of 96 x 32 px
    seen = {}

    def hook(module, args, kwargs, out):
        seen.setdefault("kwargs", kwargs)

    handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(prompt_embeds=embeds, prompt_attention_mask=mask, guidance_scale=1.0, stg_scale=0.0,
                 modality_scale=1.0, audio_guidance_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0, num_frames=9, height=32, width=96, latents=pack(x_t), num_inference_steps=2,
                 output_type="latent")
    finally:
        handle.remove()
    given = seen["kwargs"]
    assert torch.equal(given["hidden_states"], pack(x_t)) and given["fps"] == 24.0
    torch.testing.assert_close(given["encoder_hidden_states"], rows["prompt_embeds"], rtol=0, atol=0)
    sigma = given["timestep"][:1].float() / 1000
    assert torch.allclose(given["timestep"], pipe.scheduler.sigmas[0] * 1000) and torch.equal(given["sigma"], given["timestep"])
    with torch.no_grad():
        expected = pipe.transformer(**{**given, "isolate_modalities": True, "return_dict": False})[0]
    x0 = torch.randn(x_t.shape, generator=g)
    noise = (x_t - (1 - sigma) * x0) / sigma  # so that flow.noisy_latents(x0, noise, sigma) is the pipeline's
    with flow.captured_prediction() as box, torch.no_grad():
        family.loss(pipe.transformer, x0, noise, sigma, rows, _meta(1), TrainConfig(dynamic_shift=True))
    torch.testing.assert_close(box[0], unpack(expected, 2, 4, 12), rtol=1e-4, atol=1e-5)


def test_video_prediction_ignores_audio_only_when_isolated(ltx):
    _, _, pipe = ltx
    tf, g = pipe.transformer, torch.Generator().manual_seed(2)
    video, text = torch.randn(1, 2 * 4 * 4, 8, generator=g), torch.randn(1, 8, 32, generator=g)
    t = torch.full((1,), 700.0)

    def run(audio, isolate):
        with torch.no_grad():
            return tf(hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=text,
                      audio_encoder_hidden_states=torch.randn(1, 8, 32, generator=g), timestep=t, sigma=t,
                      num_frames=2, height=4, width=4, audio_num_frames=audio.shape[1], isolate_modalities=isolate,
                      use_cross_timestep=True, return_dict=False)[0]

    one, other = torch.zeros(1, 1, 4), torch.randn(1, 5, 4, generator=g)
    torch.testing.assert_close(run(one, True), run(other, True), rtol=0, atol=0)
    assert not torch.allclose(run(one, False), run(other, False)), "the audio reaches the video when not isolated"


def test_flow_target_is_the_pipelines_velocity(ltx):
    _, _, pipe = ltx
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.25, 4), mu=1.0)
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(1, 16, 8, generator=g), torch.randn(1, 16, 8, generator=g)
    sigma = scheduler.sigmas[1].reshape(1)
    x_t = flow.noisy_latents(x0, noise, sigma)
    pipe.scheduler = scheduler
    back = pipe.convert_velocity_to_x0(x_t, flow.flow_target(x0, noise), 1)
    torch.testing.assert_close(back, x0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("latent", [(2, 8, 8), (11, 15, 26)])  # the demo's 128 tokens; 81 frames at 832x480
def test_training_sigmas_follow_the_pipeline_shift(ltx, latent):
    """The pipeline's mu of the packed token count, through the scheduler's exponential shift, is the curve
    train.dynamic_shift samples on (shift_terminal only stretches the sampling schedule's tail)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    family, _, pipe = ltx
    c = pipe.scheduler.config
    mu = calculate_shift(math.prod(latent), c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(c, shift_terminal=None)
    plain = np.linspace(1.0, 1 / 10, 10)
    scheduler.set_timesteps(sigmas=plain, mu=mu)
    torch.testing.assert_close(scheduler.sigmas[:-1].double(), flow.shift_sigmas(torch.tensor(plain), math.exp(mu)),
                               rtol=0, atol=1e-6)
    tcfg = TrainConfig(dynamic_shift=True)
    t = family.sample_timesteps(4096, latent, torch.Generator().manual_seed(0), tcfg)
    table = flow.sigma_table(math.exp(mu))
    assert t.min() > 0 and t.max() <= 1 and set(t.tolist()) <= set(table.tolist()), "drawn from exp(mu)'s table"


def test_latent_normalization_is_the_pipelines(ltx):
    family, folder, pipe = ltx
    vae = pipe.vae
    norm = family.latent_normalization(vae)
    z = torch.randn(2, 8, 3, 2, 2)
    x = family.normalize_latents(z, norm)
    torch.testing.assert_close(x, pipe._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor))
    assert not torch.allclose(x, z), "the tiny VAE's statistics are not 0 / 1"
    torch.testing.assert_close(family.denormalize_latents(x, norm), z, rtol=1e-5, atol=1e-5)
    assert family.pixel_multiple(ModelSource(str(folder))) == 32  # LTX2Pipeline's multiple (the tiny VAE: 8)


def test_posterior_of_clips_and_stills(ltx):
    family, folder, _ = ltx
    vae = family.load_vae(ModelSource(str(folder)), CPU)
    g = torch.Generator().manual_seed(0)
    mean, logvar = family.encode_posterior(vae, torch.rand(1, 3, 9, 32, 48, generator=g) * 2 - 1)
    assert mean.shape == logvar.shape == (1, 8, 2, 4, 6)
    still, _ = family.encode_posterior(vae, torch.rand(2, 3, 32, 48, generator=g) * 2 - 1)
    assert still.shape == (2, 8, 1, 4, 6) and float(logvar.mean()) < -3, "a narrow posterior"


def test_config_checks_frames_fps_and_shift(tmp_path):
    from stages.core.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, {"family": "ltx2", "model": str(tmp_path), "data.frames": 33, "data.fps": 30})
    assert "data.fps = 30" in str(e.value) and "train.dynamic_shift = false" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, {"family": "ltx2", "model": str(tmp_path), "data.frames": 32, "data.fps": 24,
                           "train.dynamic_shift": True})
    assert "data.frames = 32" in str(e.value) and "25 or 33" in str(e.value) and "fps" not in str(e.value)


def test_comfyui_names(ltx):
    family, _, pipe = ltx
    config = dict(pipe.transformer.config)
    write = lambda m: comfyui.write_name(family.comfyui_layout, m, config)  # noqa: E731
    assert write("transformer_blocks.1.attn1.to_q") == "diffusion_model.transformer_blocks.1.attn1.to_q"
    assert write("transformer_blocks.0.ff.net.0.proj") == "diffusion_model.transformer_blocks.0.ff.net.0.proj"
    assert write("proj_in") == "diffusion_model.patchify_proj"
    assert write("audio_proj_in") == "diffusion_model.audio_patchify_proj"
    assert write("time_embed.linear") == "diffusion_model.adaln_single.linear"
    assert write("av_cross_attn_video_a2v_gate.linear") == "diffusion_model.av_ca_a2v_gate_adaln_single.linear"
    # diffusers' own reader of these names takes them back to the modules they came from
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers

    modules = ["proj_in", "audio_proj_in", "time_embed.linear", "audio_time_embed.linear", "transformer_blocks.0.attn2.to_k",
               "av_cross_attn_audio_v2a_gate.linear", "caption_projection.linear_1", "proj_out"]
    read = _convert_non_diffusers_ltx2_lora_to_diffusers({f"{write(m)}.lora_A.weight": 0 for m in modules})
    assert sorted(read) == sorted(f"transformer.{m}.lora_A.weight" for m in modules)


def test_frames_drive_the_latents_and_train_plans(ltx, tmp_path):
    """Frames x resolution in the planners: a 33-frame clip plans more than a still of the same size."""
    from stages.core import memory
    from stages.core.config import load_config
    from stages.core.memory.sizes import latent_frames, sample_tokens

    family, folder, _ = ltx
    assert [latent_frames(family, f) for f in (1, 9, 33, 81, 121)] == [1, 2, 5, 11, 16]
    assert sample_tokens(family, 768, 512, 121) == 24 * 16 * 16  # 32 px a token, 16 latent frames

    def peaks(frames: int) -> tuple[float, float]:
        cfg = load_config(None, {"family": "ltx2", "model": str(folder), "data.frames": frames, "data.resolution": 256,
                                 "train.dynamic_shift": True, "artifacts": str(tmp_path)})
        src, cap = ModelSource(str(folder)), memory.Budget(1000.0, "cap")
        return (memory.plan_latents(cfg, family, src, cap).predicted_peak_gb,
                memory.plan_train(cfg, family, src, cap).predicted_peak_gb)

    (lat1, train1), (lat33, train33) = peaks(1), peaks(33)
    assert lat33 > lat1 and train33 > train1


@pytest.mark.parametrize("checkpointing", [False, True])
def test_block_swap_keeps_the_loss_and_lora_grads(ltx, checkpointing):
    """LTX2VideoTransformerBlock (the blocks the planner swaps; 48 in the release): one of the two swapped, under
    gradient checkpointing or not, the family's loss and its LoRA gradients are bit for bit the unswapped ones."""
    from stages.core import blockswap, fastpath, lora

    family, folder, _ = ltx
    model = diffusers.LTX2VideoTransformer3DModel.from_pretrained(folder, subfolder="transformer")
    model.requires_grad_(False)
    lora.attach_lora(model, lora.lora_config(4, 4.0, 0.0, list(family.default_lora_targets)))
    if checkpointing:
        model.enable_gradient_checkpointing(fastpath.checkpoint_function(0.0, keep_attention=False))
    model.train()
    g = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(2, 8, 2, 4, 4, generator=g), torch.randn(2, 8, 2, 4, 4, generator=g)
    cond = {"prompt_embeds": torch.randn(2, 8, 32, generator=g), "prompt_mask": torch.ones(2, 8, dtype=torch.long)}

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = family.loss(model, x0, noise, torch.tensor([0.3, 0.9]), cond, _meta(2), TrainConfig()).sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    loss_ref, grads_ref = loss_and_grads()
    assert [type(b).__name__ for b in blockswap.repeated_blocks(model)] == ["LTX2VideoTransformerBlock"] * 2
    swap = blockswap.install_block_swap(model, 1, torch.device("cpu"), "last")
    loss, grads = loss_and_grads()
    assert swap is not None and swap.copies >= 1
    assert torch.equal(loss, loss_ref) and grads.keys() == grads_ref.keys() and grads
    assert all(torch.equal(grads[n], grads_ref[n]) for n in grads)


def test_tiled_encode_of_a_clip_is_close_to_untiled(ltx):
    """The latents planner may tile the encode under a small budget (LTX-2's enable_tiling takes a frame count
    third: the plan passes its sizes by name). On the tiny VAE, 9 frames of 96 x 64 px in 64 px tiles (8 latent
    cells, as the release's 512 px tiles are 16): the shapes stay and the posterior mean moves by a bounded amount
    (measured 0.21; 32 px tiles of 4 cells, blended over one, move it by 0.75)."""
    from stages.core.memory.apply import apply_vae_plan

    family, folder, _ = ltx
    vae = family.load_vae(ModelSource(str(folder)), CPU)
    pixels = torch.rand(1, 3, 9, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mean, _ = family.encode_posterior(vae, pixels)
    apply_vae_plan(vae, type("Plan", (), {"settings": {"tiled": True, "sliced": True}})(), tile_px=64)
    assert vae.use_tiling and vae.tile_sample_min_height == 64 and vae.tile_sample_stride_width == 48
    assert vae.tile_sample_min_num_frames == 16, "the frame tiling keeps its default"
    tiled, _ = family.encode_posterior(vae, pixels)
    error = (tiled - mean).abs().mean() / mean.abs().mean()
    print(f"tiled/untiled relative mean error {float(error):.4f}")
    assert tiled.shape == mean.shape == (1, 8, 2, 8, 12) and 0 < float(error) < 0.3, float(error)


def test_the_training_forward_builds_no_coordinates_inside_the_transformer(ltx, monkeypatch):
    """The loss passes the RoPE coordinates, built once per shape outside the transformer: building them copies
    Python numbers to the device, which a CUDA graph's capture refuses (LTX-2's train ran eager for it)."""
    family, folder, pipe = ltx
    rows = _encode(family, folder, 16).encode(CAPTIONS[:1])
    family = type(family)()  # none built yet
    built = []
    prepare = pipe.transformer.rope.prepare_video_coords
    monkeypatch.setattr(pipe.transformer.rope, "prepare_video_coords", lambda *a, **k: built.append(a) or prepare(*a, **k))
    seen = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, k, out: seen.append(k), with_kwargs=True)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(1, 8, 2, 4, 12, generator=g), torch.randn(1, 8, 2, 4, 12, generator=g)
    try:
        with torch.no_grad():
            for _ in range(2):
                family.loss(pipe.transformer, x0, noise, torch.tensor([0.5]), rows, _meta(1), TrainConfig())
    finally:
        handle.remove()
    assert len(built) == 1, "built once, outside the forward, and reused"
    assert all(k["video_coords"] is not None and k["audio_coords"] is not None for k in seen) and len(seen) == 2
