"""Qwen-Image and Z-Image against their own diffusers pipelines, on the tiny real architectures.

    .venv/bin/python -m pytest tests/families/test_families_text.py -q

- caption encoding equals the pipeline's `encode_prompt` (template, dropped tokens, hidden layer,
  truncation), stored padded with lengths;
- one training loss equals what the pipeline's own denoising step implies (timestep convention,
  sign of the output, packing, text mask), for a batch of two captions of different lengths;
- a padded batch trains like its items one by one: equal losses and equal LoRA gradients;
- latent normalization and bucket multiples as the pipelines compute them.
"""

from __future__ import annotations

import dataclasses

import diffusers
import pytest
import torch

from conftest import FAMILIES, tiny_model
from stages.core import flow, lora
from stages.core.config import CaptionsConfig, ConfigError, TrainConfig
from stages.core.errors import ArtifactError, UserError
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family, pipeline_class
from stages.families.base import BatchMeta

# The families whose captions are variable-length decoder states (stages.families.text_encoders) -> tiny variant
VARIANTS = {name: FAMILIES[name] for name in ("qwen-image", "z-image")}
CAPTIONS = ["a red circle", "a large blue square on a white background at the top left corner of the picture"]
CPU = make_runtime("cpu", "fp32")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def fam(request, assets):
    """(family, model folder, pipeline loaded by its real class)."""
    family = get_family(request.param)
    folder = tiny_model(assets, VARIANTS[request.param])
    return family, folder, pipeline_class(family).from_pretrained(folder)


def _encoder(family, folder, max_len: int):
    return family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=max_len), CPU)


def _pipeline_rows(family, pipe, texts: list[str], max_len: int) -> list[torch.Tensor]:
    """Per-caption text states, without padding, as the pipeline hands them to its transformer."""
    if family.name == "z-image":
        return pipe.encode_prompt(texts, device="cpu", do_classifier_free_guidance=False, max_sequence_length=max_len)[0]
    embeds, mask = pipe.encode_prompt(texts, device="cpu", max_sequence_length=max_len)
    return [e if mask is None else e[m.bool()] for e, m in zip(embeds, mask)]


@pytest.mark.parametrize("max_len", [64, 12])  # 12 cuts the long caption: truncation must match too
def test_text_encoding_matches_pipeline(fam, max_len):
    family, folder, pipe = fam
    ours = _encoder(family, folder, max_len).encode(CAPTIONS)
    rows = _pipeline_rows(family, pipe, list(CAPTIONS), max_len)
    assert ours["prompt_embeds"].shape[1] == max_len, "rows are stored padded to max_sequence_length"
    assert ours["prompt_length"].tolist() == [len(r) for r in rows]
    for i, row in enumerate(rows):
        n = len(row)
        torch.testing.assert_close(ours["prompt_embeds"][i, :n], row, rtol=1e-5, atol=1e-5)
        assert not ours["prompt_embeds"][i, n:].any(), "padding must be zeros"
    if max_len == 64:
        assert len(rows[0]) < len(rows[1]) < max_len, "the two captions must differ in length and fit"
    else:
        assert len(rows[1]) == max_len


def test_the_encoders_read_a_batch_at_its_longest_caption_where_the_family_says_so(fam):
    """family.text_padded_to_longest (which the memory planner's tests read) says what the encoder does: the text
    model reads a batch of short captions at a shorter length than a batch with a long one (Qwen-Image pads to the
    longest), or both at captions.max_sequence_length (Z-Image pads to it)."""
    family, folder, _ = fam
    encoder = _encoder(family, folder, 64)
    models = [m for m in vars(encoder).values() if isinstance(m, torch.nn.Module)]
    assert models, "the encoder holds its text model"
    lengths: list[int] = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        ids = kwargs.get("inputs_embeds") if ids is None else ids
        lengths.append(ids.shape[1])

    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in models]
    try:
        encoder.encode(CAPTIONS[:1])
        short = lengths[-1]
        encoder.encode(CAPTIONS)
        both = lengths[-1]
    finally:
        for h in hooks:
            h.remove()
    assert (short < both) == family.text_padded_to_longest, (family.name, short, both)


