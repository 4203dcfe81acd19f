"""Chroma's transformer with a training forward that keeps the attention mask under gradient checkpointing.

diffusers' `ChromaTransformer2DModel.forward` (models/transformers/transformer_chroma.py, 0.42.1) calls a
checkpointed single block as `_gradient_checkpointing_func(block, hidden_states, temb, image_rotary_emb)`:
without its `attention_mask`, so with checkpointing on, the single blocks attend to the padding the double
blocks mask. Training checkpoints blocks to fit memory, which must not change the loss (the memory planner
picks how many), so a masked batch runs `masked_forward`: the stock forward's modules, in the same order,
on the same values, with the mask handed to every block (tests/families/test_family_chroma.py checks it against the
stock forward without checkpointing). Everything else, a batch without a mask among it, runs the stock forward.

Its timestep embedding builds the (zero) guidance input on the timestep's device: the stock one makes it on the CPU
and copies it over, which a CUDA graph's capture refuses (Chroma's train ran eager for it).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import ChromaTransformer2DModel
from diffusers.models.transformers.transformer_chroma import ChromaCombinedTimestepTextProjEmbeddings


class DeviceGuidanceEmbeddings(ChromaCombinedTimestepTextProjEmbeddings):
    """The stock timestep embedding, with its guidance input (zeros) made on the timestep's device."""

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        batch_size, mod_index_length = timestep.shape[0], self.mod_proj.shape[0]
        timesteps_proj = self.time_proj(timestep).to(dtype=timestep.dtype)
        zeros = torch.zeros(batch_size, dtype=torch.long, device=timestep.device)  # stock: torch.tensor([0] * batch)
        guidance_proj = self.guidance_proj(zeros).to(dtype=timestep.dtype)
        mod_proj = self.mod_proj.to(dtype=timesteps_proj.dtype, device=timesteps_proj.device).repeat(batch_size, 1, 1)
        timestep_guidance = torch.cat([timesteps_proj, guidance_proj], dim=1).unsqueeze(1).repeat(1, mod_index_length, 1)
        return torch.cat([timestep_guidance, mod_proj], dim=-1).to(timestep.dtype)


class ChromaTrainable(ChromaTransformer2DModel):
    """The diffusers transformer (same config, weights and LoRA names) with the masked checkpointed forward."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # the same module and buffers, with its own forward (set here: an __init__ of its own would hide the
        # parent's config signature from diffusers' loader)
        self.time_text_embed.__class__ = DeviceGuidanceEmbeddings
        checkpointing = torch.is_grad_enabled() and self.gradient_checkpointing
        if args or kwargs.get("attention_mask") is None or not checkpointing or not set(kwargs) <= MASKED_ARGS:
            return super().forward(*args, **kwargs)
        return self.masked_forward(**kwargs)

    def masked_forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor,
                       img_ids: torch.Tensor, txt_ids: torch.Tensor, attention_mask: torch.Tensor,
                       return_dict: bool = True) -> Any:
        """The stock forward without ControlNet and IP-Adapter inputs, `attention_mask` given to every block."""
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        hidden_states = self.x_embedder(hidden_states)
        pooled_temb = self.distilled_guidance_layer(self.time_text_embed(timestep.to(hidden_states.dtype) * 1000))
        encoder_hidden_states = self.context_embedder(encoder_hidden_states)
        image_rotary_emb = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        doubles, singles = len(self.transformer_blocks), len(self.single_transformer_blocks)
        for i, block in enumerate(self.transformer_blocks):
            img, txt = 3 * singles + 6 * i, 3 * singles + 6 * doubles + 6 * i  # the stock forward's offsets
            temb = torch.cat((pooled_temb[:, img:img + 6], pooled_temb[:, txt:txt + 6]), dim=1)
            encoder_hidden_states, hidden_states = self._gradient_checkpointing_func(
                block, hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_mask)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        for i, block in enumerate(self.single_transformer_blocks):
            hidden_states = self._gradient_checkpointing_func(
                block, hidden_states, pooled_temb[:, 3 * i:3 * i + 3], image_rotary_emb, attention_mask)
        hidden_states = self.norm_out(hidden_states[:, encoder_hidden_states.shape[1]:], pooled_temb[:, -2:])
        output = self.proj_out(hidden_states)
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)


MASKED_ARGS = frozenset(("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids", "attention_mask",
                         "return_dict"))
"""The keyword arguments `masked_forward` takes; a call with any other runs the stock forward."""
