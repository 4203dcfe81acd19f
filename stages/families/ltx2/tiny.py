"""LTX-2's tiny random-weight pipeline, "ltx2" (stages.tiny builds and saves it): every LTX2Pipeline component
from its real class at tiny widths, a Gemma tokenizer built offline, and the released scheduler config.

Real relations kept: the connectors read Gemma's every hidden state (`text_proj_in_factor` = layers + 1) and
replace padding with learnable registers (so captions.max_sequence_length divides by their count: 8 here,
128 in the release); the transformer's `caption_channels` is Gemma's width and its `vae_scale_factors` the
VAE's (8 frames a latent frame, as real; 8 px a latent cell, real 32); the audio stream's input width is
the audio VAE's channels x latent mel bins. The VAE's per-channel `latents_mean` / `latents_std` buffers are
set away from 0 / 1 so the normalization is exercised, and its posterior narrowed (logvar -6) as a trained
VAE's is.
"""

from __future__ import annotations

from typing import Any

from stages.tiny.parts import seeded

PIPELINE_CLASS = "LTX2Pipeline"
PIPELINE_EXTRA: dict[str, Any] = {"processor": None, "prompt_enhancer": None, "duration_head": None}
GEMMA_HIDDEN = 32  # Gemma 3 12B: 3840
GEMMA_LAYERS = 2  # Gemma 3 12B: 48
LATENT_CHANNELS = 8  # real 128
REGISTERS = 8  # the connectors' learnable registers (real 128)
TINY_DIMS: dict[str, dict[str, Any]] = {"ltx2": {
    "latent_channels": LATENT_CHANNELS, "vae_scale_factor": 8, "image_multiple": 8, "temporal_scale_factor": 8,
    "text_hidden": {"text_encoder": GEMMA_HIDDEN},
    "max_sequence_length": {"tokenizer": 1024},
    "transformer_in_channels": LATENT_CHANNELS,
}}
# The scheduler of Lightricks/LTX-2 (diffusers format): FlowMatch Euler with the resolution-dependent shift
# over 1024..4096 video tokens (0.95..2.05), exponential time shift, the last sigma stretched to 0.1.
LTX2_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                      base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1,
                      time_shift_type="exponential")


def gemma_tokenizer(model_max_length: int = 1024) -> Any:
    """A GemmaTokenizer (BPE with byte fallback, spaces as "▁") with Gemma's special tokens and image markers,
    single characters, and a token for each word of the demo captions."""
    from transformers import GemmaTokenizer

    from stages.tiny.tokenizers import CAPTION_WORDS, _whole_word_merges

    vocab = {t: i for i, t in enumerate(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>",
                                         "<end_of_image>", "<image_soft_token>"))}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in ["\u2581"] + [chr(c) for c in range(33, 127)]:
        vocab.setdefault(c, len(vocab))
    merges = _whole_word_merges([["\u2581", *w] for w in CAPTION_WORDS], vocab)
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length, add_bos_token=True,
                          padding_side="left")


def gemma_encoder(tokenizer: Any) -> Any:
    """Gemma3ForConditionalGeneration (the class the pipeline loads) with a one-layer SigLIP tower that captions
    never reach, and a 2-layer language model of width GEMMA_HIDDEN."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    text = dict(vocab_size=len(tokenizer), hidden_size=GEMMA_HIDDEN, intermediate_size=64, num_hidden_layers=GEMMA_LAYERS,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                sliding_window=64, pad_token_id=ids("<pad>"), bos_token_id=ids("<bos>"), eos_token_id=ids("<eos>"))
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
                          image_token_index=ids("<image_soft_token>"))
    return Gemma3ForConditionalGeneration(config).eval()


def video_vae() -> Any:
    """AutoencoderKLLTX2Video: the input folded 2x2 (patch_size 2), then two space-time and one time-only
    downsampling: 8 px and 8 frames a latent cell after the causal first frame (real: 32 px, 8 frames)."""
    import torch
    from diffusers import AutoencoderKLLTX2Video

    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, block_out_channels=(8, 16, 16),
        down_block_types=("LTX2VideoDownBlock3D",) * 3, decoder_block_out_channels=(8, 16, 16),
        layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True,) * 3,
        decoder_spatio_temporal_scaling=(True,) * 3, decoder_inject_noise=(False,) * 4,
        downsample_type=("spatiotemporal", "spatiotemporal", "temporal"),
        upsample_type=("temporal", "spatiotemporal", "spatiotemporal"), upsample_residual=(False,) * 3,
        upsample_factor=(1, 1, 1), patch_size=2, patch_size_t=1, encoder_causal=True, decoder_causal=False,
        spatial_compression_ratio=8, temporal_compression_ratio=8).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        vae.latents_mean.copy_(torch.randn(LATENT_CHANNELS, generator=g) * 0.2)
        vae.latents_std.copy_(torch.rand(LATENT_CHANNELS, generator=g) * 0.5 + 0.5)
        conv = vae.encoder.conv_out.conv
        conv.bias[LATENT_CHANNELS:] = -6.0  # the logvar half: a narrow posterior, as a trained VAE's
    return vae


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import (AutoencoderKLLTX2Audio, FlowMatchEulerDiscreteScheduler,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    tokenizer = gemma_tokenizer()
    audio_vae = seeded(seed, lambda: AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8).eval())
    latent_mel_bins = 8 // 4  # mel_bins / the audio VAE's mel compression
    return {
        "tokenizer": tokenizer,
        "text_encoder": seeded(seed, lambda: gemma_encoder(tokenizer)),
        "connectors": seeded(seed, lambda: LTX2TextConnectors(
            caption_channels=GEMMA_HIDDEN, text_proj_in_factor=GEMMA_LAYERS + 1, video_connector_num_attention_heads=2,
            video_connector_attention_head_dim=16, video_connector_num_layers=1,
            video_connector_num_learnable_registers=REGISTERS, audio_connector_num_attention_heads=2,
            audio_connector_attention_head_dim=16, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=REGISTERS, connector_rope_base_seq_len=4096,
            rope_type="split").eval()),
        "vae": seeded(seed, video_vae),
        "audio_vae": audio_vae,
        "vocoder": seeded(seed, lambda: LTX2Vocoder(
            in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
            resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], output_sampling_rate=16000).eval()),
        "scheduler": FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER),
        "transformer": seeded(seed, lambda: LTX2VideoTransformer3DModel(
            in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, patch_size=1, patch_size_t=1,
            num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32, vae_scale_factors=(8, 8, 8),
            audio_in_channels=2 * latent_mel_bins, audio_out_channels=2 * latent_mel_bins,
            audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16, num_layers=2,
            caption_channels=GEMMA_HIDDEN, rope_type="split").eval()),
    }