def test_token_counts_report_untruncated_length(fam):
    family, folder, pipe = fam
    encoder = _encoder(family, folder, 12)
    full = [len(r) for r in _pipeline_rows(family, pipe, list(CAPTIONS), 1024 if family.name == "qwen-image" else 512)]
    assert encoder.token_counts(CAPTIONS) == full
    assert full[1] > 12, "the long caption must need more than 12 tokens for this test"


def _meta(b: int, h: int, w: int) -> BatchMeta:
    size = torch.tensor([[h * 2, w * 2]] * b)
    return BatchMeta(original_size=size, crop_top_left=torch.zeros(b, 2, dtype=torch.long), target_size=size)


def _pipeline_velocity(family, pipe, latents: torch.Tensor, sigma: float) -> tuple[torch.Tensor, float]:
    """The velocity the pipeline steps with at `latents`, from one Euler step to sigma = 0:
    out = latents - sigma * v. The scheduler gets shift 1 so sigma is what we asked for."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    b, _, h, w = latents.shape
    size = dict(height=h * pipe.vae_scale_factor, width=w * pipe.vae_scale_factor)
    if family.name == "z-image":
        out = pipe(list(CAPTIONS), **size, num_inference_steps=1, sigmas=[sigma], guidance_scale=0.0,
                   latents=latents.clone(), output_type="latent").images
    else:
        out = pipe(list(CAPTIONS), **size, num_inference_steps=1, sigmas=[sigma], latents=flow.pack_2x2(latents),
                   output_type="latent").images
        out = flow.unpack_2x2(out, h, w)
    applied = float(pipe.scheduler.sigmas[0])
    return (latents - out) / applied, applied


def test_training_loss_matches_pipeline_step(fam):
    """Our loss at (x0, noise, sigma) equals the MSE between the velocity the pipeline itself
    steps with at x_t and noise - x0: same timestep value, output sign, packing and text mask."""
    family, folder, pipe = fam
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 8, 8, generator=g)
    with torch.no_grad():
        velocity, sigma = _pipeline_velocity(family, pipe, latents, 0.6)
        noise = torch.randn(latents.shape, generator=g)
        x0 = (latents - sigma * noise) / (1 - sigma)  # so that (1 - sigma) x0 + sigma noise = latents
        cond = _encoder(family, folder, 64).encode(CAPTIONS)
        assert cond["prompt_length"][0] != cond["prompt_length"][1]
        ours = family.loss(pipe.transformer, x0, noise, torch.full((2,), sigma), cond, _meta(2, 8, 8), TrainConfig())
    expected = ((velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    wrong_sign = ((-velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    assert (wrong_sign - expected).abs().min() > 1e-3, "the check must tell the output's sign apart"


def _lora_model(family, folder):
    model = family.load_denoiser(ModelSource(str(folder)), "fp32", CPU, TrainConfig())
    torch.manual_seed(0)  # peft draws lora_A from the global generator: the same adapter whatever ran before
    params = lora.attach_lora(model, lora.lora_config(4, 8, 0.0, family.default_lora_targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero up-projections, so both LoRA matrices get gradients
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model, params


def loss_and_grads(family, model, params, x0, noise, t, cond, meta):
    """One training loss per item and the LoRA parameters' gradients of its mean."""
    model.zero_grad(set_to_none=True)
    loss = family.loss(model, x0, noise, t, cond, meta, TrainConfig())
    loss.mean().backward()
    return loss.detach(), [p.grad.clone() for p in params]


