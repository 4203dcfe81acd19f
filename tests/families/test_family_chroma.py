"""Chroma against its own diffusers pipeline (ChromaPipeline), on the tiny real architecture.

    .venv/bin/python -m pytest tests/families/test_family_chroma.py -q

- caption rows equal `encode_prompt`'s embeds and the mask it hands on (caption + one padding token);
- one training loss equals what the pipeline's own denoising step implies (timestep = sigma, velocity
  target, packing, ids, no guidance input) with the pipeline's mask as a real mask, for two captions of
  different lengths encoded at our 64 tokens against the pipeline's 512; the stock float mask differs;
- a padded batch trains like its items one by one, also under gradient checkpointing, where diffusers'
  own forward drops the single blocks' mask;
- the timestep shift is the scheduler's (static, or dynamic at FLUX.1's range); latent normalization,
  packing and ids are the pipeline's; ComfyUI's names for Chroma's modules.
"""

from __future__ import annotations

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
from test_families_text import CAPTIONS, _meta

CPU = make_runtime("cpu", "fp32")


@pytest.fixture(scope="module")
def chroma(assets):
    """(family, model folder, ChromaPipeline loaded from it): the tuple the shared checks take."""
    folder = tiny_model(assets, FAMILIES["chroma"])
    pipe = diffusers.ChromaPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return get_family("chroma"), folder, pipe


def _encode(family, folder, max_len: int) -> dict[str, torch.Tensor]:
    encoder = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=max_len), CPU)
    return encoder.encode(CAPTIONS)


@pytest.mark.parametrize("max_len", [64, 12])  # 12 cuts the long caption: then the mask keeps all 12
def test_text_encoding_matches_pipeline(chroma, max_len):
    family, folder, pipe = chroma
    ours = _encode(family, folder, max_len)
    with torch.no_grad():
        embeds, text_ids, mask, *_ = pipe.encode_prompt(CAPTIONS, device="cpu", do_classifier_free_guidance=False,
                                                        max_sequence_length=max_len)
    torch.testing.assert_close(ours["prompt_embeds"], embeds, rtol=1e-6, atol=1e-6)
    kept = torch.arange(max_len)[None, :] < ours["prompt_length"][:, None]
    assert torch.equal(kept, mask.bool()) and torch.equal(mask, mask.bool().float()), "the pipeline's 0/1 mask"
    assert not text_ids.any()
    tokens = pipe.tokenizer(CAPTIONS, padding="max_length", max_length=max_len, truncation=True).attention_mask
    if max_len == 64:  # the caption's tokens (EOS included) and one padding token
        assert ours["prompt_length"].tolist() == [sum(t) + 1 for t in tokens]
        assert ours["prompt_length"][0] < ours["prompt_length"][1] < max_len
    else:
        assert ours["prompt_length"][1] == max_len == sum(tokens[1])


def test_token_counts_report_untruncated_length(chroma):
    family, folder, pipe = chroma
    encoder = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=12), CPU)
    full = [len(ids) for ids in pipe.tokenizer(CAPTIONS).input_ids]
    assert encoder.token_counts(CAPTIONS) == full and full[1] > 12


def _pipeline_velocity(pipe, latents: torch.Tensor, sigma: float, **prompt) -> torch.Tensor:
    """The velocity the pipeline steps with at `latents` (one Euler step to sigma = 0, no CFG):
    out = latents - sigma * v. The tiny scheduler's static shift 1.0 keeps sigma as asked."""
    b, c, h, w = latents.shape
    out = pipe(**prompt, height=h * pipe.vae_scale_factor, width=w * pipe.vae_scale_factor, num_inference_steps=1,
               sigmas=[sigma], guidance_scale=1.0, latents=flow.pack_2x2(latents), output_type="latent").images
    assert float(pipe.scheduler.sigmas[0]) == pytest.approx(sigma)
    return (latents - flow.unpack_2x2(out, h, w)) / sigma


