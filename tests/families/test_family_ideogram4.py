"""Ideogram 4 against its own diffusers pipeline (Ideogram4Pipeline), on the tiny real architecture.

    .venv/bin/python -m pytest tests/families/test_family_ideogram4.py -q

- caption rows equal `encode_prompt`'s text features (chat turn, tapped layers, left padding) stored from
  row 0 with their lengths; a cut caption keeps its first tokens' features;
- one training loss equals what the pipeline's own denoising step implies (model time 1 - sigma, the
  prediction's sign, (row, col, c) packing, ids, segments) for two captions of different lengths cut to the
  batch's longest against the pipeline's 64-token padding, and for each caption alone (no mask);
- the training forward (text rows only) trains as the stock forward, with and without checkpointing; a padded
  batch trains like its items one by one;
- the timesteps are the pipeline's logit-normal, resolution-shifted sigmas; latent normalization and packing
  are the pipeline's; ComfyUI's names (fused qkv) give the trained delta, and diffusers reads that file too.
"""

from __future__ import annotations

import dataclasses
import json

import diffusers
import pytest
import torch

import test_families_text as shared
from conftest import FAMILIES, tiny_model
from stages.core import comfyui, flow
from stages.core.config import CaptionsConfig, TrainConfig
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family
from stages.families.ideogram4.family import pack, unpack
from test_families_text import CAPTIONS, _meta

CPU = make_runtime("cpu", "fp32")
CHANNELS = 32  # AutoencoderKLFlux2's latent channels


@pytest.fixture(scope="module")
def ideogram(assets):
    folder = tiny_model(assets, FAMILIES["ideogram4"])
    pipe = diffusers.Ideogram4Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return get_family("ideogram4"), folder, pipe


@pytest.fixture(scope="module")
def rows(ideogram):
    family, folder, _ = ideogram
    return _encode(family, folder, 64)


def _encode(family, folder, max_len: int) -> dict[str, torch.Tensor]:
    encoder = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=max_len), CPU)
    return encoder.encode(CAPTIONS)


def test_text_encoding_matches_pipeline(ideogram, rows):
    family, folder, pipe = ideogram
    with torch.no_grad():
        embeds, _, _, indicator = pipe.encode_prompt(CAPTIONS, grid_h=2, grid_w=2, max_sequence_length=64, device="cpu")
    lengths = (indicator == 3).sum(dim=1)
    assert rows["prompt_length"].tolist() == lengths.tolist() and lengths[0] < lengths[1] < 64
    for i, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(rows["prompt_embeds"][i, :n], embeds[i, 64 - n:64], rtol=1e-5, atol=1e-5)
        assert not rows["prompt_embeds"][i, n:].any() and not embeds[i, :64 - n].any()
    cut = _encode(family, folder, 12)  # causal: a cut caption's first 12 tokens have the full caption's features
    assert cut["prompt_length"].tolist() == [min(12, n) for n in lengths.tolist()]
    torch.testing.assert_close(cut["prompt_embeds"][1], rows["prompt_embeds"][1, :12], rtol=1e-5, atol=1e-5)
    encoder = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=12), CPU)
    assert encoder.token_counts(CAPTIONS) == lengths.tolist()


