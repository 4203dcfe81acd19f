"""Krea 2 against its own diffusers pipeline (Krea2Pipeline), on the tiny real architecture.

    .venv/bin/python -m pytest tests/families/test_family_krea2.py -q

- caption rows equal `encode_prompt`'s valid tokens (prefix, truncation, tapped layers, dropped prefix),
  also inside the pipeline's own 512-token block (padding before the suffix, valid-token positions);
- one training loss equals what the pipeline's own denoising step implies (timestep = sigma, velocity
  target, packing, position ids, text mask), and a padded batch trains like its items one by one;
- the timestep shift is the scheduler's at Krea 2's resolution-aware mu, latent normalization is what
  the decode inverts, packing and position ids are the pipeline's helpers.
The checks Qwen-Image and Z-Image share (tests/families/test_families_text.py) run here on Krea 2 unchanged.
"""

from __future__ import annotations

import diffusers
import pytest
import torch
from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

import test_families_text as shared
from conftest import FAMILIES, tiny_model
from stages.core import flow
from stages.core.config import CaptionsConfig, TrainConfig
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family
from test_families_text import CAPTIONS, _meta

CPU = make_runtime("cpu", "fp32")


@pytest.fixture(scope="module")
def krea(assets):
    """(family, model folder, Krea2Pipeline loaded from it): the tuple the shared checks take."""
    folder = tiny_model(assets, FAMILIES["krea2"])
    pipe = diffusers.Krea2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return get_family("krea2"), folder, pipe


def _encode(family, folder, max_len: int) -> dict[str, torch.Tensor]:
    encoder = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=max_len), CPU)
    return encoder.encode(CAPTIONS)


@pytest.mark.parametrize("max_len", [64, 12])  # 12 cuts the long caption: truncation must match too
def test_text_encoding_matches_pipeline(krea, max_len):
    shared.test_text_encoding_matches_pipeline(krea, max_len)


def test_token_counts_report_untruncated_length(krea):
    shared.test_token_counts_report_untruncated_length(krea)


def test_padded_batch_trains_like_single_items(krea):
    shared.test_padded_batch_trains_like_single_items(krea)


def test_rows_equal_the_pipelines_512_token_layout(krea):
    """Krea2Pipeline pads in the middle ([prefix | caption | padding | suffix]) and counts positions over
    valid tokens only: our short rows are the valid tokens of its default 512-token block."""
    family, folder, pipe = krea
    ours = _encode(family, folder, 64)
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(list(CAPTIONS), device="cpu")
    layers, width = len(pipe.text_encoder_select_layers), pipe.text_encoder.config.text_config.hidden_size
    assert embeds.shape == (2, 512, layers, width) and ours["prompt_embeds"].shape == (2, 64, layers, width)
    assert mask[:, -5:].all() and not mask[:, -6].any(), "the 5 suffix tokens come after the padding"
    assert ours["prompt_length"].tolist() == mask.sum(1).tolist()
    for i, (e, m) in enumerate(zip(embeds, mask)):
        torch.testing.assert_close(ours["prompt_embeds"][i, :int(m.sum())], e[m], rtol=1e-5, atol=1e-5)


