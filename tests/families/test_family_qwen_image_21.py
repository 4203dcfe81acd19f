"""Qwen-Image 2.1 against QwenImage21Pipeline's own code, on the tiny real architecture.

    .venv/bin/python -m pytest tests/families/test_family_qwen_image_21.py -q

- cached caption rows equal the pipeline's `encode_prompt` of each caption alone (template, dropped
  system prefix, pre-norm last hidden state, empty caption -> " "), whatever shares the encode batch;
- latents: opaque RGBA into the VAE and per-channel normalization as the pipeline's
  `_encode_vae_image` computes them; `denormalize_latents` is the decode's inverse;
- sigmas as the scheduler makes them with the pipeline's `calculate_shift` over h*w tokens;
- one training loss equals the transformer called as the pipeline's denoising step calls it, and a
  batch of captions of different lengths (left-padded) equals its items one by one;
- the loss's layout forward (denoiser.py) equals the stock forward in values and LoRA gradients,
  and traces with no graph break where the stock one breaks (what lets a CUDA graph capture it).
"""

from __future__ import annotations

import math

import diffusers
import numpy as np
import pytest
import torch

from conftest import FAMILIES, tiny_model
from stages.core import flow
from stages.core.config import CaptionsConfig, TrainConfig
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family
from stages.families.base import BatchMeta
from stages.families.qwen_image_21.family import joint_img_mask

NAME = "qwen-image-2.1"
CAPTIONS = ["a red circle", "", "a large blue square on a white background at the top left corner of the picture"]
CPU = make_runtime("cpu", "fp32")


@pytest.fixture(scope="module")
def fam(assets):
    """(family, model folder, pipeline loaded by its real class)."""
    folder = tiny_model(assets, FAMILIES[NAME])
    return get_family(NAME), folder, diffusers.QwenImage21Pipeline.from_pretrained(folder)


def _encoder(family, folder, max_len: int):
    return family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=max_len), CPU)


def test_text_rows_equal_pipeline_encode_prompt_of_each_caption_alone(fam):
    family, folder, pipe = fam
    encoder = _encoder(family, folder, 64)
    assert encoder.drop == pipe._drop_idx, "system prefix length differs from the pipeline's chat-templated count"
    ours = encoder.encode(CAPTIONS)
    for i, caption in enumerate(CAPTIONS):
        embeds, mask, image_pad = pipe.encode_prompt(caption, device="cpu")
        assert mask is None and not image_pad.any()
        n = embeds.shape[1]
        assert int(ours["prompt_length"][i]) == n
        torch.testing.assert_close(ours["prompt_embeds"][i, :n], embeds[0], rtol=1e-5, atol=1e-5)
        assert not ours["prompt_embeds"][i, n:].any(), "padding must be zeros"
    assert encoder.token_counts(CAPTIONS) == ours["prompt_length"].tolist()


def test_truncation_keeps_the_first_tokens_and_counts_report_the_full_length(fam):
    family, folder, pipe = fam
    cut = _encoder(family, folder, 6).encode(CAPTIONS[2:])
    full = pipe.encode_prompt(CAPTIONS[2], device="cpu")[0][0]
    assert len(full) > 6 and int(cut["prompt_length"][0]) == 6
    torch.testing.assert_close(cut["prompt_embeds"][0], full[:6], rtol=1e-5, atol=1e-5)
    assert _encoder(family, folder, 6).token_counts(CAPTIONS[2:]) == [len(full)]


def test_latents_as_the_pipeline_encodes_and_decodes_them(fam):
    family, folder, pipe = fam
    vae = family.load_vae(ModelSource(str(folder)), CPU)
    rgb = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    from PIL import Image

    rgba = Image.fromarray(rgb).convert("RGBA")  # what __call__ does to a condition image
    pipe_pixels = pipe.image_processor.preprocess(rgba, width=96, height=64).unsqueeze(2)
    expected = pipe._encode_vae_image(pipe_pixels, generator=None)[:, :, 0]  # argmax = posterior mean, normalized
    pixels = torch.from_numpy(rgb).permute(2, 0, 1)[None].float() / 127.5 - 1
    mean, logvar = family.encode_posterior(vae, pixels)
    assert mean.shape == (1, vae.config.z_dim, 4, 6) and logvar.shape == mean.shape
    assert logvar.min() >= -30 and logvar.max() <= 20
    norm = family.latent_normalization(vae)
    x = family.normalize_latents(mean, norm)
    torch.testing.assert_close(x, expected, rtol=1e-4, atol=1e-4)
    decode_in = x[:, :, None] * torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1) + torch.tensor(
        vae.config.latents_mean).view(1, -1, 1, 1, 1)  # the lines before vae.decode in __call__
    torch.testing.assert_close(family.denormalize_latents(x, norm), decode_in[:, :, 0], rtol=1e-5, atol=1e-5)
    assert family.pixel_multiple(ModelSource(str(folder))) == pipe.vae_scale_factor * 2