def _pipeline_velocity(pipe, latents: torch.Tensor, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x at the pipeline's second step, where its sigma is `sigma`; the velocity it steps with there).
    Two steps: the second sigma of `_logit_normal_sigmas(2, mu)` is sigmoid(mu) at the resolution's mu, and
    the step to 0 is x - sigma * (-v); guidance 1 makes v the conditional transformer's alone."""
    b, c, h, w = latents.shape
    height, width = h * pipe.vae_scale_factor, w * pipe.vae_scale_factor
    mu = torch.logit(torch.tensor(sigma)).item() - 0.5 * torch.log(torch.tensor(height * width / 512**2)).item()
    seen = []
    pipe(prompt=list(CAPTIONS), height=height, width=width, num_inference_steps=2, guidance_scale=1.0,
         guidance_schedule=None, mu=mu, latents=pack(latents), max_sequence_length=64, output_type="latent",
         callback_on_step_end=lambda p, i, t, kw: seen.append(kw["latents"].clone()) or {})
    assert float(pipe.scheduler.sigmas[1]) == pytest.approx(sigma, rel=1e-5)
    x, x_next = unpack(seen[0], h, w), unpack(seen[1], h, w)
    return x, (x_next - x) / sigma


def test_training_loss_matches_pipeline_step(ideogram, rows):
    """Our loss at (x0, noise, sigma), captions cut to the batch's longest, equals the MSE between noise - x0
    and minus the velocity of the pipeline's step (its captions padded to 64); batched and one by one."""
    family, folder, pipe = ideogram
    g = torch.Generator().manual_seed(0)
    sigma = 0.6
    with torch.no_grad():
        x, velocity = _pipeline_velocity(pipe, torch.randn(2, CHANNELS, 8, 6, generator=g), sigma)
        noise = torch.randn(x.shape, generator=g)
        x0 = (x - sigma * noise) / (1 - sigma)  # so that (1 - sigma) x0 + sigma noise = x
        model = family.load_denoiser(ModelSource(str(folder)), "fp32", CPU, TrainConfig())
        t = torch.full((2,), sigma)
        ours = family.loss(model, x0, noise, t, rows, _meta(2, 8, 6), TrainConfig())
        single = torch.cat([family.loss(model, x0[i:i + 1], noise[i:i + 1], t[:1], {k: v[i:i + 1] for k, v in rows.items()},
                                        _meta(1, 8, 6), TrainConfig()) for i in range(2)])
        stock = family.loss(pipe.transformer, x0, noise, t, rows, _meta(2, 8, 6), TrainConfig())
    expected = ((-velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    for got in (ours, single, stock):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    wrong_sign = ((velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    assert (wrong_sign - expected).abs().min() > 1e-3, "the check must tell the output's sign apart"


def test_training_forward_trains_as_the_stock_forward(ideogram, rows):
    """Loss and LoRA gradients of the text-rows-only forward equal the stock forward's (a pipeline's
    transformer, the same weights), also under gradient checkpointing; a padded batch trains like its items."""
    family, folder, pipe = ideogram
    model, params = shared._lora_model(family, folder)
    g = torch.Generator().manual_seed(2)
    x0, noise = torch.randn(2, CHANNELS, 8, 8, generator=g), torch.randn(2, CHANNELS, 8, 8, generator=g)
    t = torch.tensor([0.3, 0.8])

    def loss_and_grads(items=(0, 1), multiple=1):
        model.zero_grad(set_to_none=True)
        i = list(items)
        meta = dataclasses.replace(_meta(len(i), 8, 8), text_multiple=multiple)
        loss = family.loss(model, x0[i], noise[i], t[i], {k: v[i] for k, v in rows.items()}, meta, TrainConfig())
        loss.mean().backward()
        return loss.detach(), [p.grad.clone() for p in params]

    plain_loss, plain_grads = loss_and_grads()
    model.enable_gradient_checkpointing()
    ckpt_loss, ckpt_grads = loss_and_grads()
    single = [loss_and_grads([i]) for i in range(2)]
    rounded = [loss_and_grads([i], multiple=rows["prompt_embeds"].shape[1]) for i in range(2)]  # masked padding
    model.disable_gradient_checkpointing()
    model.__class__ = diffusers.Ideogram4Transformer2DModel  # the same modules and weights, the stock forward
    stock_loss, stock_grads = loss_and_grads()
    for loss, grads in ((ckpt_loss, ckpt_grads), (stock_loss, stock_grads)):
        torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-7)
        for a, b in zip(grads, plain_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(torch.cat([s[0] for s in single]), plain_loss, rtol=1e-5, atol=1e-7)
    for (loss, grads), (rounded_loss, rounded_grads) in zip(single, rounded):
        torch.testing.assert_close(rounded_loss, loss, rtol=1e-5, atol=1e-7)
        for a, b in zip(rounded_grads, grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    summed = [(a + b) / 2 for a, b in zip(single[0][1], single[1][1])]  # the batch's mean loss
    for a, b in zip(summed, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_timesteps_are_the_pipelines_logit_normal_schedule(ideogram):
    """At the same quantiles, our sigmas (logit-normal std 1.5, train.dynamic_shift) are the pipeline's
    `_logit_normal_sigmas` at its resolution-aware mu; the static shift is the scheduler's."""
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas, _resolution_aware_mu

    family, _, _ = ideogram
    latent_hw, n = (128, 96), 40  # 1024 x 768 px with the real VAE's 8x
    tcfg = TrainConfig(timestep_density="logit_normal", logit_std=1.5, dynamic_shift=True)
    mu = _resolution_aware_mu(latent_hw[0] * 8, latent_hw[1] * 8, base_mu=0.0)
    theirs = _logit_normal_sigmas(n, mu, std=1.5)  # quantile i / n, highest sigma first
    v = torch.arange(n, dtype=torch.float64) / n  # our uniform variate of that quantile (u -> timestep 1 - u)
    ours = family.sigmas(flow.from_uniform(v, "logit_normal", 0.0, 1.5), latent_hw, tcfg)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    drawn = family.sample_timesteps(4096, latent_hw, torch.Generator().manual_seed(0), tcfg)
    logits = torch.logit(drawn.double())
    assert abs(logits.mean() - mu) < 0.1 and abs(logits.std() - 1.5) < 0.1
    static = family.sigmas(torch.tensor([0.25, 0.5]), latent_hw, TrainConfig(shift=3.0))
    torch.testing.assert_close(static, flow.shift_sigmas(torch.tensor([0.75, 0.5]), 3.0))


def test_latent_normalization_and_packing_as_pipeline(ideogram):
    """The pipeline's decode (batch-norm statistics on the packed (row, col, c) channels, then its unpatchify)
    undoes our normalize + pack; ComfyUI's `_img_to_tokens` order is the same."""
    family, _, pipe = ideogram
    norm = family.latent_normalization(pipe.vae)
    z = torch.randn(2, CHANNELS, 6, 4, generator=torch.Generator().manual_seed(3))
    tokens = pack(family.normalize_latents(z, norm))
    bn_mean = pipe.vae.bn.running_mean.view(1, 1, -1)
    bn_std = torch.sqrt(pipe.vae.bn.running_var + pipe.vae.config.batch_norm_eps).view(1, 1, -1)
    decoded = (tokens * bn_std + bn_mean).view(2, 3, 2, 2, 2, CHANNELS).permute(0, 5, 1, 3, 2, 4).reshape(z.shape)
    torch.testing.assert_close(decoded, z, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(family.denormalize_latents(unpack(tokens, 6, 4), norm), z, rtol=1e-5, atol=1e-5)
    assert (family.normalize_latents(z, norm) - z).abs().max() > 0.1, "the statistics must be away from 0 and 1"
    comfy_order = z.view(2, CHANNELS, 3, 2, 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(2, 6, 4 * CHANNELS)
    assert torch.equal(pack(z), comfy_order)


def test_comfyui_fused_qkv_file_loads_in_comfyui_and_diffusers(ideogram):
    """q, k and v are one `attention.qkv` weight in ComfyUI, reached by its own names only: the file writes
    them as one LoRA (block-diagonal up), which gives each its trained delta; diffusers' Ideogram 4 reader
    (ai-toolkit's layout) splits the same file back into exactly those deltas."""
    from test_comfyui_export import shapes_of, trained

    from stages.core.comfyui_file import TrainedDeltas, comfyui_state

    family, folder, pipe = ideogram
    state, lora_cfg, base, merged, config = trained("ideogram4", "lora", folder)
    kmap = comfyui.key_map(family.comfyui_layout, shapes_of(folder, "ideogram4"), config)
    qkv = kmap["diffusion_model.layers.0.attention.qkv"]
    assert qkv.modules == tuple(f"layers.0.attention.to_{p}" for p in "qkv")
    assert kmap["lora_unet_layers_1_attention_o"].modules == ("layers.1.attention.to_out.0",)
    assert not any(k.startswith("transformer.") for k in kmap), "ComfyUI has no diffusers names for Ideogram 4"
    tensors = comfyui_state(TrainedDeltas(state, lora_cfg), family.comfyui_layout, config)
    ranks = sum(state[f"layers.0.attention.to_{p}.lora_A.weight"].shape[0] for p in "qkv")
    assert tensors["diffusion_model.layers.0.attention.qkv.lora_down.weight"].shape[0] == ranks
    report = comfyui.check("file", tensors, kmap, merged)
    assert report.problems() == [] and sorted(report.strength) == sorted(merged)
    lone = {k: v for k, v in state.items() if k.startswith("layers.0.attention.to_q.")}
    with pytest.raises(comfyui.ComfyError, match=r"'layers.0.attention.qkv'.*export.comfyui=false"):
        comfyui_state(TrainedDeltas(lone, lora_cfg), family.comfyui_layout, config)
    # diffusers' reader converts the blocks' modules (its table has no top-level ones)
    blocks = {k: v for k, v in tensors.items() if k.startswith("diffusion_model.layers.")}
    converted = pipe.lora_state_dict(blocks)
    for module, delta in ((m, d) for m, d in merged.items() if m.startswith("layers.")):
        a, b = (converted[f"transformer.{module}.lora_{x}.weight"].double() for x in "AB")
        torch.testing.assert_close(b @ a, delta.double(), rtol=1e-5, atol=1e-6, msg=module)


def test_sample_kwargs_give_the_pipelines_image_at_its_default_padding(ideogram):
    """A guidance scale or the pipeline's schedule at sample.steps; the text padding cut to the longest prompt
    renders the image the default 2048-token padding does."""
    family, _, pipe = ideogram
    for scale, steps in ((4.0, 5), (-1.0, 6), (-1.0, 2)):
        kwargs = family.sample_kwargs(pipe, list(CAPTIONS), scale, steps)
        pipe.check_inputs("a cat", 64, 64, steps, kwargs["guidance_scale"], kwargs["guidance_schedule"])
    schedule = family.sample_kwargs(pipe, ["a cat"], -1.0, 48)["guidance_schedule"]
    assert tuple(schedule) == (7.0,) * 45 + (3.0,) * 3  # Ideogram4Pipeline's default at its 48 steps
    kwargs = family.sample_kwargs(pipe, list(CAPTIONS), 4.0, 2)
    call = dict(prompt=CAPTIONS[1], height=32, width=32, num_inference_steps=2, output_type="np")
    ours = pipe(**call, **kwargs, generator=torch.Generator().manual_seed(0)).images
    default = pipe(**call, guidance_scale=4.0, guidance_schedule=None, generator=torch.Generator().manual_seed(0)).images
    assert kwargs["max_sequence_length"] < 64 and abs(ours - default).max() < 1e-5


@pytest.mark.parametrize("n, ok", [(2048, True), (2049, False)])
def test_config_check_holds_the_pipelines_length(n, ok):
    from stages.core.config import load_config
    from stages.core.errors import ConfigError
    from stages.demo import demo_config

    overrides = {"model": "unused", "captions.max_sequence_length": n}
    if ok:
        load_config(demo_config("ideogram4"), overrides)
    else:
        with pytest.raises(ConfigError, match=r"'captions.max_sequence_length' = 2049 .*Ideogram4Pipeline"):
            load_config(demo_config("ideogram4"), overrides)


def test_tiny_config_relations(ideogram):
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS

    _, folder, pipe = ideogram
    t = pipe.transformer.config
    text = pipe.text_encoder.config.text_config
    assert t.llm_features_dim == len(QWEN3_VL_ACTIVATION_LAYERS) * text.hidden_size
    assert text.num_hidden_layers == max(QWEN3_VL_ACTIVATION_LAYERS) + 1
    assert t.in_channels == 4 * pipe.vae.config.latent_channels and 2 * sum(t.mrope_section) == t.attention_head_dim
    uncond = pipe.unconditional_transformer
    assert {k: v for k, v in uncond.config.items() if k != "_name_or_path"} == {k: v for k, v in t.items() if k != "_name_or_path"}
    assert not torch.equal(uncond.input_proj.weight, pipe.transformer.input_proj.weight), "two transformers"
    index = json.loads((folder / "model_index.json").read_text())
    assert index["prompt_enhancer_head"] == [None, None], "no prompt enhancer in the tiny folder"