def test_training_loss_matches_pipeline_step(chroma):
    """Our loss at (x0, noise, sigma), captions cached at 64 tokens, equals the MSE between noise - x0 and
    the velocity of the pipeline's step with its own 512-token prompt and mask, the mask as booleans.
    With the pipeline's float mask (padding attended) the velocity differs."""
    family, folder, pipe = chroma
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 8, 8, generator=g)
    sigma = 0.6
    with torch.no_grad():
        embeds, _, mask, *_ = pipe.encode_prompt(CAPTIONS, device="cpu", do_classifier_free_guidance=False)
        assert embeds.shape[1] == 512
        velocity = _pipeline_velocity(pipe, latents, sigma, prompt_embeds=embeds, prompt_attention_mask=mask.bool())
        noise = torch.randn(latents.shape, generator=g)
        x0 = (latents - sigma * noise) / (1 - sigma)  # so that (1 - sigma) x0 + sigma noise = latents
        cond = _encode(family, folder, 64)
        assert cond["prompt_length"][0] != cond["prompt_length"][1]
        ours = family.loss(pipe.transformer, x0, noise, torch.full((2,), sigma), cond, _meta(2, 8, 8), TrainConfig())
        float_mask = _pipeline_velocity(pipe, latents, sigma, prompt=list(CAPTIONS))
    expected = ((velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    assert (float_mask - velocity).abs().max() > 1e-3, "the stock float mask attends to the padding"
    wrong_sign = ((-velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    assert (wrong_sign - expected).abs().min() > 1e-3, "the check must tell the output's sign apart"


def test_padded_batch_trains_like_single_items(chroma):
    shared.test_padded_batch_trains_like_single_items(chroma)


def test_checkpointed_masked_batch_trains_as_without_checkpointing(chroma):
    """ChromaTrainable under gradient checkpointing: the loss and LoRA gradients of a batch with a mask equal
    the un-checkpointed ones; diffusers' own forward, which drops the single blocks' mask there, does not."""
    family, folder, pipe = chroma
    model, params = shared._lora_model(family, folder)
    cond = _encode(family, folder, 64)
    g = torch.Generator().manual_seed(2)
    x0, noise = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 16, 8, 8, generator=g)
    t = torch.tensor([0.3, 0.8])

    batch = (x0, noise, t, cond, _meta(2, 8, 8))
    plain_loss, _ = shared.checkpointing_changes_nothing(family, model, params, *batch)
    model.__class__ = diffusers.ChromaTransformer2DModel  # the same modules and weights, the stock forward
    stock_loss, _ = shared.loss_and_grads(family, model, params, *batch)
    assert (stock_loss - plain_loss).abs().max() > 1e-5, "the stock checkpointed forward drops the mask"


@pytest.mark.parametrize("dynamic", [False, True])
def test_timesteps_are_the_schedulers(chroma, dynamic):
    """Static shift (the tiny scheduler, FLUX.1-schnell's) or, with train.dynamic_shift, exp(mu) from the
    pipeline's calculate_shift over the scheduler's range, as ChromaPipeline sets its sigmas."""
    from diffusers.pipelines.chroma.pipeline_chroma import calculate_shift

    family, _, pipe = chroma
    latent_hw = (64, 48)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(
        pipe.scheduler.config, **({"use_dynamic_shifting": True} if dynamic else {"shift": 3.0}))
    s = scheduler.config
    mu = calculate_shift((64 // 2) * (48 // 2), s.base_image_seq_len, s.max_image_seq_len, s.base_shift, s.max_shift)
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / 1000, 1000).tolist(), mu=mu)
    tcfg = TrainConfig(timestep_density="uniform", dynamic_shift=dynamic, shift=3.0)
    ours = family.sample_timesteps(64, latent_hw, torch.Generator().manual_seed(4), tcfg)
    u = torch.rand(64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours, scheduler.sigmas[:-1][(u * 1000).long()].float(), rtol=1e-5, atol=1e-6)


def test_latent_normalization_packing_and_ids_as_pipeline(chroma):
    family, folder, pipe = chroma
    shared.test_latent_normalization_as_pipeline_decodes(chroma)
    z = torch.randn(2, 16, 6, 4, generator=torch.Generator().manual_seed(3))
    packed = pipe._pack_latents(z, 2, 16, 6, 4)
    assert torch.equal(flow.pack_2x2(z), packed)
    size = (6 * pipe.vae_scale_factor, 4 * pipe.vae_scale_factor)
    assert torch.equal(flow.unpack_2x2(packed, 6, 4), pipe._unpack_latents(packed, *size, pipe.vae_scale_factor))
    ids = pipe._prepare_latent_image_ids(2, 3, 2, "cpu", torch.float32)
    assert torch.equal(family.image_ids(6, 4, torch.device("cpu"), torch.float32), ids)


def test_comfyui_names_are_flux_tables_and_the_approximators_own(chroma):
    """ComfyUI maps Chroma's diffusers names through FLUX.1's table (its Chroma class is a Flux); the
    approximator has only ComfyUI's own names (comfy/ldm/chroma/layers.py: in_layer, out_layer)."""
    family, folder, _ = chroma
    from test_comfyui_export import shapes_of

    config = json.loads((folder / "transformer" / "config.json").read_text())
    kmap = comfyui.key_map(family.comfyui_layout, shapes_of(folder, "chroma"), config)
    q = kmap["transformer.single_transformer_blocks.0.attn.to_q"]
    assert q.weight == "single_blocks.0.linear1" and kmap["lora_unet_single_blocks_0_linear1"].modules == tuple(
        f"single_transformer_blocks.0.{m}" for m in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))
    assert kmap["transformer.transformer_blocks.0.ff_context.net.2"].weight == "double_blocks.0.txt_mlp.2"
    assert kmap["transformer.proj_out"].weight == "final_layer.linear"
    layer = kmap["diffusion_model.distilled_guidance_layer.layers.0.in_layer"]
    assert layer.modules == ("distilled_guidance_layer.layers.0.linear_1",)
    assert kmap["lora_unet_distilled_guidance_layer_out_proj"].modules == ("distilled_guidance_layer.out_proj",)
    assert not any(k.startswith("transformer.distilled_guidance_layer") for k in kmap), "not in FLUX.1's table"


@pytest.mark.parametrize("n, ok", [(512, True), (513, False)])
def test_config_check_holds_the_pipelines_t5_limit(n, ok):
    from stages.core.config import load_config
    from stages.core.errors import ConfigError
    from stages.demo import demo_config

    overrides = {"model": "unused", "captions.max_sequence_length": n}
    if ok:
        load_config(demo_config("chroma"), overrides)
    else:
        with pytest.raises(ConfigError, match=r"'captions.max_sequence_length' = 513 .*ChromaPipeline's T5 limit"):
            load_config(demo_config("chroma"), overrides)


def test_tiny_config_relations(chroma):
    _, _, pipe = chroma
    t = pipe.transformer.config
    assert t.joint_attention_dim == pipe.text_encoder.config.d_model
    assert t.in_channels == 4 * pipe.vae.config.latent_channels
    assert sum(t.axes_dims_rope) == t.attention_head_dim and t.approximator_num_channels % 4 == 0
    assert not pipe.vae.config.use_quant_conv and pipe.vae.config.shift_factor == pytest.approx(0.1159)


def test_the_timestep_embedding_is_the_stock_one_made_on_the_timesteps_device(chroma, monkeypatch):
    """ChromaTrainable's timestep embedding equals diffusers' for a batch, and makes nothing on the CPU to copy over
    (the stock one's `torch.tensor([0] * batch)` made Chroma's CUDA graph capture fail, so its train ran eager)."""
    from diffusers.models.transformers.transformer_chroma import ChromaCombinedTimestepTextProjEmbeddings

    from stages.families.chroma.denoiser import ChromaTrainable

    family, folder, pipe = chroma
    model = ChromaTrainable.from_pretrained(folder, subfolder="transformer")
    stock_model = diffusers.ChromaTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(2, 16, 64, generator=g), "encoder_hidden_states": torch.randn(2, 8, 32, generator=g),
              "timestep": torch.tensor([0.3, 0.8]), "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3),
              "return_dict": False}
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], stock_model(**inputs)[0])
    embed = model.time_text_embed
    assert type(embed) is not ChromaCombinedTimestepTextProjEmbeddings
    t = torch.tensor([0.3, 0.8]) * 1000
    ours = embed(t)
    stock = ChromaCombinedTimestepTextProjEmbeddings.forward(embed, t)
    assert torch.equal(ours, stock)
    made = []
    tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or tensor(*a, **k))
    embed(t)
    assert made == []
