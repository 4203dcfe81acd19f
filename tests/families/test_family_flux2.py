"""FLUX.2 [dev] against its own diffusers pipeline (Flux2Pipeline), on the tiny real architecture.

    .venv/bin/python -m pytest tests/families/test_family_flux2.py -q

- caption encoding equals the pipeline's `encode_prompt` (system message, chat template through the
  pipeline's processor, layers 10/20/30, padding kept, truncation, "[IMG]" removed) and its text ids,
  and so do the rows encode-captions cached in captions.zarr, as the trainer reads them;
- latent normalization equals the dev pipeline's `_encode_vae_image` and its decode;
- one training loss equals what the pipeline's own denoising step implies, guidance embedding
  included (train.guidance_scale is the pipeline's guidance_scale);
- `train.dynamic_shift` sigmas are the scheduler's, shifted by the dev pipeline's `compute_empirical_mu`;
- the config checks and the nf4 refusal on CPU.
The image side is shared with klein (stages.families.common.flux2_dit); tests/families/test_family_flux2_klein.py
checks packing and image ids against the pipeline helpers, which both pipelines share.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

import flux2_checks
from conftest import FAMILIES, ROOT, tiny_model
from stages.core.config import CaptionsConfig, TrainConfig, load_config
from stages.core.errors import ConfigError, UserError
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import config_errors, get_family
from stages.families.base import BatchMeta

NAME = "flux2"
# the second caption is long enough to be cut at 40 tokens, and holds "[IMG]", which the pipeline removes
CAPTIONS = ["a red circle", "a large blue square [IMG] on a white background at the top left corner of the picture"]
CPU = make_runtime("cpu", "fp32")


@pytest.fixture(scope="module")
def dev(assets):
    """(family, model folder, pipeline loaded by its real class)."""
    folder = tiny_model(assets, FAMILIES[NAME])
    pipe = Flux2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return get_family(NAME), folder, pipe


def _encoder(family, folder, max_len: int, precision: str = "auto"):
    cfg = CaptionsConfig(max_sequence_length=max_len, text_encoder_precision=precision)
    return family.load_text_encoder(ModelSource(str(folder)), cfg, CPU)


@pytest.mark.parametrize("max_len", [64, 40])  # 40 cuts the long caption (the system message is ~32 tokens)
def test_text_encoding_matches_pipeline(dev, max_len):
    family, folder, pipe = dev
    encoder = _encoder(family, folder, max_len)
    ours = encoder.encode(CAPTIONS)["prompt_embeds"]
    expected, text_ids = pipe.encode_prompt(list(CAPTIONS), device="cpu", max_sequence_length=max_len)
    assert ours.shape == (2, max_len, 3 * pipe.text_encoder.config.text_config.hidden_size)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(family.position_ids("text", 1, max_len, torch.device("cpu")), text_ids[0])
    counts = encoder.token_counts(CAPTIONS)
    assert counts[0] < 40 < counts[1] and max(counts) < 64, counts  # so one length cuts and one does not
    # the layers are the pipeline's: hidden states 10, 20, 30 of Mistral, not the last one
    last = pipe.encode_prompt(list(CAPTIONS), device="cpu", max_sequence_length=max_len,
                              text_encoder_out_layers=(10, 20, 31))[0]
    assert (last - ours).abs().max() > 1e-3


def test_token_counts_are_the_untruncated_templated_length(dev):
    family, folder, pipe = dev
    counts = _encoder(family, folder, 40).token_counts(CAPTIONS)
    processor = pipe.tokenizer  # the pipeline's processor: system message + caption, as encode_prompt tokenizes
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    ids = processor.apply_chat_template(format_input(list(CAPTIONS), pipe.system_message), tokenize=True,
                                        return_dict=True, add_generation_prompt=False, padding=True)
    assert counts == [int(m.sum()) for m in torch.as_tensor(ids["attention_mask"])]


def test_latent_normalization_as_pipeline(dev):
    flux2_checks.latent_normalization_as_pipeline(*dev)


def _pipeline_velocity(pipe, latents: torch.Tensor, sigma: float, guidance: float) -> torch.Tensor:
    """The velocity the pipeline steps with at `latents` (normalized, unpatchified) and `guidance`,
    from one Euler step to sigma = 0: out = latents - sigma * v. Shift 1 so sigma is as asked."""
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    _, _, h, w = latents.shape
    patched = pipe._patchify_latents(latents)
    out = pipe(prompt=list(CAPTIONS), height=h * pipe.vae_scale_factor, width=w * pipe.vae_scale_factor,
               num_inference_steps=1, sigmas=[sigma], latents=patched, max_sequence_length=64,
               guidance_scale=guidance, output_type="latent").images  # the packed tokens, still normalized
    out = pipe._unpatchify_latents(pipe._unpack_latents_with_ids(out, pipe._prepare_latent_ids(patched)))
    return (latents - out) / sigma


def test_training_loss_matches_pipeline_step_with_its_guidance(dev):
    family, folder, pipe = dev
    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(2, 32, 8, 8, generator=g), torch.randn(2, 32, 8, 8, generator=g)
    sigma = 0.6
    x0 = (latents - sigma * noise) / (1 - sigma)  # so that (1 - sigma) x0 + sigma noise = latents
    size = torch.tensor([[16, 16]] * 2)
    meta = BatchMeta(original_size=size, crop_top_left=torch.zeros(2, 2, dtype=torch.long), target_size=size)
    with torch.no_grad():
        cond = _encoder(family, folder, 64).encode(CAPTIONS)
        for guidance in (1.0, 4.0):
            velocity = _pipeline_velocity(pipe, latents, sigma, guidance)
            ours = family.loss(pipe.transformer, x0, noise, torch.full((2,), sigma), cond, meta,
                               TrainConfig(guidance_scale=guidance))
            expected = ((velocity - (noise - x0)) ** 2).flatten(1).mean(1)
            torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
        other = family.loss(pipe.transformer, x0, noise, torch.full((2,), sigma), cond, meta, TrainConfig(guidance_scale=1.0))
    assert (other - ours).abs().min() > 1e-4, "the guidance value must reach the transformer"
    wrong_sign = ((-velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    assert (wrong_sign - expected).abs().min() > 1e-3, "the check must tell the output's sign apart"


def test_dynamic_shift_is_the_pipeline_schedule(dev):
    family, folder, _ = dev
    flux2_checks.dynamic_shift_is_the_pipeline_schedule(family, folder, compute_empirical_mu)


def test_config_checks_and_nf4_refused_on_cpu(dev):
    family, folder, _ = dev
    with pytest.raises(ConfigError) as err:  # loading runs the family's checks, all errors at once
        load_config(ROOT / "configs" / "flux2.toml", {"captions.max_sequence_length": 513, "data.bucket_step": 33})
    assert "'captions.max_sequence_length' = 513" in str(err.value) and "512" in str(err.value)
    assert "'data.bucket_step' = 33" in str(err.value)
    preset = load_config(ROOT / "configs" / "flux2.toml")
    assert config_errors(preset) == []
    assert preset.captions.text_encoder_precision == "nf4" and preset.train.base_precision == "auto"
    with pytest.raises(UserError, match="text_encoder_precision = 'nf4' needs a CUDA GPU"):
        _encoder(family, folder, 64, precision="nf4")


@pytest.mark.parametrize("built_run", [NAME], indirect=True)
def test_cached_rows_are_the_pipelines_encode_prompt(built_run, dev):
    """The rows encode-captions stored in captions.zarr, as the trainer reads them, equal the
    pipeline's own encode_prompt of each item's caption."""
    from stages.core import dataset
    from stages.core.events import EventLog
    from stages.train.trainer import Trainer

    _, _, pipe = dev
    cfg = built_run
    trainer = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
    items = {it.key: it for it in dataset.scan(cfg.data.path)}
    pairs = trainer.data.pairs
    indices = [i for i, p in enumerate(pairs) if p.bucket == pairs[0].bucket]  # a batch is one bucket
    batch = trainer.data.load(indices, [0] * len(indices))
    captions = [items[pairs[i].key].caption for i in indices]
    assert len(set(captions)) == len(captions) > 1
    expected, _ = pipe.encode_prompt(captions, device="cpu", max_sequence_length=cfg.captions.max_sequence_length)
    torch.testing.assert_close(batch.cond["prompt_embeds"].float(), expected, rtol=1e-5, atol=1e-5)


def test_legacy_processor_chat_template_file_is_read(dev, tmp_path):
    """A tokenizer/ folder whose chat template is only in a processor's legacy chat_template.json
    (transformers before chat_template.jinja) encodes the same rows."""
    import json
    import shutil

    family, folder, pipe = dev
    copy = tmp_path / "flux2"
    shutil.copytree(folder, copy)
    template = (copy / "tokenizer" / "chat_template.jinja").read_text()
    (copy / "tokenizer" / "chat_template.jinja").unlink()
    (copy / "tokenizer" / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    rows = _encoder(family, copy, 40).encode(CAPTIONS)["prompt_embeds"]
    torch.testing.assert_close(rows, pipe.encode_prompt(list(CAPTIONS), device="cpu", max_sequence_length=40)[0],
                               rtol=1e-5, atol=1e-5)


def test_a_length_the_system_message_fills_is_refused_and_truncation_names_the_template(assets, demo_data, tmp_path):
    """FLUX.2 dev's prompt template (BFL's 30-word system message) comes before the caption and counts
    against captions.max_sequence_length, as in the pipeline. Where it leaves no room, encode-captions
    refuses before writing a row; a truncation warning says how many of the tokens are the template's."""
    import json
    import shutil

    from conftest import make_cfg
    from stages import encode_captions

    family = get_family(NAME)
    encoder = family.load_text_encoder(ModelSource(str(tiny_model(assets, FAMILIES[NAME]))), CaptionsConfig(),
                                       make_runtime("cpu", "fp32"))
    template = encoder.token_counts([""])[0]
    assert template > 2
    cfg = make_cfg(NAME, assets, demo_data, tmp_path / "a", **{"captions.max_sequence_length": template})
    with pytest.raises(ConfigError, match=rf"captions.max_sequence_length = {template} leaves no token for the "
                                          rf"captions: flux2's prompt template alone takes {template}; raise it"):
        encode_captions.run(cfg)
    assert not (cfg.run_dir / "captions.zarr").exists()
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    first = sorted(data.glob("*.txt"))[0]
    first.write_text("a large blue square at the top left " * 4)
    cfg = make_cfg(NAME, assets, data, tmp_path / "b", **{"captions.max_sequence_length": template + 8})
    encode_captions.run(cfg)
    warnings = [e["message"] for e in map(json.loads, (cfg.run_dir / "events.jsonl").read_text().splitlines())
                if e["event"] == "warning"]
    assert any(m.startswith(f"caption of '{first.with_suffix('.png').name}' has ")
               and f"tokens with the prompt template ({template} of them); truncated to {template + 8}" in m
               for m in warnings), warnings
