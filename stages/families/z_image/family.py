"""Z-Image (Turbo and base): Qwen3 text states, FLUX's 16-channel VAE, single-stream DiT on lists.

Checked against diffusers 0.42.1:
- `pipelines/z_image/pipeline_z_image.py` `_encode_prompt`: each caption goes through the
  tokenizer's chat template (`add_generation_prompt=True, enable_thinking=True`), is padded to
  `max_sequence_length` (template included), Qwen3Model runs with the mask and
  `hidden_states[-2]` is kept at the unmasked tokens only: one variable-length tensor per caption.
- `__call__`: latents (B, C, h, w) as a list of (C, 1, h, w); the transformer gets
  `timestep = (1000 - t) / 1000`, i.e. 1 - sigma, and its output is negated before
  `scheduler.step` (which steps `x + (sigma_next - sigma) * v` with v = noise - x0), so the model
  predicts x0 - noise. Decode `z = x / scaling_factor + shift_factor` (FLUX's VAE normalization).
- `models/transformers/transformer_z_image.py`: every caption and image is padded to a multiple
  of 32 tokens with learned pad tokens and the batch is masked per sample, so an item sees the
  same sequence alone or in a batch as long as its caption has no foreign padding: we pass each
  caption cut to its stored length.
"""

from __future__ import annotations

from typing import Any

from stages.core import flow
from stages.core.lazy import lazy_module, no_grad
from stages.families.z_image.comfyui import LAYOUT as COMFYUI_LAYOUT
from stages.core.kohya import GENERIC as KOHYA_LAYOUT
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.families.base import BatchMeta, FamilyTraits
from stages.families.kl_vae import KLVAELatents
from stages.families.text_encoders import (chat_prompts, load_chat_tokenizer, load_text_model, pad_valid_tokens,
                                          require_tokens)

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch


class ZImageTextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import Qwen3Model

        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.tokenizer = load_chat_tokenizer(src, "Z-Image")
        self.model = load_text_model(Qwen3Model, src, "text_encoder", cfg, rt)

    def _templated(self, texts: list[str]) -> list[str]:
        return chat_prompts(self.tokenizer, texts, enable_thinking=True)

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        tokens = self.tokenizer(self._templated(texts), padding="max_length", max_length=self.max_len,
                                truncation=True, return_tensors="pt").to(self.device)
        out = self.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask.bool(),
                         output_hidden_states=True)
        return pad_valid_tokens(out.hidden_states[-2], tokens.attention_mask, 0, self.max_len)

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(self._templated(texts), truncation=False).input_ids]


class ZImage(KLVAELatents, FamilyTraits):
    name = "z-image"
    title = "Z-Image"
    fp8_faster_from_tokens = 4173  # 1024 px b1, 77-token captions: fp8 0.83x bf16's step
    pipeline_class = "ZImagePipeline"
    lora_prefix = "transformer"
    denoiser_class = "ZImageTransformer2DModel"
    # Self-attention of the noise refiner, context refiner and main layers.
    default_lora_targets = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")
    text_component_classes = ("Qwen3Model",)
    text_components = ("tokenizer", "text_encoder")
    text_offload_components = ("text_encoder",)  # loaded by text_encoders.load_text_model: the planner may offload its layers
    vae_components = ("vae",)
    denoiser_components = ("transformer",)
    kohya_layout = KOHYA_LAYOUT
    comfyui_layout = COMFYUI_LAYOUT

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> ZImageTextEncoder:
        return ZImageTextEncoder(src, cfg, rt)

    # ---- cache-latents and sample_timesteps: KLVAELatents

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from diffusers import ZImageTransformer2DModel

        return load_denoiser_weights(ZImageTransformer2DModel, src, "transformer", precision, rt, tcfg.nf4_double_quant)

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        dtype = base_dtype(denoiser)
        x_t = flow.noisy_latents(x0, noise, t).to(dtype)
        embeds, lengths = cond["prompt_embeds"].to(x0.device, dtype), cond["prompt_length"].tolist()
        require_tokens(lengths)
        out = denoiser(
            list(x_t.unsqueeze(2).unbind(0)),  # one (C, 1, h, w) tensor per sample
            1.0 - t.float(),  # the pipeline passes (1000 - t) / 1000
            [e[:n] for e, n in zip(embeds, lengths)],  # each caption without padding, as the pipeline does
            return_dict=False,
        )[0]
        pred = -torch.stack(out).squeeze(2)  # the pipeline negates the output to get noise - x0
        return flow.per_sample_loss(pred, flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)
