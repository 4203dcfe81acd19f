"""Krea 2 at full size for bench/ (bench/full_configs.py builds it): the released configs, what the
bench runs with, and the denoiser's attention FLOPs and meta-device call.

Where the numbers come from (no download is possible here):
- transformer: Krea2Transformer2DModel's defaults in diffusers 0.42.1 (`transformer_krea2.py`), which
  match the published model cards of the diffusers conversions ("12.9B parameters, 28 blocks at width
  6144", 48 x 128 heads, 12 key/value heads, 12 tapped text layers of width 2560);
- text encoder: Qwen/Qwen3-VL-4B-Instruct's config.json (the Krea2Pipeline docstring names it; its
  default taps (2, 5, ..., 35) need 36 decoder layers); text part as Qwen3-4B (2560 wide, 36 layers,
  32 / 8 heads of 128), vision tower depth 24, width 1024, deepstack (5, 11, 17);
- VAE: the Qwen-Image VAE (Krea2Pipeline's `vae`), from Qwen-Image's full.py.
"""

from __future__ import annotations

from typing import Any

from stages.families.full_parts import diffusers_model
from stages.families.common import qwen_image_full

PRESET = "configs/krea2.toml"
TEXT_PRECISION = "nf4"
BUILD_SECONDS = 70  # estimate: 35 GB of bf16 safetensors (12.8B transformer + 4.4B Qwen3-VL); FLUX.1's 34 GB took 57-68 s
TRAIN_SECONDS = 75  # a compiled 512 px b1 train item on the H200 (load, regional compile, 8 steps): estimate from FLUX.1's 65-94 s, Z-Image's 66-84 s
TEXT_IN_SEQUENCE = True

TRANSFORMER = dict(in_channels=64, num_layers=28, attention_head_dim=128, num_attention_heads=48,
                   num_key_value_heads=12, intermediate_size=16384, timestep_embed_dim=256, text_hidden_dim=2560,
                   num_text_layers=12, text_num_attention_heads=20, text_num_key_value_heads=20,
                   text_intermediate_size=6912, num_layerwise_text_blocks=2, num_refiner_text_blocks=2,
                   axes_dims_rope=(32, 48, 48), rope_theta=1000.0, norm_eps=1e-5)
QWEN3_VL_4B_TEXT = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                        rms_norm_eps=1e-6, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                         "mrope_section": [24, 20, 20], "mrope_interleaved": True})
QWEN3_VL_4B_VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                          patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                          deepstack_visual_indexes=[5, 11, 17])


def _qwen3_vl(tok: Any) -> Any:
    from transformers import Qwen3VLConfig, Qwen3VLModel

    ids = tok.convert_tokens_to_ids
    special = {"bos_token_id": ids("<|endoftext|>"), "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return Qwen3VLModel(Qwen3VLConfig(
        text_config={**QWEN3_VL_4B_TEXT, **special}, vision_config=QWEN3_VL_4B_VISION,
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True))


# Krea2Pipeline's init arguments as the released folder has them: the 12 taps of Qwen3-VL-4B's hidden
# states (the pipeline's default; the tiny model taps 2 of its 4) and the base, not the distilled, schedule.
PIPELINE_EXTRA: dict[str, Any] = {"text_encoder_select_layers": (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35),
                                  "is_distilled": False}

COMPONENTS = {
    "transformer": diffusers_model("Krea2Transformer2DModel", TRANSFORMER),
    "vae": qwen_image_full.COMPONENTS["vae"],
    "text_encoder": lambda c: _qwen3_vl(c["tokenizer"]),
}


def attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    """4 * S^2 * width per single-stream layer (S = image + text tokens), plus the text fusion: its
    layer-wise blocks attend over the tapped layers of each token, its refiners over the text."""
    width, text_width = cfg.num_attention_heads * cfg.attention_head_dim, cfg.text_hidden_dim
    fusion = (cfg.num_layerwise_text_blocks * txt * cfg.num_text_layers ** 2
              + cfg.num_refiner_text_blocks * txt ** 2) * text_width
    return 4.0 * batch * ((img + txt) ** 2 * width * cfg.num_layers + fusion)


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    cfg = model.config
    img = (h // 2) * (w // 2)
    return model(hidden_states=empty(b, img, cfg.in_channels),
                 encoder_hidden_states=empty(b, txt, cfg.num_text_layers, cfg.text_hidden_dim),
                 timestep=empty(b, fp32=True), position_ids=empty(txt + img, 3, fp32=True),
                 encoder_attention_mask=None, return_dict=False)
