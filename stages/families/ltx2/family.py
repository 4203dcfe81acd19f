"""LTX-2 (Lightricks/LTX-2, LTX2Pipeline), text-to-video; its audio stream is not trained here.

Checked against diffusers 0.42.1 `pipelines/ltx2/pipeline_ltx2.py`, `pipelines/ltx2/connectors.py`,
`models/transformers/transformer_ltx2.py` and `models/autoencoders/autoencoder_kl_ltx2.py`:
- `_get_gemma_prompt_embeds`: each caption stripped, tokenized LEFT-padded to max_sequence_length (1024 by
  default) with Gemma's BOS, Gemma 3 run with the mask and `output_hidden_states=True`, and EVERY hidden state
  (embeddings + 48 layers) stacked on a last axis and flattened: (B, L, 3840 x 49). `__call__` then runs the
  `connectors` (LTX2TextConnectors): per-layer masked normalization, a projection to 3840, then a 2-layer
  1-D transformer that moves the caption's tokens to the front and fills the padding with 128 learnable
  registers (so L must divide by 128), returning the video rows, the audio rows and a mask (all ones with
  registers). Gemma's 12.5 GB of stacked states never reach the cache: encode-captions runs Gemma and the
  connectors, as the pipeline does before its loop, and stores the video rows and the mask.
- `prepare_latents` / decode: latents (B, 128, (F - 1) / 8 + 1, H / 32, W / 32), normalized
  `(z - latents_mean) * scaling_factor / latents_std` per channel (the VAE's buffers), then packed to
  (B, F' x H' x W', 128) tokens (`_pack_latents`, patch 1); the positions are `rope.prepare_video_coords`
  (pixel-space patch bounds, the causal first frame shifted, time divided by the frame rate, 24 fps).
- `__call__`: timestep = the FlowMatch scheduler's t = sigma x 1000, one per sample (also as `sigma`); the
  output is a velocity: `convert_velocity_to_x0` takes x0 = x_t - sigma x v, so the target is noise - x0
  with x_t = (1 - sigma) x0 + sigma noise. Sigmas are shifted by exp(mu), mu = `calculate_shift(video tokens,
  1024, 4096, 0.95, 2.05)` from the scheduler config ("exponential" time shift: shift = exp(mu) in FLUX's
  form), what train.dynamic_shift samples (the scheduler's shift_terminal only stretches the sampling tail).
- Audio: the transformer always runs an audio stream beside the video, joined by audio<->video
  cross-attention in each block. Training is video-only, as LTX-2's own trainer trains video without audio:
  the forward runs with `isolate_modalities=True` (the cross-modal attention off, as the pipeline's modality
  guidance pass runs it, and as ComfyUI's LTXAV runs a clip without audio latents: `run_a2v` needs audio
  tokens), where the video prediction does not depend on the audio inputs at all
  (tests/families/test_family_ltx2.py checks it), so those are one zero audio token and one zero caption row.
"""

from __future__ import annotations

import math
from typing import Any

from stages.core import flow
from stages.core.errors import ConfigError
from stages.core.lazy import lazy_module, no_grad
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.families.base import BatchMeta, FamilyTraits
from stages.families.common.channel_norm import ChannelNormalized
from stages.families.ltx2 import FRAME_RATE, FRAMES_PER_LATENT, GEMMA_MAX_TOKENS
from stages.families.ltx2.comfyui import KOHYA_LAYOUT, LAYOUT as COMFYUI_LAYOUT
from stages.families.text_encoders import load_text_model, require_max_length

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

# Lightricks/LTX-2 scheduler_config.json: the resolution-dependent shift (calculate_shift's arguments)
SHIFT_BASE_SEQ_LEN, SHIFT_MAX_SEQ_LEN, SHIFT_BASE, SHIFT_MAX = 1024, 4096, 0.95, 2.05


