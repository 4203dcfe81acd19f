"""ERNIE-Image against its own diffusers pipeline (ErnieImagePipeline), on the tiny real architecture.

    .venv/bin/python -m pytest tests/families/test_family_ernie_image.py -q

- caption rows equal `encode_prompt`'s per-caption states (BOS, no padding, hidden_states[-2], the empty
  caption's [BOS]), encoded in a right-padded batch; a cut caption keeps exactly the prefix of its states;
- one training loss equals what the pipeline's own denoising step implies (timestep = 1000 sigma, the
  velocity's sign, 2x2 patchifying, text lengths), and a padded batch trains like its items one by one,
  also under gradient checkpointing;
- the timestep shift is the scheduler's static one, train.dynamic_shift is refused; latent normalization
  is what the decode inverts, with the pipeline's batch-norm eps 1e-5; ComfyUI's names are diffusers' own.
Export round trip, cached = uncached, batched = single and the fp8 base run in tests/families/test_family.py.
"""

from __future__ import annotations

import json

import diffusers
import pytest
import torch

from conftest import FAMILIES, tiny_model
from stages.core import comfyui, flow, lora
from stages.core.config import CaptionsConfig, TrainConfig
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family
from stages.families.ernie_image.family import patchify, unpatchify
from test_families_text import CAPTIONS, _lora_model, _meta, padded_batch_trains_like_single_items

CPU = make_runtime("cpu", "fp32")


@pytest.fixture(scope="module")
def ernie(assets):
    """(family, model folder, ErnieImagePipeline loaded from it)."""
    folder = tiny_model(assets, FAMILIES["ernie-image"])
    pipe = diffusers.ErnieImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return get_family("ernie-image"), folder, pipe


def _encode(family, folder, max_len: int, texts=CAPTIONS) -> dict[str, torch.Tensor]:
    encoder = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=max_len), CPU)
    return encoder.encode(list(texts))


@pytest.mark.parametrize("max_len", [64, 6])  # 6 cuts the long caption
def test_text_encoding_matches_pipeline(ernie, max_len):
    family, folder, pipe = ernie
    texts = [*CAPTIONS, ""]
    ours = _encode(family, folder, max_len, texts)
    rows = pipe.encode_prompt(texts, device="cpu")  # one (T, D) tensor per caption, never padded or cut here
    assert ours["prompt_embeds"].shape[1] == max_len, "rows are stored padded to max_sequence_length"
    assert ours["prompt_length"].tolist() == [min(len(r), max_len) for r in rows]
    for i, row in enumerate(rows):
        n = min(len(row), max_len)  # the decoder is causal: a cut caption's states are its prefix's
        torch.testing.assert_close(ours["prompt_embeds"][i, :n], row[:n], rtol=1e-5, atol=1e-5)
        assert not ours["prompt_embeds"][i, n:].any(), "padding must be zeros"
    assert len(rows[2]) == 1, "the empty caption is [BOS]"
    if max_len == 64:
        assert len(rows[0]) < len(rows[1]) < max_len, "the two captions must differ in length and fit"


def test_token_counts_report_untruncated_length(ernie):
    family, folder, pipe = ernie
    encoder = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=6), CPU)
    full = [len(r) for r in pipe.encode_prompt(list(CAPTIONS), device="cpu")]
    assert encoder.token_counts(list(CAPTIONS)) == full and full[1] > 6


