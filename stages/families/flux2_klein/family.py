"""FLUX.2 [klein] (4B, 9B): Qwen3 states of three layers, 32-channel VAE with batch-norm statistics,
2x2-patchified flow DiT with 4-axis position ids.

Checked against diffusers 0.42.1:
- `pipelines/flux2/pipeline_flux2_klein.py` `_get_qwen3_prompt_embeds` / `encode_prompt`: each
  caption goes through the tokenizer's chat template (`add_generation_prompt=True,
  enable_thinking=False`), is padded (and truncated) to `max_sequence_length` (512 by default,
  template included), Qwen3 runs with the attention mask, and `hidden_states[9]`, `[18]` and `[27]`
  are stacked per token into (L, 3 x hidden). Nothing is dropped: the padding positions are part
  of the prompt and the transformer gets no text mask, so rows are stored whole.
  `_prepare_text_ids`: text ids (0, 0, 0, l).
- `_encode_vae_image` / `__call__`'s decode: the VAE posterior (32 channels) is patchified 2x2
  (`_patchify_latents`: channel c*4 + dy*2 + dx) and normalized with the VAE's batch-norm running
  statistics, `(z - running_mean) / sqrt(running_var + batch_norm_eps)`, per patchified channel.
  The cache keeps the raw posterior; `normalize_latents` applies the same statistics unpatchified.
- `prepare_latents`, `_pack_latents`, `_prepare_latent_ids`: tokens in row-major order of the
  patchified latent with ids (0, row, col, 0), which is `flow.pack_2x2` of the unpatchified one.
- the transformer gets `timestep = t / 1000` = sigma (it multiplies by 1000) and `guidance=None`
  (klein's `guidance_embeds` is false; the distilled 4B/9B are step-distilled, `is_distilled` in
  model_index.json, not guidance-embedded): the training forward passes the same. The scheduler
  steps `x + (sigma_next - sigma) * pred`, so the target is noise - x0.
- sigmas: `compute_empirical_mu(image_seq_len, num_steps)` gives the exponential time shift the
  pipeline samples with; `train.dynamic_shift` trains at that shift for the token count of the
  bucket and the pipeline's default 50 steps (diffusers' train_dreambooth_lora_flux2_klein.py
  draws from the scheduler's unshifted table instead: `dynamic_shift = false, shift = 1.0`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from stages.core import flow
from stages.core.lora import load_denoiser_weights
from stages.core.model_source import ModelError
from stages.families.base import BatchMeta
from stages.families.flux2_klein.kohya import LAYOUT as KOHYA_LAYOUT
from stages.families.text_encoders import chat_prompts, load_chat_tokenizer, load_text_model

HIDDEN_STATES_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers default
SHIFT_STEPS = 50  # Flux2KleinPipeline.__call__'s default num_inference_steps, for the resolution shift


class Flux2KleinTextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import Qwen3Model

        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.tokenizer = load_chat_tokenizer(src, "FLUX.2 klein")
        # The pipeline's Qwen3ForCausalLM minus its lm_head: the hidden states are the same.
        self.model = load_text_model(Qwen3Model, src, "text_encoder", cfg, rt)
        layers = self.model.config.num_hidden_layers
        if layers < max(HIDDEN_STATES_LAYERS):
            raise ModelError(f"'{src.ref}' text_encoder/ has {layers} layers, but FLUX.2 klein reads hidden states "
                             f"{HIDDEN_STATES_LAYERS}: point 'model' at a FLUX.2 klein pipeline")

    def _templated(self, texts: list[str]) -> list[str]:
        return chat_prompts(self.tokenizer, texts, enable_thinking=False)

    @torch.no_grad()
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        tokens = self.tokenizer(self._templated(texts), padding="max_length", max_length=self.max_len,
                                truncation=True, return_tensors="pt").to(self.device)
        out = self.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                         output_hidden_states=True, use_cache=False)
        states = torch.stack([out.hidden_states[k] for k in HIDDEN_STATES_LAYERS], dim=2)  # (B, L, 3, D)
        return {"prompt_embeds": states.flatten(2)}

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(self._templated(texts), truncation=False).input_ids]


def _patch_stats(x: torch.Tensor, values: list[float]) -> torch.Tensor:
    """Per-patchified-channel statistics (C*4,) shaped to broadcast over x viewed (B, C, h/2, 2, w/2, 2)."""
    return torch.tensor(values, device=x.device, dtype=x.dtype).view(1, -1, 1, 2, 1, 2)


class Flux2Klein:
    name = "flux2-klein"
    pipeline_class = "Flux2KleinPipeline"
    lora_prefix = "transformer"
    denoiser_class = "Flux2Transformer2DModel"
    vae_class = "AutoencoderKLFlux2"
    # Image-stream attention of the double blocks and the fused q/k/v/MLP input of the single blocks
    # (FLUX.2's single blocks have no separate to_q/to_k/to_v).
    default_lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_qkv_mlp_proj")
    text_component_classes = ("Qwen3Model",)
    text_components = ("tokenizer", "text_encoder")
    vae_components = ("vae",)
    denoiser_components = ("transformer",)
    kohya_layout = KOHYA_LAYOUT

    def __init__(self) -> None:
        self._ids: dict[tuple, torch.Tensor] = {}  # image and text ids, per shape

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> Flux2KleinTextEncoder:
        return Flux2KleinTextEncoder(src, cfg, rt)

    # ---- cache-latents
    def load_vae(self, src: Any, rt: Any) -> torch.nn.Module:
        from diffusers import AutoencoderKLFlux2

        return src.load(AutoencoderKLFlux2, "vae", torch_dtype=rt.dtype).to(rt.device).eval()

    def pixel_multiple(self, src: Any) -> int:
        blocks = src.component_config("vae")["block_out_channels"]
        return 2 ** (len(blocks) - 1) * 2  # Flux2KleinPipeline.vae_scale_factor x the 2x2 patches

    @torch.no_grad()
    def encode_posterior(self, vae: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        return dist.mean, dist.logvar  # logvar already clamped to [-30, 20] by DiagonalGaussianDistribution

    def latent_normalization(self, vae: torch.nn.Module) -> dict[str, Any]:
        var = vae.bn.running_var.double() + vae.config.batch_norm_eps
        return {"bn_mean": vae.bn.running_mean.double().tolist(), "bn_std": var.sqrt().tolist()}

    def normalize_latents(self, z: torch.Tensor, norm: dict[str, Any]) -> torch.Tensor:
        b, c, h, w = z.shape
        x = (z.view(b, c, h // 2, 2, w // 2, 2) - _patch_stats(z, norm["bn_mean"])) / _patch_stats(z, norm["bn_std"])
        return x.view(b, c, h, w)

    def denormalize_latents(self, x: torch.Tensor, norm: dict[str, Any]) -> torch.Tensor:
        b, c, h, w = x.shape
        z = x.view(b, c, h // 2, 2, w // 2, 2) * _patch_stats(x, norm["bn_std"]) + _patch_stats(x, norm["bn_mean"])
        return z.view(b, c, h, w)

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from diffusers import Flux2Transformer2DModel

        return load_denoiser_weights(Flux2Transformer2DModel, src, "transformer", precision, rt, tcfg.nf4_double_quant)

    def sample_timesteps(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator, tcfg: Any) -> torch.Tensor:
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        u = flow.sample_density(n, generator, tcfg.timestep_density, tcfg.logit_mean, tcfg.logit_std, tcfg.mode_scale)
        shift = tcfg.shift
        if tcfg.dynamic_shift:  # the scheduler's exponential time shift is a static shift by exp(mu)
            seq_len = (latent_hw[0] // 2) * (latent_hw[1] // 2)
            shift = math.exp(compute_empirical_mu(seq_len, SHIFT_STEPS))
        return flow.lookup_sigmas(u, flow.sigma_table(shift))

    def position_ids(self, kind: str, n: int, m: int, device: torch.device) -> torch.Tensor:
        """(n*m, 4) ids (t, h, w, l), built once per shape: image (0, row, col, 0) over n x m tokens
        (`_prepare_latent_ids`), text (0, 0, 0, l) over m tokens with n = 1 (`_prepare_text_ids`)."""
        key = (kind, n, m, device)
        if key not in self._ids:
            rows, cols = torch.meshgrid(torch.arange(n), torch.arange(m), indexing="ij")
            zero = torch.zeros_like(rows)
            axes = [zero, rows, cols, zero] if kind == "image" else [zero, zero, zero, cols]
            self._ids[key] = torch.stack(axes, dim=-1).reshape(-1, 4).to(device)
        return self._ids[key]

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        _, _, h, w = x0.shape
        dtype, device = denoiser.dtype, x0.device
        text = cond["prompt_embeds"].to(device, dtype)
        tokens = flow.pack_2x2(flow.noisy_latents(x0, noise, t)).to(dtype)
        pred = denoiser(
            hidden_states=tokens,
            encoder_hidden_states=text,
            timestep=t.to(device, dtype),  # the pipeline passes t / 1000 = sigma
            img_ids=self.position_ids("image", h // 2, w // 2, device),
            txt_ids=self.position_ids("text", 1, text.shape[1], device),
            guidance=None,  # as Flux2KleinPipeline: klein has no guidance embedding
            return_dict=False,
        )[0]
        return flow.per_sample_mse(flow.unpack_2x2(pred, h, w), flow.flow_target(x0, noise), meta.loss_mask)