def test_training_loss_matches_pipeline_step(krea):
    """Our loss at (x0, noise, sigma) equals the MSE between the velocity the pipeline steps with at
    x_t (its 512-token text block, one Euler step to sigma = 0, no CFG) and noise - x0."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    family, folder, loaded = krea
    pipe = diffusers.Krea2Pipeline(**{**loaded.components, "scheduler": FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)},
        text_encoder_select_layers=loaded.text_encoder_select_layers)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 8, 8, generator=g)
    with torch.no_grad():
        out = pipe(list(CAPTIONS), height=16, width=16, num_inference_steps=1, sigmas=[0.6], guidance_scale=0.0,
                   latents=pipe._pack_latents(latents, 2, 16, 8, 8), output_type="latent").images
        sigma = float(pipe.scheduler.sigmas[0])
        velocity = (latents - flow.unpack_2x2(out, 8, 8)) / sigma
        noise = torch.randn(latents.shape, generator=g)
        x0 = (latents - sigma * noise) / (1 - sigma)  # so that (1 - sigma) x0 + sigma noise = latents
        cond = _encode(family, folder, 64)
        assert cond["prompt_length"][0] != cond["prompt_length"][1]
        ours = family.loss(pipe.transformer, x0, noise, torch.full((2,), sigma), cond, _meta(2, 8, 8), TrainConfig())
    expected = ((velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    wrong_sign = ((-velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    assert (wrong_sign - expected).abs().min() > 1e-3, "the check must tell the output's sign apart"


@pytest.mark.parametrize("latent_hw", [(32, 32), (128, 96)])  # 256 and 3072 image tokens
def test_timesteps_are_the_schedulers_at_krea2_shift(krea, latent_hw):
    family, folder, _ = krea
    # The tiny pipeline's scheduler as saved (the Krea2Pipeline docstring's settings).
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    s = scheduler.config
    assert s.use_dynamic_shifting and s.time_shift_type == "exponential"
    seq_len = (latent_hw[0] // 2) * (latent_hw[1] // 2)
    mu = calculate_shift(seq_len, s.base_image_seq_len, s.max_image_seq_len, s.base_shift, s.max_shift)
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / 1000, 1000).tolist(), mu=mu)
    tcfg = TrainConfig(timestep_density="uniform", dynamic_shift=True)
    ours = family.sample_timesteps(64, latent_hw, torch.Generator().manual_seed(4), tcfg)
    u = torch.rand(64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours, scheduler.sigmas[:-1][(u * 1000).long()].float(), rtol=1e-5, atol=1e-6)
    flux_range = calculate_shift(seq_len)  # FLUX's 256..4096: a different shift above 256 tokens
    assert seq_len == 256 or abs(flux_range - mu) > 0.1


def test_latent_normalization_packing_and_positions_as_pipeline(krea):
    family, folder, pipe = krea
    vae = pipe.vae
    norm = family.latent_normalization(vae)
    z = torch.randn(2, 16, 6, 4, generator=torch.Generator().manual_seed(3))
    x = family.normalize_latents(z, norm)
    std, mean = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1), torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1)
    torch.testing.assert_close(x / (1.0 / std) + mean, z, rtol=1e-5, atol=1e-5)  # the pipeline's decode
    torch.testing.assert_close(family.denormalize_latents(x, norm), z, rtol=1e-5, atol=1e-5)
    assert family.pixel_multiple(ModelSource(str(folder))) == pipe.vae_scale_factor * pipe.patch_size
    packed = pipe._pack_latents(z, 2, 16, 6, 4)
    assert torch.equal(flow.pack_2x2(z), packed)
    size = dict(height=6 * pipe.vae_scale_factor, width=4 * pipe.vae_scale_factor)
    assert torch.equal(flow.unpack_2x2(packed, 6, 4), pipe._unpack_latents(packed, **size).squeeze(2))
    assert torch.equal(family.position_ids(7, 6, 4, torch.device("cpu")), pipe.prepare_position_ids(7, 3, 2, "cpu"))


@pytest.mark.parametrize("n, ok", [(5, False), (6, True)])
def test_config_check_leaves_room_for_a_caption_token(n, ok):
    from stages.core.config import load_config
    from stages.demo import demo_config
    from stages.families import config_errors

    from stages.core.errors import ConfigError

    overrides = {"model": "unused", "captions.max_sequence_length": n}
    if ok:
        assert config_errors(load_config(demo_config("krea2"), overrides)) == []
    else:
        with pytest.raises(ConfigError, match=r"'captions.max_sequence_length' = 5 .*6 or more"):
            load_config(demo_config("krea2"), overrides)


def test_tiny_config_relations(krea):
    _, _, pipe = krea
    t, text = pipe.transformer.config, pipe.text_encoder.config.text_config
    assert t.text_hidden_dim == text.hidden_size and t.in_channels == 4 * pipe.vae.config.z_dim
    assert t.num_text_layers == len(pipe.text_encoder_select_layers)
    assert max(pipe.text_encoder_select_layers) <= text.num_hidden_layers  # hidden_states has layers + 1 entries
    tok = pipe.tokenizer
    assert len(tok(pipe.prompt_template_encode_prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    assert len(tok(pipe.prompt_template_encode_suffix).input_ids) == pipe.prompt_template_encode_num_suffix_tokens
    assert pipe.text_encoder.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")


def test_full_size_folder_taps_as_many_text_layers_as_its_transformer_takes():
    """The bench's full-size folder (model_index.json) must carry the released taps, not the tiny model's
    2: with them, I's first H200 run cached (77, 2, 2560) rows that the 12-layer transformer refused."""
    from bench.full_configs import pipeline_extra
    from stages.families.krea2 import full

    layers = pipeline_extra("krea2")["text_encoder_select_layers"]
    assert full.TRANSFORMER["num_text_layers"] == len(layers)
    assert max(layers) <= full.QWEN3_VL_4B_TEXT["num_hidden_layers"]  # hidden_states has layers + 1 entries
    assert full.TRANSFORMER["text_hidden_dim"] == full.QWEN3_VL_4B_TEXT["hidden_size"]