def checkpointing_changes_nothing(family, model, params, *batch):
    """The loss and LoRA gradients with the model's gradient checkpointing on (as the trainer turns it on) equal
    those without it; returns the plain ones. Leaves checkpointing on."""
    plain_loss, plain_grads = loss_and_grads(family, model, params, *batch)
    model.enable_gradient_checkpointing()
    ckpt_loss, ckpt_grads = loss_and_grads(family, model, params, *batch)
    torch.testing.assert_close(ckpt_loss, plain_loss, rtol=1e-6, atol=1e-7)
    for a, b in zip(ckpt_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    assert any(grad.abs().max() > 0 for grad in plain_grads)
    return plain_loss, plain_grads


def padded_batch_trains_like_single_items(family, model, params, cond, channels: int, checkpointing=(False,)):
    """A batch of two captions of different lengths gives each item the loss and LoRA gradients it has alone
    (for each gradient-checkpointing setting in `checkpointing`); reading the short caption's padding as tokens
    would not."""
    lengths = cond["prompt_length"].tolist()
    assert lengths[0] < lengths[1] < cond["prompt_embeds"].shape[1], "the batch must hold captions of different token lengths"
    g = torch.Generator().manual_seed(2)
    x0, noise = torch.randn(2, channels, 8, 8, generator=g), torch.randn(2, channels, 8, 8, generator=g)
    t = torch.tensor([0.3, 0.8])

    def rows_loss(rows: list[int], c: dict[str, torch.Tensor], multiple: int = 1):
        meta = dataclasses.replace(_meta(len(rows), 8, 8), text_multiple=multiple)
        return loss_and_grads(family, model, params, x0[rows], noise[rows], t[rows], {k: v[rows] for k, v in c.items()}, meta)

    for on in checkpointing:
        if on:  # the stock forward hands its mask to checkpointed blocks too
            model.enable_gradient_checkpointing()
        batch_losses, batch_grads = rows_loss([0, 1], cond)
        singles = [rows_loss([i], cond) for i in range(2)]
        torch.testing.assert_close(batch_losses, torch.cat([s[0] for s in singles]), rtol=1e-5, atol=1e-6)
        for j, grad in enumerate(batch_grads):
            torch.testing.assert_close(grad, (singles[0][1][j] + singles[1][1][j]) / 2, rtol=1e-4, atol=1e-7)
        # captions rounded up to a multiple of tokens (runtime.caption_tokens_multiple): the masked padding
        # up to the stored length changes no item's loss or gradients either
        for i, (single_loss, single_grads) in enumerate(singles):
            padded_loss, padded_grads = rows_loss([i], cond, multiple=cond["prompt_embeds"].shape[1])
            torch.testing.assert_close(padded_loss, single_loss, rtol=1e-5, atol=1e-6)
            for a, b in zip(padded_grads, single_grads):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
        # captions rounded up to a multiple of tokens (runtime.caption_tokens_multiple): the masked padding
        # up to the stored length changes no item's loss or gradients either
        for i, (single_loss, single_grads) in enumerate(singles):
            padded_loss, padded_grads = rows_loss([i], cond, multiple=cond["prompt_embeds"].shape[1])
            torch.testing.assert_close(padded_loss, single_loss, rtol=1e-5, atol=1e-6)
            for a, b in zip(padded_grads, single_grads):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    # Not vacuous: had the short caption's padding been read as tokens, its loss would differ.
    unmasked = {**cond, "prompt_length": torch.tensor([lengths[1], lengths[1]])}
    attended, _ = rows_loss([0], unmasked)
    assert (attended - singles[0][0]).abs().item() > 1e-4


def test_padded_batch_trains_like_single_items(fam):
    family, folder, _ = fam
    model, params = _lora_model(family, folder)
    padded_batch_trains_like_single_items(family, model, params, _encoder(family, folder, 64).encode(CAPTIONS), 16)


def test_latent_normalization_as_pipeline_decodes(fam):
    family, folder, pipe = fam
    vae = pipe.vae
    norm = family.latent_normalization(vae)
    z = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(3))
    x = family.normalize_latents(z, norm)
    if family.name == "qwen-image":  # pipeline: latents / (1 / latents_std) + latents_mean, per channel
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1)
        decoded = x / (1.0 / std) + torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1)
    else:  # pipeline: latents / scaling_factor + shift_factor
        decoded = x / vae.config.scaling_factor + vae.config.shift_factor
    torch.testing.assert_close(decoded, z, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(family.denormalize_latents(x, norm), z, rtol=1e-5, atol=1e-5)
    assert family.pixel_multiple(ModelSource(str(folder))) == pipe.vae_scale_factor * 2


def test_qwen_vae_posterior_is_one_frame():
    family = get_family("qwen-image")
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                                 temperal_downsample=[False], latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()
    pixels = torch.rand(2, 3, 16, 16) * 2 - 1
    mean, logvar = family.encode_posterior(vae, pixels)
    with torch.no_grad():
        ref = vae.encode(pixels.unsqueeze(2)).latent_dist
    assert mean.shape == (2, 4, 8, 8)
    torch.testing.assert_close(mean, ref.mean[:, :, 0])
    torch.testing.assert_close(logvar, ref.logvar[:, :, 0])


def test_qwen_dynamic_shift_uses_qwen_scheduler_range():
    """dynamic_shift samples sigmas shifted as Qwen-Image's scheduler shifts them (exponential
    time shift, mu from 256..8192 tokens over 0.5..0.9), not with FLUX's range."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    family = get_family("qwen-image")
    tcfg = TrainConfig(dynamic_shift=True, timestep_density="uniform")
    ours = family.sample_timesteps(64, (128, 128), torch.Generator().manual_seed(4), tcfg)
    u = flow.sample_density(64, torch.Generator().manual_seed(4), "uniform")
    base = flow.lookup_sigmas(u, flow.sigma_table(1.0))
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, time_shift_type="exponential")
    expected = sched.time_shift(calculate_shift(64 * 64, 256, 8192, 0.5, 0.9), 1.0, base)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_nf4_text_encoder_refused_on_cpu(name, assets):
    family = get_family(name)
    cfg = CaptionsConfig(max_sequence_length=32, text_encoder_precision="nf4")
    with pytest.raises(UserError, match="text_encoder_precision = 'nf4' needs a CUDA GPU"):
        family.load_text_encoder(ModelSource(str(tiny_model(assets, VARIANTS[name]))), cfg, CPU)


def test_qwen_max_sequence_length_above_pipeline_limit_refused(assets):
    cfg = CaptionsConfig(max_sequence_length=2048)
    with pytest.raises(ConfigError, match="captions.max_sequence_length = 2048"):
        get_family("qwen-image").load_text_encoder(ModelSource(str(tiny_model(assets, "qwen-image"))), cfg, CPU)


def test_zero_token_caption_rows_are_an_artifact_error():
    """A cached caption of 0 tokens can only be a damaged captions.zarr row: the message says how to rebuild."""
    from stages.families.text_encoders import require_tokens, trim_to_longest

    with pytest.raises(ArtifactError, match=r"`lorapipe encode-captions .+ --force`"):
        require_tokens([5, 0])
    with pytest.raises(ArtifactError, match="0 tokens in captions.zarr"):
        trim_to_longest(torch.zeros(2, 4, 3), torch.tensor([0, 0]))
    embeds, mask = trim_to_longest(torch.ones(2, 4, 3), torch.tensor([1, 3]))
    assert embeds.shape == (2, 3, 3) and mask.tolist() == [[True, False, False], [True, True, True]]


def test_caption_tokens_multiple_rounds_the_cut_up_and_masks_the_padding():
    from stages.families.text_encoders import trim_to_longest

    embeds, mask = trim_to_longest(torch.ones(2, 10, 3), torch.tensor([1, 5]), multiple=4)
    assert embeds.shape == (2, 8, 3) and mask.sum(1).tolist() == [1, 5] and not mask[:, 5:].any()
    embeds, mask = trim_to_longest(torch.ones(2, 10, 3), torch.tensor([1, 8]), multiple=4)
    assert embeds.shape == (2, 8, 3), "a length already at a multiple is kept"
    embeds, mask = trim_to_longest(torch.ones(2, 10, 3), torch.tensor([1, 9]), multiple=64)
    assert embeds.shape == (2, 10, 3), "never past the stored rows"


def test_z_image_tokenizer_without_chat_template_is_a_model_error(assets, tmp_path):
    import shutil

    from stages.core.model_source import ModelError

    folder = tmp_path / "z-image"
    shutil.copytree(tiny_model(assets, FAMILIES["z-image"]), folder)
    for extra in (folder / "tokenizer").glob("chat_template*"):
        extra.unlink()
    config = folder / "tokenizer" / "tokenizer_config.json"
    import json

    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    with pytest.raises(ModelError, match="has no chat template"):
        get_family("z-image").load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=32), CPU)


def test_encode_captions_batches_by_the_longest_caption_to_encode(fam, assets, demo_data, tmp_path):
    """Under a cap, encode-captions plans for the longest caption captions.max_sequence_length allows; where the
    family's encoders read a batch at its longest caption (Qwen-Image) and the captions to encode are shorter, it
    encodes in the larger batch that fits them, and says so. Z-Image pads to the length: its batch stays."""
    from conftest import make_cfg
    from stages import encode_captions
    from stages.core.memory import Budget, StagePlan, calibration as cal, captions as plan_captions
    from stages.core.memory.sizes import meta_component, module_components

    family, folder, _ = fam
    cfg = make_cfg(family.name, assets, demo_data, tmp_path, **{"model": str(folder), "captions.max_sequence_length": 64,
                                                                 "captions.batch_size": 4})
    src = ModelSource(str(folder))
    models = {c: meta_component(src, c) for c in module_components(src, family.text_components)}
    weights = plan_captions._weights(family, models, "bf16")
    longest = max(_encoder(family, folder, 64).token_counts(CAPTIONS))

    def peak(batch: int, tokens: int) -> float:
        work = max(plan_captions.encode_work(m, batch, tokens, family.text_keeps_hidden_states) for m in models.values())
        return (weights + work) / cal.GB * cal.FRAGMENTATION

    planned_tokens, real = 64 + family.text_tokens_beyond_max, max(longest + family.text_tokens_beyond_max, 77)
    assert peak(4, real) < peak(4, planned_tokens)
    budget = Budget((peak(4, real) + peak(4, planned_tokens)) / 2, "cap")
    tried = [{"text_encoder_precision": "bf16", "batch_size": b, "predicted_peak_gb": peak(b, planned_tokens)} for b in (4, 2, 1)]
    plan = StagePlan("encode-captions", budget, {"text_encoder_precision": "bf16", "batch_size": 2}, peak(2, planned_tokens),
                     True, tried=tried)
    said, plans = [], []
    log = type("Log", (), {"emit": lambda self, event, **f: (plans if event == "plan" else said).append(f)})()
    ctx = type("Ctx", (), {"log": log})()
    planned = dataclasses.replace(cfg, captions=dataclasses.replace(cfg.captions, batch_size=2))
    encoder = lambda: _encoder(family, folder, 64)  # noqa: E731
    counted = encode_captions._token_counts(family, plan, encoder, dict(enumerate(CAPTIONS)))
    assert bool(counted) == family.text_padded_to_longest and (not counted or max(counted.values()) == longest)
    size = encode_captions._batch_size(ctx, planned, family, plan, max(counted.values(), default=0))
    if family.text_padded_to_longest:
        assert size == 4 and any(f"longest caption to encode has {longest} tokens" in f["message"] for f in said)
        assert [p["settings"]["batch_size"] for p in plans] == [4]  # the plan it encodes with, logged (bench rows read it)
        assert plans[0]["predicted_peak_gb"] < budget.gb
    else:
        assert size == 2 and not said and not plans
    cpu = dataclasses.replace(plan, budget=Budget(None, "cpu"))
    assert encode_captions._batch_size(ctx, planned, family, cpu, longest) == 2
