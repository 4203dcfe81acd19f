"""Tiny offline pipelines (stages.tiny): build, save, reload with the real classes, generate."""

from __future__ import annotations

import contextlib
import inspect
import importlib
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from conftest import tiny_model

from stages.tiny import (
    PIPELINE_CLASS_NAMES,
    TINY_DIMS,
    VARIANTS,
    build_clip_tokenizer,
    build_qwen_tokenizer,
    build_t5_tokenizer,
    build_tiny_components,
    make_demo_dataset,
)
from stages.tiny.tokenizers import QWEN_IMAGE_DROP_IDX, QWEN_IMAGE_PROMPT_TEMPLATE

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

PROMPT = "a red circle on a white background"


@pytest.fixture(scope="module")
def built(assets):
    """variant -> folder of the saved tiny pipeline (conftest.tiny_model: build_tiny_pipeline, shared
    with the other test files of this process)."""
    return {v: tiny_model(assets, v) for v in VARIANTS}


@pytest.fixture(scope="module")
def loaded(built):
    """variant -> pipeline reloaded with the real diffusers class from its folder."""
    out = {}
    for v, folder in built.items():
        pipe = getattr(diffusers, PIPELINE_CLASS_NAMES[v]).from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)
        out[v] = pipe
    return out


def test_api():
    assert set(VARIANTS) == set(PIPELINE_CLASS_NAMES) == set(TINY_DIMS)
    for name in PIPELINE_CLASS_NAMES.values():
        assert hasattr(diffusers, name)
    with pytest.raises(ValueError):
        build_tiny_components("sd3")


@pytest.mark.parametrize("variant", VARIANTS)
def test_generate_64(variant, loaded):
    pipe = loaded[variant]
    assert type(pipe).__name__ == PIPELINE_CLASS_NAMES[variant]
    spatial = next((getattr(pipe, a) for a in ("vae_scale_factor", "vae_scale_factor_spatial", "vae_spatial_compression_ratio")
                    if hasattr(pipe, a)), None)  # a video pipeline's spatial factor (Wan's, LTX-2's name)
    assert spatial == TINY_DIMS[variant]["vae_scale_factor"]
    kwargs = {"guidance_scale": 3.5} if variant == "flux-dev" else {}
    if variant == "ideogram4":  # a guidance_scale or a schedule as long as the steps (the default has 48)
        kwargs = {"guidance_scale": 3.5, "guidance_schedule": None, "max_sequence_length": 64}
    if "num_frames" in inspect.signature(pipe.__call__).parameters:  # a video pipeline: a short clip
        kwargs["num_frames"] = 5
    if variant.startswith("flux-kontext"):  # text only; FluxKontextPipeline rescales to max_area (1024 x 1024) otherwise
        kwargs["max_area"] = 64 * 64
    context = contextlib.nullcontext()
    if variant.startswith("qwen-image-edit"):  # an edit pipeline needs an image: a control sized for a 64 px output
        from PIL import Image

        from stages.families import get_family

        family = get_family("qwen-image-edit")
        # not constant: the demo model ("qwen-image-edit-edit") reproduces its control
        control = Image.linear_gradient("L").resize((64, 64)).convert("RGB")
        kwargs.update(family.sample_image_kwargs([control], (64, 64)))
        context = family.sample_context((64, 64))
    if variant == "hidream-i1":  # HiDreamImagePipeline renders 1024 x 1024's area (the tiny: 256 x 256) otherwise
        from stages.families import get_family

        context = get_family("hidream-i1").sample_context((64, 64))
    with context:
        out = pipe(
            prompt=PROMPT,  # by name: Flux2KleinPipeline's first argument is `image`
            height=64,
            width=64,
            num_inference_steps=2,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
            **kwargs,
        )
    images = out.frames[:, 0] if hasattr(out, "frames") else out.images  # a video pipeline: its first frame
    assert images.shape == (1, 64, 64, TINY_DIMS[variant].get("image_channels", 3))
    assert np.isfinite(images).all()
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert images.std() > 0  # not a constant image