def _pipeline_step(pipe, latents: torch.Tensor, steps: int = 2) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(x_t, the velocity the pipeline's last step moves x_t with, its sigma): `steps` steps without CFG,
    x_t caught before the last one; the last step goes to sigma 0, so out = x_t - sigma v."""
    seen: list[torch.Tensor] = []

    def catch(_pipe, i, t, kwargs):
        if i == steps - 2:
            seen.append(kwargs["latents"].clone())
        return {}

    out = pipe(prompt=list(CAPTIONS), height=latents.shape[-2] * pipe.vae_scale_factor,
               width=latents.shape[-1] * pipe.vae_scale_factor, num_inference_steps=steps, guidance_scale=1.0,
               latents=latents, output_type="latent", callback_on_step_end=catch).images
    sigma = float(pipe.scheduler.sigmas[steps - 1])
    return seen[0], (seen[0] - out) / sigma, sigma


def test_training_loss_matches_pipeline_step(ernie):
    """Our loss at (x0, noise, sigma), captions cached at 64 tokens, equals the MSE between noise - x0 and the
    velocity of the pipeline's own step at x_t, at the pipeline's shifted sigma (4.0 shifts 0.5 to 0.8)."""
    family, folder, pipe = ernie
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        x_t, velocity, sigma = _pipeline_step(pipe, torch.randn(2, 128, 4, 4, generator=g))
        assert sigma == pytest.approx(0.8)
        noise = torch.randn(x_t.shape, generator=g)
        x0 = (x_t - sigma * noise) / (1 - sigma)  # so that (1 - sigma) x0 + sigma noise = x_t
        cond = _encode(family, folder, 64)
        assert cond["prompt_length"][0] != cond["prompt_length"][1]
        ours = family.loss(pipe.transformer, unpatchify(x0), unpatchify(noise), torch.full((2,), sigma), cond,
                           _meta(2, 8, 8), TrainConfig())
    expected = ((velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    wrong_sign = ((-velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    assert (wrong_sign - expected).abs().min() > 1e-3, "the check must tell the output's sign apart"


def test_padded_batch_trains_like_single_items(ernie):
    """With and without gradient checkpointing (ERNIE's blocks take the text mask as an argument)."""
    family, folder, _ = ernie
    model, params = _lora_model(family, folder)
    padded_batch_trains_like_single_items(family, model, params, _encode(family, folder, 64), 32, (False, True))


def test_timesteps_are_the_schedulers(ernie):
    """Training sigmas are the scheduler's own table (static shift, from its config), and the pipeline's
    inference sigmas are the same shift of its linspace: one shift function at training and sampling."""
    family, _, pipe = ernie
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    assert not scheduler.config.use_dynamic_shifting and scheduler.config.shift == 4.0
    tcfg = TrainConfig(timestep_density="uniform", shift=scheduler.config.shift)
    ours = family.sample_timesteps(64, (64, 48), torch.Generator().manual_seed(4), tcfg)
    u = torch.rand(64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours, scheduler.sigmas[:-1][(u * 1000).long()].float(), rtol=1e-5, atol=1e-6)
    pipe(prompt="a red circle", height=16, width=16, num_inference_steps=5, guidance_scale=1.0, output_type="latent")
    torch.testing.assert_close(pipe.scheduler.sigmas[:-1],
                               flow.shift_sigmas(torch.linspace(1.0, 0.0, 6)[:-1], 4.0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("overrides, wanted", [
    ({"train.dynamic_shift": True}, "'train.dynamic_shift' = true"),
    ({"data.bucket_step": 15}, "'data.bucket_step' = 15"),
])
def test_config_checks_refuse_what_the_pipeline_does_not_do(overrides, wanted):
    from stages.core.config import load_config
    from stages.core.errors import ConfigError
    from stages.demo import demo_config

    load_config(demo_config("ernie-image"), {"model": "unused"})
    with pytest.raises(ConfigError, match=wanted):
        load_config(demo_config("ernie-image"), {"model": "unused", **overrides})


def test_latent_normalization_and_patchify_as_pipeline(ernie):
    """normalize_latents is what the pipeline's decode inverts: unpatchify(x * sqrt(running_var + 1e-5) +
    running_mean) on the patchified latent; the config's batch_norm_eps (1e-4 here) would differ."""
    family, folder, pipe = ernie
    vae = pipe.vae
    assert vae.config.batch_norm_eps != 1e-5, "the check must tell the two epsilons apart"
    norm = family.latent_normalization(vae)
    z = torch.randn(2, 32, 6, 4, generator=torch.Generator().manual_seed(3))
    x = family.normalize_latents(z, norm)
    p = pipe._patchify_latents(x)
    assert torch.equal(p, patchify(x)) and torch.equal(unpatchify(p), pipe._unpatchify_latents(p))
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    decoded = pipe._unpatchify_latents(p * torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-5) + mean)
    torch.testing.assert_close(decoded, z, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(family.denormalize_latents(x, norm), z, rtol=1e-5, atol=1e-5)
    config_eps = pipe._unpatchify_latents(p * torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-4) + mean)
    assert (config_eps - z).abs().max() > 1e-5
    assert family.pixel_multiple(ModelSource(str(folder))) == pipe.vae_scale_factor


def test_comfyui_names_are_diffusers_own(ernie):
    """ComfyUI's ErnieImage model keeps diffusers' module names: `transformer.<path>` from its table, and
    `diffusion_model.<path>` / `lora_unet_<path with _>` for every model, all on the same weight."""
    family, folder, _ = ernie
    from test_comfyui_export import shapes_of

    config = json.loads((folder / "transformer" / "config.json").read_text())
    kmap = comfyui.key_map(family.comfyui_layout, shapes_of(folder, "ernie-image"), config)
    for name in ("layers.1.self_attention.to_out.0", "layers.0.mlp.gate_proj", "text_proj", "x_embedder.proj",
                 "adaLN_modulation.1", "final_norm.linear", "time_embedding.linear_2"):
        targets = {kmap[f"transformer.{name}"], kmap[f"diffusion_model.{name}"], kmap[f"lora_unet_{name.replace('.', '_')}"]}
        assert len(targets) == 1 and targets.pop().weight == name
    assert comfyui.write_name(family.comfyui_layout, "layers.0.self_attention.to_q", config) == \
        "transformer.layers.0.self_attention.to_q"
    assert not any(k.startswith(("lycoris_", "lora_transformer_")) for k in kmap), "ComfyUI's ErnieImage has no such names"


def test_tiny_config_relations(ernie):
    _, _, pipe = ernie
    t, text = pipe.transformer.config, pipe.text_encoder.config.text_config
    assert t.text_in_dim == text.hidden_size != t.hidden_size, "text_proj exists, as in the real 3072 -> 4096"
    assert t.in_channels == t.out_channels == 4 * pipe.vae.config.latent_channels
    assert sum(t.rope_axes_dim) == t.hidden_size // t.num_attention_heads
    assert text.num_hidden_layers >= 2 and text.model_type == "ministral3"
    assert pipe.transformer.final_linear.weight.abs().sum() > 0, "diffusers' zero init would make every output 0"


def test_nf4_base_with_a_block_swapped_trains_as_diffusers_nf4(ernie, monkeypatch):
    """An nf4 base loaded block by block with one of its two blocks swapped to the host (the planner's
    nf4 + block swap plan) gives the loss and LoRA gradients of diffusers' own nf4 load, bit for bit, under
    gradient checkpointing with the text mask (diffusers' nf4 load runs on CPU with its GPU check lifted)."""
    from diffusers import ErnieImageTransformer2DModel
    from diffusers.quantizers.bitsandbytes.bnb_quantizer import BnB4BitDiffusersQuantizer

    from stages.core import blockswap, nf4_blocks

    family, folder, _ = ernie
    src = ModelSource(str(folder))
    cond = _encode(family, folder, 64)
    g = torch.Generator().manual_seed(2)
    x0, noise, t = torch.randn(2, 32, 8, 8, generator=g), torch.randn(2, 32, 8, 8, generator=g), torch.tensor([0.3, 0.8])

    def with_lora(model):
        torch.manual_seed(0)
        params = lora.attach_lora(model, lora.lora_config(4, 4.0, 0.0, family.default_lora_targets))
        with torch.no_grad():
            for p in params:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        model.enable_gradient_checkpointing()
        return model.train(), params

    def loss_and_grads(model, params):
        loss = family.loss(model, x0, noise, t, cond, _meta(2, 8, 8), TrainConfig())
        loss.mean().backward()
        return loss.detach(), [p.grad.clone() for p in params]

    monkeypatch.setattr(BnB4BitDiffusersQuantizer, "validate_environment", lambda self, *a, **k: None)
    ref = src.load(ErnieImageTransformer2DModel, "transformer", torch_dtype=torch.bfloat16,
                   quantization_config=nf4_blocks.nf4_config(True), device_map={"": "cpu"})
    loss_ref, grads_ref = loss_and_grads(*with_lora(ref))
    model, params = with_lora(nf4_blocks.load_nf4_by_block(ErnieImageTransformer2DModel, src, "transformer",
                                                           torch.device("cpu"), 1, True))
    swap = blockswap.install_block_swap(model, 1, torch.device("cpu"))
    assert swap.blocks == [model.layers[1]]
    loss, grads = loss_and_grads(model, params)
    assert torch.equal(loss, loss_ref) and swap.copies > 0
    for a, b in zip(grads, grads_ref):
        assert torch.equal(a, b)


def test_single_file_checkpoint_loads_as_the_folders_transformer(ernie, tmp_path):
    """A ComfyUI-layout single file (`model.diffusion_model.<diffusers name>`, what diffusers' ERNIE-Image
    converter reads) with `base` naming the pipeline folder loads the same transformer."""
    from safetensors.torch import save_file

    family, folder, pipe = ernie
    file = tmp_path / "ernie-finetune.safetensors"
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in pipe.transformer.state_dict().items()}, str(file))
    model = family.load_denoiser(ModelSource(str(file), base=str(folder)), "fp32", CPU, TrainConfig())
    want = pipe.transformer.state_dict()
    assert model.state_dict().keys() == want.keys()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
