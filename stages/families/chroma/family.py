"""Chroma (Chroma1-HD, Chroma1-Base): FLUX.1-schnell pruned and retrained by lodestones. T5 only (no
CLIP), no guidance embedding, the per-block modulation Linears replaced by one small MLP (the
"approximator"); FLUX.1's VAE, packing and ids, so the latent side and the loss are `Flux1`'s.

Checked against diffusers 0.42.1 `pipelines/chroma/pipeline_chroma.py` and
`models/transformers/transformer_chroma.py`:
- `_get_t5_prompt_embeds`: T5 `last_hidden_state` of the caption padded to max_sequence_length, run
  with the tokenizer's mask; the mask handed on is `arange(L) <= (tokens incl. EOS)`: the caption and
  ONE padding token (all L when the caption fills them). Text ids are zeros.
- `__call__`: the mask is extended with ones over the image tokens (`_prepare_attention_mask`) and
  each block attends over `mask[:, None, :] * mask[:, :, None]`; timestep = sigma (t / 1000, the model
  multiplies by 1000); no guidance input; flow target noise - x0. Sigmas are `linspace(1, 1/N, N)`
  shifted by the scheduler (static shift, or exp(mu) from `calculate_shift` when
  `use_dynamic_shifting`: FLUX.1's 256..4096 range, what `train.dynamic_shift` samples).

Two things in diffusers 0.42.1 that training does not copy:
- The pipeline casts that mask to the text encoder's float dtype, and SDPA adds a float mask to the
  scores: 1.0 on kept pairs, 0.0 on padding, so nothing is masked (reported to diffusers, still so in
  0.42.1). Chroma was trained with padding masked (lodestone-rock/flow, kohya's `--apply_t5_attn_mask`),
  and ComfyUI feeds T5 without padding, so the mask is passed as booleans. Captions are cut to the
  batch's longest masked length, which masks nothing away: a batch of equal lengths (every batch of
  one) needs no mask at all. A padding token's query then has every key masked: SDPA's math,
  efficient and cuDNN backends all keep it finite on an H200, forward and backward.
- Under gradient checkpointing the stock forward drops the mask of the single blocks;
  `denoiser.ChromaTrainable` passes it.
"""

from __future__ import annotations

from typing import Any

from stages.core.lazy import lazy_module, no_grad
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.families.base import BatchMeta
from stages.families.chroma.comfyui import LAYOUT as COMFYUI_LAYOUT
from stages.families.common.flux1 import Flux1
from stages.families.text_encoders import load_text_model, require_max_length, trim_to_longest

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch


class ChromaTextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import AutoTokenizer, T5EncoderModel

        from stages.families.chroma import T5_MAX_TOKENS

        require_max_length(cfg, T5_MAX_TOKENS, "ChromaPipeline")
        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.tokenizer = src.load(AutoTokenizer, "tokenizer")
        self.t5 = load_text_model(T5EncoderModel, src, "text_encoder", cfg, rt)

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """{"prompt_embeds": (B, max_len, D) as the pipeline's, "prompt_length": (B,) tokens its mask keeps}."""
        tokens = self.tokenizer(texts, padding="max_length", max_length=self.max_len, truncation=True,
                                return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        embeds = self.t5(tokens.input_ids.to(self.device), attention_mask=mask, output_hidden_states=False)[0]
        kept = (tokens.attention_mask.sum(dim=1) + 1).clamp(max=self.max_len)  # the caption and one padding token
        return {"prompt_embeds": embeds.to(self.t5.dtype), "prompt_length": kept.to(torch.int64)}

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(texts, truncation=False).input_ids]


class Chroma(Flux1):
    name = "chroma"
    title = "Chroma"
    captions_cut_to_longest = True
    # fp8_faster_from_tokens: FLUX.1's. Chroma's attention and MLP Linears are FLUX.1's, at the same widths
    # (the modulation Linears it lacks run on one vector a sample); no fp8 rows of its own yet
    block_saved_units = {"ChromaSingleTransformerBlock": 13.0}  # FLUX.1's single block, without its modulation
    pipeline_class = "ChromaPipeline"
    denoiser_class = "ChromaTransformer2DModel"
    text_component_classes = ("T5EncoderModel",)
    text_components = ("tokenizer", "text_encoder")
    text_offload_components = ("text_encoder",)  # loaded by load_text_model: the planner may offload its layers
    text_whole_components = ()  # no CLIP: its one text encoder is the T5
    comfyui_layout = COMFYUI_LAYOUT
    # kohya_layout: FLUX.1's (BFL names, as sd-scripts' Chroma support writes them); the approximator has none

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> ChromaTextEncoder:
        return ChromaTextEncoder(src, cfg, rt)

    # ---- cache-latents, sample_timesteps and loss: Flux1's (FLUX.1's VAE, 2x2 packing, image ids)

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from stages.families.chroma.denoiser import ChromaTrainable

        return load_denoiser_weights(ChromaTrainable, src, "transformer", precision, rt, tcfg.nf4_double_quant)

    def predict(self, denoiser: torch.nn.Module, tokens: torch.Tensor, img_ids: torch.Tensor, t: torch.Tensor,
                cond: dict[str, torch.Tensor], tcfg: Any, meta: BatchMeta) -> torch.Tensor:
        """One transformer forward over packed image tokens (B, N, C*4) with their ids (N, 3)."""
        device, dtype = tokens.device, base_dtype(denoiser)
        lengths = cond["prompt_length"]
        text, kept = trim_to_longest(cond["prompt_embeds"].to(device, dtype), lengths, meta.text_multiple)
        mask = None
        if int(lengths.min()) < text.shape[1]:  # the pipeline's mask, with the image tokens kept, as booleans
            mask = torch.cat([kept, kept.new_ones(kept.shape[0], tokens.shape[1])], dim=1)
        return denoiser(
            hidden_states=tokens.to(dtype),
            timestep=t.to(device, dtype),
            encoder_hidden_states=text,
            txt_ids=self._constant("txt_ids", (text.shape[1], 3), 0.0, device, dtype),
            img_ids=img_ids,
            attention_mask=mask,
            return_dict=False,
        )[0]
