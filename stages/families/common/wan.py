"""Wan (Wan 2.1 / 2.2, Wan-AI): umT5 captions, the causal 3-D Wan VAE, WanTransformer3DModel. The family
class the Wan families share; each sets its VAE statistics' source, timestep form and presets.

Checked against diffusers 0.42.1 `pipelines/wan/pipeline_wan.py`, `models/transformers/transformer_wan.py`,
`models/autoencoders/autoencoder_kl_wan.py` and `schedulers/scheduling_unipc_multistep.py`:
- `_get_t5_prompt_embeds`: each caption through `prompt_clean` (ftfy when installed, HTML unescaped twice,
  whitespace collapsed), tokenized padded to max_sequence_length (226 by default; the presets use 512, what
  Wan was trained with), umT5 `last_hidden_state` under the tokenizer's mask, then every position past the
  caption's tokens set to ZERO. The transformer has no text mask: its cross-attention attends to those zero
  rows (after `text_embedder`, no longer zero), so training keeps the full padded length as the pipeline does.
- `prepare_latents` / decode: latents (B, 48, (F - 1) / 4 + 1, H / 16, W / 16) for Wan 2.2's VAE; decode
  `z = x * latents_std + latents_mean` per channel, so x = (z - mean) / std. The VAE folds 2x2 pixels into
  channels (`patch_size` 2) before a causal encoder that reads the first frame alone, then 4 frames at a time
  with cached features; its posterior is a DiagonalGaussianDistribution (logvar clamped to [-30, 20]).
- `__call__`: the transformer gets `timestep` = the scheduler's t = sigma x 1000 (no /1000 as in FLUX),
  per latent token (B, F' x H'/2 x W'/2) when the pipeline's `expand_timesteps` is set (Wan 2.2 TI2V-5B),
  else per sample; UniPC with `prediction_type="flow_prediction"` recovers x0 = x_t - sigma * pred, so the
  training target is noise - x0 with x_t = (1 - sigma) x0 + sigma noise.
- The scheduler's sigmas are `flow_shift`-shifted (shift * s / (1 + (shift - 1) * s), FlowMatch's static
  shift): training draws its sigmas through the same shift, train.shift (the presets: the repo's
  `flow_shift`, 5.0 for TI2V-5B), so the trained noise levels are where the sampler spends its steps.
"""

from __future__ import annotations

from typing import Any

from stages.core import flow
from stages.core.lazy import lazy_module, no_grad
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.families.base import BatchMeta, FamilyTraits
from stages.families.common.channel_norm import ChannelNormalized
from stages.families.common.wan_layout import KOHYA_LAYOUT, LAYOUT as COMFYUI_LAYOUT
from stages.families.text_encoders import load_text_model, require_max_length

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

UMT5_MAX_TOKENS = 512  # umt5-xxl's position buckets serve any length; Wan was trained with 512 (text_len)