@pytest.mark.parametrize("hw", [(4, 4), (64, 64), (96, 64)])
def test_sigmas_follow_the_scheduler_with_the_pipelines_shift(fam, hw):
    family, _, pipe = fam
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    sched = pipe.scheduler
    tokens = pipe._pack_latents(torch.zeros(1, 8, *hw), 1, 8, *hw).shape[1]
    mu = calculate_shift(tokens, sched.config.get("base_image_seq_len", 256), sched.config.get("max_image_seq_len", 4096),
                         sched.config.get("base_shift", 0.5), sched.config.get("max_shift", 1.15))
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / 1000, 1000), mu=mu)
    gen = torch.Generator().manual_seed(0)
    tcfg = TrainConfig(timestep_density="uniform", dynamic_shift=True)
    ours = family.sample_timesteps(50, hw, gen, tcfg)
    idx = (torch.rand(50, generator=torch.Generator().manual_seed(0), dtype=torch.float32) * 1000).long()
    torch.testing.assert_close(ours, sched.sigmas[:-1][idx].float(), rtol=1e-5, atol=1e-6)
    assert tokens == hw[0] * hw[1], "one token per latent pixel: no 2x2 packing"


def _denoiser(folder):
    """The train stage's load (denoiser.py's subclass): without `layout` its forward is the stock one."""
    return get_family(NAME).load_denoiser(ModelSource(str(folder)), "fp32", CPU, TrainConfig()).eval()


def _batch(family, folder, captions):
    cond = _encoder(family, folder, 64).encode(captions)
    gen = torch.Generator().manual_seed(1)
    b = len(captions)
    x0, noise = torch.randn(b, 8, 4, 6, generator=gen), torch.randn(b, 8, 4, 6, generator=gen)
    meta = BatchMeta(torch.tensor([[64, 96]] * b), torch.zeros(b, 2, dtype=torch.int64), torch.tensor([[64, 96]] * b))
    return cond, x0, noise, torch.tensor([0.3, 0.8, 0.55][:b]), meta


def test_loss_is_the_pipelines_transformer_call_and_batches_equal_singles(fam):
    family, folder, pipe = fam
    denoiser, tcfg = _denoiser(folder), TrainConfig()
    cond, x0, noise, t, meta = _batch(family, folder, CAPTIONS)
    with torch.no_grad():
        batched = family.loss(denoiser, x0, noise, t, cond, meta, tcfg)
        for i, caption in enumerate(CAPTIONS):
            embeds, mask, image_pad = pipe.encode_prompt(caption, device="cpu")
            latents = pipe._pack_latents(flow.noisy_latents(x0[i:i + 1], noise[i:i + 1], t[i:i + 1]), 1, 8, 4, 6)
            img_mask = torch.cat([image_pad, image_pad.new_ones(1, latents.shape[1] // 4)], dim=1)
            assert torch.equal(img_mask, joint_img_mask(1, embeds.shape[1], 24, "cpu"))
            pred = denoiser(hidden_states=latents, timestep=(t[i:i + 1] * 1000) / 1000, encoder_hidden_states=embeds,
                            encoder_hidden_states_mask=mask, img_shapes=[[(1, 4, 6)]], img_mask=img_mask,
                            return_dict=False)[0][:, -latents.shape[1]:]
            unpacked = pipe._unpack_latents(pred, 64, 96, pipe.vae_scale_factor)[:, :, 0]
            expected = ((unpacked - (noise[i] - x0[i])) ** 2).mean()
            torch.testing.assert_close(batched[i], expected, rtol=1e-4, atol=1e-6)
    assert math.isfinite(float(batched.sum()))


def test_left_padding_has_no_nan_in_the_masked_rows(fam):
    """Left-padded caption rows attend to nothing in the causal text segment; SDPA must give them
    zeros, not NaN, or the NaN would reach every later token through the values."""
    family, folder, _ = fam
    denoiser = _denoiser(folder).requires_grad_(True)  # every weight's gradient checked, not only a LoRA's
    cond, x0, noise, t, meta = _batch(family, folder, CAPTIONS[:2])
    assert cond["prompt_length"][0] != cond["prompt_length"][1]
    loss = family.loss(denoiser, x0, noise, t, cond, meta, TrainConfig())
    loss.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in denoiser.parameters() if p.grad is not None)


def _lora(denoiser):
    from peft import LoraConfig

    denoiser.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(get_family(NAME).default_lora_targets),
                                    init_lora_weights=False))  # non-zero B: the adapter changes the output
    return [p for n, p in denoiser.named_parameters() if "lora_" in n]


