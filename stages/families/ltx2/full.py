"""LTX-2 at full size for bench/ (bench/full_configs.py builds it): the released architecture, what the bench runs
with, and the denoiser's attention FLOPs and meta-device call.

Where the numbers come from (no download is possible here): Lightricks/LTX-2 in diffusers format, as diffusers
0.42.1's classes default to it (their docstrings name LTX-2): transformer LTX2VideoTransformer3DModel (48 blocks;
video stream 32 x 128 heads, cross-attention 4096, 128 latent channels, patch 1; audio stream 32 x 64 heads;
caption_channels 3840), connectors LTX2TextConnectors (Gemma's 49 stacked states projected to 3840, two 2-layer
1-D transformers of 30 x 128 heads with 128 registers), VAE AutoencoderKLLTX2Video (128 channels, 32 px and 8 frames
a latent cell), the audio VAE and vocoder at their class defaults, and the text encoder google/gemma-3-12b's
config.json (48 layers of 3840, 16 heads of 256 with 8 key/value heads, ffn 15360, vocabulary 262208; SigLIP
vision tower of 27 layers of 1152). The scheduler is the tiny pipeline's (the release's config). Each row's
tokens are one clip's: (frames - 1) / 8 + 1 latent frames of (H / 32) x (W / 32) tokens, the caption's 1024
rows in cross-attention only.
"""

from __future__ import annotations

from typing import Any

from stages.families.full_parts import diffusers_model

PRESET = "configs/ltx2.toml"
TEXT_PRECISION = "bf16"  # Gemma 3 12B: 12.2B parameters, 24.4 GB in bf16
BUILD_SECONDS = 150  # estimate: a 19B transformer + Gemma 3 12B, about twice Qwen-Image's build (20B + 7B)
TRAIN_SECONDS = 150  # estimate: a compiled 480p 33-frame item on the H200 (load, regional compile, 8 steps)
TEXT_IN_SEQUENCE = False  # cross-attention: the caption is not part of the self-attention sequence
BASE_PRECISIONS = ("nf4", "fp8")

TRANSFORMER = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                   attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32),
                   audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=32,
                   audio_attention_head_dim=64, audio_cross_attention_dim=2048, num_layers=48, caption_channels=3840)
CONNECTORS = dict(caption_channels=3840, text_proj_in_factor=49, video_connector_num_attention_heads=30,
                  video_connector_attention_head_dim=128, video_connector_num_layers=2,
                  video_connector_num_learnable_registers=128, audio_connector_num_attention_heads=30,
                  audio_connector_attention_head_dim=128, audio_connector_num_layers=2,
                  audio_connector_num_learnable_registers=128)
VAE = dict(latent_channels=128, patch_size=4, spatial_compression_ratio=32, temporal_compression_ratio=8)
GEMMA3_12B_TEXT = dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, max_position_embeddings=131072,
                       sliding_window=1024)
SIGLIP = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=896,
              patch_size=14)


def _gemma(tok: Any) -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = tok.convert_tokens_to_ids
    text = dict(GEMMA3_12B_TEXT, pad_token_id=ids("<pad>"), bos_token_id=ids("<bos>"), eos_token_id=ids("<eos>"))
    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=SIGLIP, mm_tokens_per_image=256, boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"), image_token_index=ids("<image_soft_token>")))


def _connectors(_: dict[str, Any]) -> Any:
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    return LTX2TextConnectors(**CONNECTORS)


def _vocoder(_: dict[str, Any]) -> Any:
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    return LTX2Vocoder()


COMPONENTS = {
    "transformer": diffusers_model("LTX2VideoTransformer3DModel", TRANSFORMER),
    "vae": diffusers_model("AutoencoderKLLTX2Video", VAE),
    "audio_vae": diffusers_model("AutoencoderKLLTX2Audio", {}),
    "vocoder": _vocoder,
    "connectors": _connectors,
    "text_encoder": lambda c: _gemma(c["tokenizer"]),
}


def attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    """Per block, the video stream: 4 * S^2 * inner_dim of self-attention over the S clip tokens, plus
    4 * S * txt * inner_dim of cross-attention to the caption (the audio stream, one token here, is left out)."""
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    return 4.0 * (img * img + img * txt) * inner * cfg.num_layers * batch


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    """One latent frame of an h x w latent (the bench's image rows) with training's one-token audio stream."""
    cfg = model.config
    t = empty(b)
    return model(hidden_states=empty(b, h * w, cfg.in_channels), audio_hidden_states=empty(b, 1, cfg.audio_in_channels),
                 encoder_hidden_states=empty(b, txt, cfg.caption_channels),
                 audio_encoder_hidden_states=empty(b, 1, cfg.caption_channels), timestep=t, sigma=t,
                 num_frames=1, height=h, width=w, audio_num_frames=1, isolate_modalities=True, return_dict=False)