class LTX2TextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from diffusers.pipelines.ltx2 import LTX2TextConnectors
        from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

        require_max_length(cfg, GEMMA_MAX_TOKENS, "LTX2Pipeline")
        registers = src.component_config("connectors").get("video_connector_num_learnable_registers")
        if registers and cfg.max_sequence_length % registers:
            raise ConfigError(f"captions.max_sequence_length = {cfg.max_sequence_length}: LTX-2's text connectors fill "
                              f"the padding with {registers} learnable registers, so it must be a multiple of "
                              f"{registers}; set it to {max(registers, cfg.max_sequence_length // registers * registers)}")
        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.tokenizer = src.load(AutoTokenizer, "tokenizer")
        self.tokenizer.padding_side = "left"  # as the pipeline sets it: Gemma's chat-style left padding
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_text_model(Gemma3ForConditionalGeneration, src, "text_encoder", cfg, rt)
        dtype = torch.bfloat16 if cfg.text_encoder_precision == "nf4" else self.model.dtype
        self.connectors = src.load(LTX2TextConnectors, "connectors", torch_dtype=dtype).to(rt.device).eval()

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """{"prompt_embeds": (B, max_len, D) the connectors' video rows, "prompt_mask": (B, max_len) their mask}:
        what LTX2Pipeline hands its transformer as encoder_hidden_states and encoder_attention_mask."""
        tokens = self.tokenizer([t.strip() for t in texts], padding="max_length", max_length=self.max_len,
                                truncation=True, add_special_tokens=True, return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        states = self.model(input_ids=tokens.input_ids.to(self.device), attention_mask=mask,
                            output_hidden_states=True).hidden_states
        stacked = torch.stack(states, dim=-1).flatten(2, 3).to(self.connectors.dtype)
        video, _, video_mask = self.connectors(stacked, mask, padding_side=self.tokenizer.padding_side)
        return {"prompt_embeds": video, "prompt_mask": video_mask.to(torch.int64)}

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer([t.strip() for t in texts], truncation=False).input_ids]


