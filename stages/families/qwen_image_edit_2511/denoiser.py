"""Qwen-Image-Edit-2511's transformer with a training forward that builds its modulation index once per layout.

diffusers' `QwenImageTransformer2DModel.forward` (models/transformers/transformer_qwenimage.py, 0.42.1) with
`zero_cond_t` set makes `modulate_index` (0 for each sample's target tokens, 1 for its controls') from `img_shapes`
with `torch.tensor(..., device=...)` on every call: a copy of Python numbers to the GPU, which a CUDA graph's
capture refuses, so every training step would run eager. `train_forward` runs the stock forward's modules in the
same order on the same values, with that index made once per (img_shapes, device) and reused
(tests/families/test_family_qwen_image_edit_2511.py checks it against the stock forward). A call with any other
argument (ControlNet samples, attention kwargs) runs the stock forward.
"""

from __future__ import annotations

from math import prod
from typing import Any

import torch
from diffusers import QwenImageTransformer2DModel


class ZeroCondTrainable(QwenImageTransformer2DModel):
    """The diffusers transformer (same config, weights and LoRA names) with `train_forward` under `zero_cond_t`."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args or not self.zero_cond_t or not set(kwargs) <= TRAIN_ARGS:
            return super().forward(*args, **kwargs)
        return self.train_forward(**kwargs)

    def modulate_index(self, img_shapes: list, device: torch.device) -> torch.Tensor:
        """The stock forward's `modulate_index` for `img_shapes`, built on `device` once."""
        cache = self.__dict__.setdefault("_modulate_index", {})
        key = (repr(img_shapes), str(device))
        if key not in cache:
            cache[key] = torch.tensor([[0] * prod(sample[0]) + [1] * sum(prod(s) for s in sample[1:])
                                       for sample in img_shapes], device=device, dtype=torch.int)
        return cache[key]

    def train_forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                      timestep: torch.Tensor, img_shapes: list, encoder_hidden_states_mask: torch.Tensor | None = None,
                      guidance: torch.Tensor | None = None, return_dict: bool = True) -> Any:
        """The stock forward under `zero_cond_t`, without ControlNet samples, attention kwargs or `additional_t_cond`."""
        from diffusers.models.modeling_outputs import Transformer2DModelOutput
        from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

        hidden_states = self.img_in(hidden_states)
        timestep = timestep.to(hidden_states.dtype)
        timestep = torch.cat([timestep, timestep * 0], dim=0)
        modulate_index = self.modulate_index(img_shapes, timestep.device)
        encoder_hidden_states = self.txt_in(self.txt_norm(encoder_hidden_states))
        text_seq_len, _, encoder_hidden_states_mask = compute_text_seq_len_from_mask(
            encoder_hidden_states, encoder_hidden_states_mask)
        if guidance is None:
            temb = self.time_text_embed(timestep, hidden_states, None)
        else:
            temb = self.time_text_embed(timestep, guidance.to(hidden_states.dtype) * 1000, hidden_states, None)
        image_rotary_emb = self.pos_embed(img_shapes, max_txt_seq_len=text_seq_len, device=hidden_states.device)
        for block in self.transformer_blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                encoder_hidden_states, hidden_states = self._gradient_checkpointing_func(
                    block, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, image_rotary_emb,
                    None, modulate_index)
            else:
                encoder_hidden_states, hidden_states = block(
                    hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                    encoder_hidden_states_mask=encoder_hidden_states_mask, temb=temb,
                    image_rotary_emb=image_rotary_emb, joint_attention_kwargs=None, modulate_index=modulate_index)
        output = self.proj_out(self.norm_out(hidden_states, temb.chunk(2, dim=0)[0]))
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)


TRAIN_ARGS = frozenset(("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "img_shapes",
                        "guidance", "return_dict"))
"""The keyword arguments `train_forward` takes; a call with any other runs the stock forward."""
