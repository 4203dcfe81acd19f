"""Ideogram 4 at full size for bench/ (bench/full_configs.py builds it): the released architecture, what
the bench runs with, and the denoiser's attention FLOPs and meta-device call.

Where the numbers come from (no download is possible here):
- transformer (both the conditional and the unconditional one): Ideogram4Transformer2DModel's defaults in
  diffusers 0.42.1 (`transformer_ideogram4.py`), the same as ComfyUI's `comfy/ldm/ideogram4/model.py`
  defaults: 34 blocks of 18 x 256 heads (width 4608), SwiGLU 12288, adaLN 512, text features 13 x 4096;
  9.28B parameters, the count SimpleTuner and mflux quote for ideogram-ai/ideogram-4;
- text encoder: Qwen/Qwen3-VL-8B-Instruct's config.json (as quoted in public code: 36 layers of width 4096,
  32 / 8 heads of 128, vision tower depth 27, width 1152, deepstack (8, 16, 24)); the pipeline taps 13 of
  its layers, and diffusers' prompt-enhancer head is `diffusers/qwen3-vl-8b-instruct-lm-head`;
- VAE: FLUX.2's (AutoencoderKLFlux2's defaults, stages/families/common/flux2_full.py), the class the
  pipeline declares.
"""

from __future__ import annotations

from typing import Any

from stages.families.common.flux2_full import VAE
from stages.families.full_parts import diffusers_model

PRESET = "configs/ideogram4.toml"
TEXT_PRECISION = "nf4"
BUILD_SECONDS = 110  # estimate: 55 GB of bf16 safetensors (2 x 9.3B transformers + 8.8B Qwen3-VL); FLUX.1's 34 GB took 57-68 s
TRAIN_SECONDS = 75  # a compiled 512 px b1 train item on the H200 (load, regional compile, 8 steps): estimate from FLUX.1's 65-94 s
TEXT_IN_SEQUENCE = True
BASE_PRECISIONS = ("nf4", "bf16", "fp8")  # every base at every bench shape (no fp8 rows of this family yet)

TRANSFORMER = dict(in_channels=128, num_layers=34, attention_head_dim=256, num_attention_heads=18,
                   intermediate_size=12288, adaln_dim=512, llm_features_dim=53248, rope_theta=5_000_000,
                   mrope_section=(24, 20, 20), norm_eps=1e-5)
QWEN3_VL_8B_TEXT = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                        rms_norm_eps=1e-6, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                         "mrope_section": [24, 20, 20], "mrope_interleaved": True})
QWEN3_VL_8B_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                          patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                          deepstack_visual_indexes=[8, 16, 24])


def _qwen3_vl(tok: Any) -> Any:
    from transformers import Qwen3VLConfig, Qwen3VLModel

    ids = tok.convert_tokens_to_ids
    special = {"bos_token_id": ids("<|endoftext|>"), "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return Qwen3VLModel(Qwen3VLConfig(
        text_config={**QWEN3_VL_8B_TEXT, **special}, vision_config=QWEN3_VL_8B_VISION,
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False))


COMPONENTS = {
    "transformer": diffusers_model("Ideogram4Transformer2DModel", TRANSFORMER),
    "unconditional_transformer": diffusers_model("Ideogram4Transformer2DModel", TRANSFORMER),
    "vae": diffusers_model("AutoencoderKLFlux2", VAE),
    "text_encoder": lambda c: _qwen3_vl(c["tokenizer"]),
}


def attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    """4 * S^2 * width per single-stream block (S = image + text tokens): QK^T and AV."""
    return 4.0 * batch * (img + txt) ** 2 * cfg.num_attention_heads * cfg.attention_head_dim * cfg.num_layers


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    """The training forward (text features of the text rows only, one segment), on the stock model's modules."""
    import torch

    from stages.families.ideogram4.denoiser import Ideogram4Trainable

    cfg, img = model.config, (h // 2) * (w // 2)
    indicator = torch.cat([torch.full((b, txt), 3), torch.full((b, img), 2)], dim=1).to("meta")
    rope = empty(b, txt + img, cfg.attention_head_dim, fp32=True)
    model.rotary_emb.forward = lambda _: (rope, rope)  # its autocast guard has no meta device; no FLOPs of note
    return Ideogram4Trainable.text_prefix_forward(
        model, hidden_states=empty(b, txt + img, cfg.in_channels), timestep=empty(b),
        text=empty(b, txt, cfg.llm_features_dim), position_ids=empty(b, txt + img, 3, long=True), segment_ids=None,
        indicator=indicator, return_dict=False)
