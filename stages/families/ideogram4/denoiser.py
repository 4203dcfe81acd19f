"""Ideogram 4's transformer with a training forward that reads the text features of the text tokens only.

diffusers' `Ideogram4Transformer2DModel.forward` (models/transformers/transformer_ideogram4.py, 0.42.1) takes
`encoder_hidden_states` as long as the whole packed sequence (text + image tokens, 53248 features each) and
runs `llm_cond_norm` and `llm_cond_proj` over all of it, then zeroes the image rows with the text mask: at
1024 px that is 4096 rows of zeros, ~0.4 GB a sample in bf16 (more in the norm's fp32) and a 53248 x 4608
matmul per row, for nothing. It also always builds a (B, 1, S, S) boolean mask from `segment_ids`, which keeps
SDPA off its fastest kernels even when every token of the batch is in one segment.

`Ideogram4Trainable` (same config, weights and LoRA names) runs the stock forward unless it is handed text
features shorter than the sequence (the training path, `stages.families.ideogram4.family`). Then:
- the text features are the first T rows of the sequence; their norm and projection run on those rows only,
  and are added to them (the stock forward adds exactly zero to every other row: RMSNorm(0) = 0, and the
  projection's bias is masked off);
- `segment_ids=None` means one segment for every token (a batch whose captions have one length, every batch
  of one): no attention mask, which equals the stock all-True mask;
- everything else is the stock forward's modules in the same order (tests/families/test_family_ideogram4.py
  checks it against the stock forward, with and without gradient checkpointing).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers import Ideogram4Transformer2DModel
from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR, OUTPUT_IMAGE_INDICATOR


class Ideogram4Trainable(Ideogram4Transformer2DModel):
    """The diffusers transformer with the text-rows-only training forward."""

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                position_ids: torch.Tensor, segment_ids: torch.Tensor | None, indicator: torch.Tensor,
                attention_kwargs: dict | None = None, return_dict: bool = True) -> Any:
        if encoder_hidden_states.shape[1] == hidden_states.shape[1] and segment_ids is not None:
            return super().forward(hidden_states, timestep, encoder_hidden_states, position_ids, segment_ids,
                                   indicator, attention_kwargs, return_dict)
        return self.text_prefix_forward(hidden_states, timestep, encoder_hidden_states, position_ids, segment_ids,
                                        indicator, return_dict)

    def text_prefix_forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                            position_ids: torch.Tensor, segment_ids: torch.Tensor | None, indicator: torch.Tensor,
                            return_dict: bool = True) -> Any:
        """The stock forward with `text` (B, T, llm_features_dim) the features of the sequence's first T rows."""
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        n_text = text.shape[1]
        text_mask = (indicator[:, :n_text] == LLM_TOKEN_INDICATOR).to(hidden_states.dtype).unsqueeze(-1)
        image_mask = (indicator == OUTPUT_IMAGE_INDICATOR).to(hidden_states.dtype).unsqueeze(-1)
        hidden_states = self.input_proj(hidden_states * image_mask) * image_mask
        t_cond = self.t_embedding(timestep)
        if timestep.dim() == 1:
            t_cond = t_cond.unsqueeze(1)
        adaln_input = F.silu(self.adaln_proj(t_cond))
        text = self.llm_cond_proj(self.llm_cond_norm(text * text_mask)) * text_mask
        hidden_states = torch.cat([hidden_states[:, :n_text] + text, hidden_states[:, n_text:]], dim=1)
        hidden_states = hidden_states + self.embed_image_indicator((indicator == OUTPUT_IMAGE_INDICATOR).to(torch.long))
        cos, sin = self.rotary_emb(position_ids)
        rotary = (cos.to(hidden_states.dtype), sin.to(hidden_states.dtype))
        mask = None if segment_ids is None else (segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)).unsqueeze(1)
        for block in self.layers:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                hidden_states = self._gradient_checkpointing_func(block, hidden_states, mask, rotary, adaln_input)
            else:
                hidden_states = block(hidden_states, mask, rotary, adaln_input)
        output = self.final_layer(hidden_states, conditioning=adaln_input)
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)