def test_generate_non_square_and_batch(loaded):
    pipe = loaded["flux-schnell"]
    out = pipe([PROMPT, "a blue square"], height=32, width=48, num_inference_steps=1, output_type="np",
               max_sequence_length=32)
    assert out.images.shape == (2, 32, 48, 3)
    assert np.isfinite(out.images).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_components_load_by_subfolder(variant, built):
    folder = built[variant]
    index = json.loads((folder / "model_index.json").read_text())
    seen = set()
    for name, spec in index.items():
        # [library, class] pairs only: Krea2Pipeline also saves a config list (text_encoder_select_layers)
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None or not isinstance(spec[-1], str):
            continue
        library, class_name = spec
        # a stand-in class of our own (qwen-image-edit's processor) is named by its module
        # a diffusers pipeline module's own class (LTX-2's connectors and vocoder: library "ltx2")
        module = ({"diffusers": diffusers, "transformers": transformers}.get(library)
                  or getattr(diffusers.pipelines, library, None) or importlib.import_module(library))
        cls = getattr(module, class_name)
        obj = cls.from_pretrained(folder, subfolder=name)
        assert obj is not None
        seen.add(name)
    assert {"vae", "text_encoder", "scheduler"} <= seen and seen & {"tokenizer", "processor"}
    assert ("unet" if variant == "sdxl" else "transformer") in seen