def _stock_and_layout_calls(denoiser, b, text_len, h, w, masked):
    from stages.families.qwen_image_21.denoiser import layout

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(b, h * w, denoiser.config.in_channels, generator=gen)
    text = torch.randn(b, text_len, denoiser.config.context_in_dim, generator=gen)
    mask = torch.ones(b, text_len, dtype=torch.bool)
    if masked:
        mask[0, :2] = False  # a left-padded shorter caption
    t = torch.tensor([0.3, 0.7][:b])
    common = {"hidden_states": x, "encoder_hidden_states": text, "timestep": t,
              "encoder_hidden_states_mask": mask if masked else None}
    stock = {**common, "img_shapes": [[(1, h, w)]] * b, "img_mask": joint_img_mask(b, text_len, h * w, "cpu"),
             "return_dict": False}
    return stock, {**common, "layout": layout(denoiser, text_len, h, w, torch.device("cpu"))}


@pytest.mark.parametrize("masked", [False, True])
def test_layout_forward_equals_the_stock_forward_in_values_and_lora_gradients(fam, masked):
    _, folder, _ = fam
    denoiser = _denoiser(folder)
    params = _lora(denoiser)
    denoiser.enable_gradient_checkpointing()  # the train stage's path through _gradient_checkpointing_func
    denoiser.train()
    stock, ours = _stock_and_layout_calls(denoiser, 2, 5, 4, 6, masked)
    results = []
    for kwargs in (stock, ours):
        out = denoiser(**kwargs)[0]
        grads = torch.autograd.grad((out ** 2).sum(), params)
        results.append((out.detach(), grads))
    (o1, g1), (o2, g2) = results
    assert o1.shape[:2] == (2, 5 + 24)
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in g1)


def test_layout_forward_traces_without_a_graph_break_where_the_stock_one_breaks(fam):
    """A device sync (tolist, nonzero, boolean indexing) breaks a dynamo graph as it breaks a CUDA
    graph capture: the layout path must trace whole, the stock one does not."""
    import torch._dynamo

    _, folder, _ = fam
    denoiser = _denoiser(folder)
    stock, ours = _stock_and_layout_calls(denoiser, 2, 5, 4, 6, True)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = denoiser(**ours)[0]
        got = torch.compile(lambda kw: denoiser(**kw)[0], backend="eager", fullgraph=True)(ours)
        torch.testing.assert_close(got, expected)
        torch._dynamo.reset()
        with pytest.raises(Exception):
            torch.compile(lambda kw: denoiser(**kw)[0], backend="eager", fullgraph=True)(stock)
    torch._dynamo.reset()


def test_layout_forward_refuses_flex_attention(fam):
    _, folder, _ = fam
    denoiser = _denoiser(folder)
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21FlexAttnProcessor

    denoiser.transformer_blocks[0].attn.set_processor(QwenImage21FlexAttnProcessor())
    _, ours = _stock_and_layout_calls(denoiser, 1, 5, 4, 6, False)
    with pytest.raises(ValueError, match="QwenImage21AttnProcessor's segments"):
        denoiser(**ours)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["nf4", "bf16"])
def test_cuda_graphs_capture_the_training_step_with_the_eager_losses(assets, demo_data, tmp_path, precision,
                                                                      monkeypatch):
    """On the H200 every capture of the stock forward failed (bench-qwen-image-2.1-I4.json); with the
    layout forward the train stage captures one graph and replays it, with the eager steps' losses."""
    from conftest import losses_and_lora, make_cfg
    from stages import cache_latents, encode_captions
    from stages.core import fastpath
    from stages.core.events import EventLog
    from stages.core.runtime import torch_flags
    from stages.train.trainer import Trainer

    cfg = make_cfg(NAME, assets, demo_data, tmp_path, **{"device": "cuda", "train.base_precision": precision,
                                                         "train.steps": 6, "runtime.checkpoint_every": 0,
                                                         "train.batch_size": 2, "runtime.gradient_checkpointing": True,
                                                         "runtime.compile_transformer": "off"})
    encode_captions.run(cfg)
    cache_latents.run(cfg)
    runs = []
    for mode in ("off", "on"):
        monkeypatch.setenv(fastpath.ENV, mode)
        with torch_flags(True, False, True):
            tr = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, f"train-{mode}"))
            torch.manual_seed(cfg.seed)
            tr.setup_model()
            runs.append((*losses_and_lora(tr), tr.denoiser))
    (l0, w0, _), (l1, w1, graphed) = runs
    assert isinstance(graphed, fastpath.GraphedDenoiser)
    summary = graphed.summary()
    assert summary["failed"] == 0 and summary["graphs"] >= 1 and summary["replays"] >= 3, summary
    assert l1[0] == l0[0]
    assert (l1 - l0).abs().max() <= 2e-3 and (w1 - w0).abs().max() <= 1e-3 * max(1.0, float(w0.abs().max()))