def prompt_clean(text: str) -> str:
    """WanPipeline's caption cleaning (diffusers' `prompt_clean`), so a caption row is what the pipeline encodes."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean as clean

    return clean(text)


class WanTextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import AutoTokenizer, UMT5EncoderModel

        require_max_length(cfg, UMT5_MAX_TOKENS, "WanPipeline's umT5")
        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.tokenizer = src.load(AutoTokenizer, "tokenizer")
        self.model = load_text_model(UMT5EncoderModel, src, "text_encoder", cfg, rt)

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """{"prompt_embeds": (B, max_len, D)}: the pipeline's rows, zero past each caption's tokens."""
        tokens = self.tokenizer([prompt_clean(t) for t in texts], padding="max_length", max_length=self.max_len,
                                truncation=True, add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        embeds = self.model(tokens.input_ids.to(self.device), mask).last_hidden_state
        keep = (torch.arange(self.max_len, device=self.device)[None] < mask.gt(0).sum(dim=1, keepdim=True))
        return {"prompt_embeds": (embeds * keep[..., None]).to(self.model.dtype)}

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer([prompt_clean(t) for t in texts], truncation=False).input_ids]


class WanBase(ChannelNormalized, FamilyTraits):
    """The Wan families' shared side; a family sets `name`, `title` and, for TI2V, `expand_timesteps`."""

    pipeline_class = "WanPipeline"
    lora_prefix = "transformer"
    denoiser_class = "WanTransformer3DModel"
    vae_class = "AutoencoderKLWan"
    # Self- and cross-attention and the feed-forward of every block (diffusers' Wan LoRA examples and
    # musubi-tuner train these Linears).
    default_lora_targets = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                            "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
    text_component_classes = ("UMT5EncoderModel",)
    text_components = ("tokenizer", "text_encoder")
    text_offload_components = ("text_encoder",)  # loaded by load_text_model: the planner may offload its layers
    text_keeps_hidden_states = False  # the last hidden state only
    vae_components = ("vae",)
    denoiser_components = ("transformer",)
    kohya_layout = KOHYA_LAYOUT  # musubi-tuner's names (the original Wan ones)
    comfyui_layout = COMFYUI_LAYOUT
    trains_video = True
    frames_per_latent = 4  # AutoencoderKLWan scale_factor_temporal: frames are 4k + 1
    vae_frames_in_flight = 5  # the causal encoder runs the first frame, then 4 at a time, caching features
    expand_timesteps = False
    """The pipeline hands the transformer one timestep per latent token (WanPipeline `expand_timesteps`,
    Wan 2.2 TI2V), else one per sample."""

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> WanTextEncoder:
        return WanTextEncoder(src, cfg, rt)

    # ---- cache-latents
    def load_vae(self, src: Any, rt: Any) -> torch.nn.Module:
        from diffusers import AutoencoderKLWan

        return src.load(AutoencoderKLWan, "vae", torch_dtype=rt.dtype).to(rt.device).eval()

    def pixel_multiple(self, src: Any) -> int:
        vae = src.component_config("vae")
        return int(vae.get("scale_factor_spatial") or 8) * 2  # WanPipeline's vae_scale_factor_spatial x the 2x2 patch

    @no_grad
    def encode_posterior(self, vae: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixels (B, 3, H, W) (an image: one frame) or (B, 3, F, H, W) -> mean, logvar (B, C, F', h, w)."""
        video = pixels if pixels.dim() == 5 else pixels.unsqueeze(2)
        dist = vae.encode(video.to(vae.device, vae.dtype)).latent_dist  # logvar clamped to [-30, 20]
        return dist.mean, dist.logvar

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from diffusers import WanTransformer3DModel

        return load_denoiser_weights(WanTransformer3DModel, src, "transformer", precision, rt, tcfg.nf4_double_quant)

    def sample_timesteps(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator, tcfg: Any,
                         first: int | None = None) -> torch.Tensor:
        """Sigmas through the scheduler's static flow_shift (train.shift); Wan has no resolution-dependent shift."""
        return flow.lookup_sigmas(flow.draw_u(n, generator, tcfg, first), flow.sigma_table(tcfg.shift))

    def timestep(self, t: torch.Tensor, x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
        """The transformer's `timestep` for sigmas t (B,) on latents x (B, C, F, h, w): sigma x 1000, per latent
        token (B, F/p_t x h/p_h x w/p_w) where the pipeline expands it, else (B,)."""
        t = t * 1000.0
        if not self.expand_timesteps:
            return t
        f, h, w = x.shape[2] // patch[0], x.shape[3] // patch[1], x.shape[4] // patch[2]
        return t[:, None].expand(-1, f * h * w)

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        dtype, device = base_dtype(denoiser), x0.device
        pred = denoiser(
            hidden_states=flow.noisy_latents(x0, noise, t).to(dtype),
            timestep=self.timestep(t.to(device, torch.float32), x0, tuple(denoiser.config.patch_size)),
            encoder_hidden_states=cond["prompt_embeds"].to(device, dtype),  # full length: no text mask in Wan
            return_dict=False,
        )[0]
        return flow.per_sample_loss(pred, flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)