class LTX2(ChannelNormalized, FamilyTraits):
    name = "ltx2"
    title = "LTX-2"
    pipeline_class = "LTX2Pipeline"
    lora_prefix = "transformer"
    denoiser_class = "LTX2VideoTransformer3DModel"
    vae_class = "AutoencoderKLLTX2Video"
    # The video stream's self- and cross-attention and feed-forward (attn1/attn2/ff match no audio_* module).
    default_lora_targets = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                            "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")
    text_component_classes = ("Gemma3ForConditionalGeneration", "LTX2TextConnectors")
    text_components = ("tokenizer", "text_encoder", "connectors")
    text_whole_components = ("connectors",)  # loaded in bf16 beside an nf4 Gemma (load_text_encoder)
    text_offload_components = ("text_encoder",)  # loaded by load_text_model: the planner may offload its layers
    vae_components = ("vae",)
    denoiser_components = ("transformer",)
    kohya_layout = KOHYA_LAYOUT
    comfyui_layout = COMFYUI_LAYOUT
    vae_downsample = 32
    trains_video = True
    frame_rate = FRAME_RATE
    frames_per_latent = FRAMES_PER_LATENT
    vae_frames_in_flight = 257  # the encoder takes the whole clip at once (no framewise cache): every frame, to 257
    pixels_per_token = 32  # the VAE's 32 px a latent cell, patch 1

    def __init__(self) -> None:
        self._coords: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> LTX2TextEncoder:
        return LTX2TextEncoder(src, cfg, rt)

    # ---- cache-latents
    def load_vae(self, src: Any, rt: Any) -> torch.nn.Module:
        from diffusers import AutoencoderKLLTX2Video

        return src.load(AutoencoderKLLTX2Video, "vae", torch_dtype=rt.dtype).to(rt.device).eval()

    def pixel_multiple(self, src: Any) -> int:
        vae, patch = src.component_config("vae"), src.component_config("transformer").get("patch_size") or 1
        ratio = vae.get("spatial_compression_ratio") or spatial_ratio(vae)
        # the VAE's spatial_compression_ratio x the transformer's patch, and LTX2Pipeline.check_inputs takes sides
        # that are multiples of 32 only
        return math.lcm(int(ratio) * int(patch), 32)

    @no_grad
    def encode_posterior(self, vae: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixels (B, 3, H, W) (an image: one frame) or (B, 3, F, H, W) -> mean, logvar (B, C, F', h, w)."""
        video = pixels if pixels.dim() == 5 else pixels.unsqueeze(2)
        dist = vae.encode(video.to(vae.device, vae.dtype)).latent_dist  # logvar clamped to [-30, 20]
        return dist.mean, dist.logvar

    def latent_normalization(self, vae: torch.nn.Module) -> dict[str, Any]:
        return {"latents_mean": [float(v) for v in vae.latents_mean], "latents_std": [float(v) for v in vae.latents_std],
                "scaling_factor": float(vae.config.scaling_factor)}

    def channel_stats(self, x: torch.Tensor, norm: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        mean, std = super().channel_stats(x, norm)
        return mean, std / norm["scaling_factor"]

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from diffusers import LTX2VideoTransformer3DModel

        return load_denoiser_weights(LTX2VideoTransformer3DModel, src, "transformer", precision, rt, tcfg.nf4_double_quant)

    def sample_timesteps(self, n: int, latent_hw: tuple[int, ...], generator: torch.Generator, tcfg: Any,
                         first: int | None = None) -> torch.Tensor:
        """Sigmas through exp(mu) of the clip's video tokens (latent_hw: (frames', h, w), patch 1), as the
        pipeline shifts them (train.dynamic_shift), else through train.shift."""
        shift = tcfg.shift
        if tcfg.dynamic_shift:
            tokens = math.prod(latent_hw)
            shift = math.exp(flow.dynamic_shift_mu(tokens, SHIFT_BASE_SEQ_LEN, SHIFT_MAX_SEQ_LEN, SHIFT_BASE, SHIFT_MAX))
        return flow.lookup_sigmas(flow.draw_u(n, generator, tcfg, first), flow.sigma_table(shift))

    def coords(self, denoiser: torch.nn.Module, b: int, f: int, h: int, w: int, device: torch.device) -> tuple:
        """(video_coords, audio_coords) as the transformer's forward builds them when given none
        (`rope.prepare_video_coords`, `audio_rope.prepare_audio_coords`), built once per shape outside it: building
        them copies Python numbers to the GPU, which a CUDA graph's capture refuses."""
        key = (b, f, h, w, str(device))
        if key not in self._coords:
            self._coords[key] = (denoiser.rope.prepare_video_coords(b, f, h, w, device, fps=FRAME_RATE),
                                 denoiser.audio_rope.prepare_audio_coords(b, 1, device))
        return self._coords[key]

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        b, _, f, h, w = x0.shape
        video_coords, audio_coords = self.coords(denoiser, b, f, h, w, x0.device)
        cfg, dtype, device = denoiser.config, base_dtype(denoiser), x0.device
        timestep = t.to(device, torch.float32) * 1000.0  # the scheduler's t; the pipeline passes it as sigma too
        audio_width = cfg.caption_channels if cfg.use_prompt_embeddings else cfg.audio_cross_attention_dim
        pred = denoiser(
            hidden_states=pack(flow.noisy_latents(x0, noise, t)).to(dtype),
            audio_hidden_states=torch.zeros(b, 1, cfg.audio_in_channels, device=device, dtype=dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(device, dtype),
            audio_encoder_hidden_states=torch.zeros(b, 1, audio_width, device=device, dtype=dtype),
            timestep=timestep, sigma=timestep,
            encoder_attention_mask=cond["prompt_mask"].to(device),
            num_frames=f, height=h, width=w, fps=FRAME_RATE, audio_num_frames=1,
            video_coords=video_coords, audio_coords=audio_coords,
            isolate_modalities=True, use_cross_timestep=True, return_dict=False,
        )[0]
        return flow.per_sample_loss(unpack(pred, f, h, w), flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)


def spatial_ratio(vae: dict[str, Any]) -> int:
    """Pixels a latent cell spans along a side, from an AutoencoderKLLTX2Video config without its own
    spatial_compression_ratio: the input patch, halved by each scaling block that downsamples space (a "temporal"
    block does not; the class's fallback counts every block, 64 for LTX-2's VAE, whose cells are 32 px)."""
    scaling = vae.get("spatio_temporal_scaling", (True, True, True, True))
    kinds = vae.get("downsample_type", ("spatial", "temporal", "spatiotemporal", "spatiotemporal"))
    if isinstance(scaling, bool):
        scaling = (scaling,) * len(kinds)
    return int(vae.get("patch_size", 4)) * 2 ** sum(1 for on, kind in zip(scaling, kinds) if on and kind != "temporal")


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, F, h, w) -> (B, F x h x w, C): LTX2Pipeline._pack_latents with LTX-2's patch 1 x 1 x 1."""
    return x.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, f: int, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack`: (B, F x h x w, C) -> (B, C, F, h, w)."""
    return tokens.transpose(1, 2).unflatten(2, (f, h, w))