def test_flux_config_relations(loaded):
    for variant in ("flux-dev", "flux-schnell"):
        pipe = loaded[variant]
        t, vae = pipe.transformer.config, pipe.vae.config
        assert sum(t.axes_dims_rope) == t.attention_head_dim
        assert t.joint_attention_dim == pipe.text_encoder_2.config.d_model
        assert t.pooled_projection_dim == pipe.text_encoder.config.hidden_size
        assert t.in_channels == 4 * vae.latent_channels
        assert t.num_layers >= 1 and t.num_single_layers >= 1
        assert not vae.use_quant_conv and not vae.use_post_quant_conv
        assert vae.shift_factor == pytest.approx(0.1159) and vae.scaling_factor == pytest.approx(0.3611)
        assert pipe.tokenizer.model_max_length == 77
        assert t.guidance_embeds is (variant == "flux-dev")
    s = loaded["flux-dev"].scheduler.config
    assert type(loaded["flux-dev"].scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert (s.shift, s.use_dynamic_shifting, s.base_shift, s.max_shift) == (3.0, True, 0.5, 1.15)
    assert (s.base_image_seq_len, s.max_image_seq_len) == (256, 4096)


def test_other_config_relations(loaded):
    q = loaded["qwen-image"]
    cfg = q.text_encoder.config
    tok = q.tokenizer
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert q.transformer.config.joint_attention_dim == cfg.text_config.hidden_size
    assert len(q.vae.config.latents_mean) == len(q.vae.config.latents_std) == q.vae.config.z_dim
    assert q.transformer.config.in_channels == 4 * q.vae.config.z_dim

    z = loaded["z-image"]
    assert z.transformer.config.cap_feat_dim == z.text_encoder.config.hidden_size
    assert z.vae.config.shift_factor is not None and z.vae.config.scaling_factor is not None

    x = loaded["sdxl"]
    u = x.unet.config
    assert u.projection_class_embeddings_input_dim == 6 * u.addition_time_embed_dim + (
        x.text_encoder_2.config.projection_dim
    )
    assert u.cross_attention_dim == x.text_encoder.config.hidden_size + x.text_encoder_2.config.hidden_size
    assert x.vae.config.latent_channels == 4
    s = x.scheduler.config
    assert (s.beta_schedule, s.beta_start, s.beta_end) == ("scaled_linear", 0.00085, 0.012)
    assert (s.num_train_timesteps, s.prediction_type) == (1000, "epsilon")


def test_qwen_image_template_prefix_is_34_tokens(loaded):
    tok = loaded["qwen-image"].tokenizer
    ids = tok(QWEN_IMAGE_PROMPT_TEMPLATE.format(PROMPT)).input_ids
    prefix = tok.convert_ids_to_tokens(ids[:QWEN_IMAGE_DROP_IDX])
    assert prefix[0] == "<|im_start|>" and prefix[-2:] == ["user", "\u010a"]  # "\n" in byte-level
    assert tok.decode(ids[QWEN_IMAGE_DROP_IDX:]).startswith(PROMPT)
    embeds, mask = loaded["qwen-image"].encode_prompt(PROMPT)
    # prompt tokens + "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n"
    assert embeds.shape[1] == len(ids) - QWEN_IMAGE_DROP_IDX


def test_z_image_chat_template(loaded):
    tok = loaded["z-image"].tokenizer
    messages = [{"role": "user", "content": PROMPT}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert text == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    no_think = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think == text + "<think>\n\n</think>\n\n"
    # the pipeline pads to max_sequence_length and keeps only the real tokens of each prompt
    embeds = loaded["z-image"]._encode_prompt([PROMPT], device=torch.device("cpu"))
    hidden = TINY_DIMS["z-image"]["text_hidden"]["text_encoder"]
    assert embeds[0].shape == (len(tok(text).input_ids), hidden)


def test_tokenizers_roundtrip(tmp_path):
    text = "a large red circle at the left on a white background, 123!"
    for name, tok in {
        "clip": build_clip_tokenizer(),
        "t5": build_t5_tokenizer(),
        "qwen": build_qwen_tokenizer("qwen2.5-vl"),
    }.items():
        tok.save_pretrained(tmp_path / name)
        again = transformers.AutoTokenizer.from_pretrained(tmp_path / name)
        assert type(again) is type(tok)
        assert again(text).input_ids == tok(text).input_ids
        assert len(again) == len(tok)
        assert again.pad_token == tok.pad_token and again.eos_token == tok.eos_token
    clip = build_clip_tokenizer()
    ids = clip(PROMPT).input_ids
    assert len(ids) == 2 + len(PROMPT.split())  # whole-word tokens between bos and eos
    assert clip.model_max_length == 77


def test_deterministic_given_seed():
    a = build_tiny_components("flux-dev", seed=0)["transformer"].state_dict()
    b = build_tiny_components("flux-dev", seed=0)["transformer"].state_dict()
    c = build_tiny_components("flux-dev", seed=1)["transformer"].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_demo_dataset(tmp_path):
    from PIL import Image

    folder = make_demo_dataset(tmp_path / "demo", n=12, seed=0)
    assert folder == tmp_path / "demo"
    pngs = sorted(folder.glob("*.png"))
    txts = sorted(folder.glob("*.txt"))
    assert len(pngs) == len(txts) == 12
    assert [p.stem for p in pngs] == [t.stem for t in txts]
    captions = [t.read_text() for t in txts]
    assert len(set(captions)) == 12
    sizes = set()
    for png, caption in zip(pngs, captions):
        with Image.open(png) as im:
            assert im.mode == "RGB" and max(im.size) <= 128
            sizes.add(im.size)
        assert caption.startswith("a ") and caption.endswith(" background")
    assert sizes == {(96, 64), (64, 96), (80, 80)}
    for shape in ("circle", "square", "triangle"):
        assert any(shape in c for c in captions)

    # the caption tells the truth: background colour in a corner, shape colour somewhere
    from stages.tiny.shapes import BACKGROUNDS, COLOURS

    for png, caption in zip(pngs, captions):
        words = caption.split()
        colour, bg = words[2], words[-2]
        pixels = np.asarray(Image.open(png))
        # images carry film grain (sigma 10): compare neighbourhood means, not exact pixels
        corner = pixels[:6, :6].reshape(-1, 3).mean(axis=0)
        assert np.abs(corner - np.array(BACKGROUNDS[bg])).max() < 12, (png, corner, bg)
        near = (np.abs(pixels.reshape(-1, 3).astype(int) - np.array(COLOURS[colour])) < 30).all(axis=1)
        assert near.mean() > 0.01, (png, colour)

    again = make_demo_dataset(tmp_path / "again", n=12, seed=0)
    assert [p.read_bytes() for p in sorted(again.glob("*"))] == [p.read_bytes() for p in sorted(folder.glob("*"))]
    other = make_demo_dataset(tmp_path / "other", n=12, seed=1)
    assert [t.read_text() for t in sorted(other.glob("*.txt"))] != captions
