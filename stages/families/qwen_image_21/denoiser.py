"""Qwen-Image 2.1's transformer with a training forward that a CUDA graph can capture.

diffusers' `QwenImage21Transformer2DModel.forward` (models/transformers/transformer_qwenimage21.py,
0.42.1) derives the joint sequence's layout from its inputs on every call: `tolist()` in the RoPE and
in the prefix segments, `nonzero()` and boolean indexing, `torch.tensor(<list>)` copies and a
`repeat_interleave` by a tensor. Each waits for the GPU, which a CUDA graph capture rejects: on the
H200 every capture failed and every step ran eager (bench/results/bench-qwen-image-2.1-I4.json).

For training, the layout is a function of (caption length, latent h, w) alone: the text, then the
target image's h*w tokens. `layout()` makes it once per shape, eagerly (the family keeps it), and
`forward(..., layout=...)` runs the rest of the stock forward on it: the same modules, in the same
order, on the same values (tests/families/test_family_qwen_image_21.py checks it against the stock forward,
and that the layout path traces with no graph break). Without `layout` the stock forward runs.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import QwenImage21Transformer2DModel
from diffusers.models.transformers import transformer_qwenimage21 as stock


def layout(model: QwenImage21Transformer2DModel, text_len: int, h: int, w: int,
           device: torch.device) -> dict[str, Any]:
    """What the stock forward derives from `img_mask` and `img_shapes` for [text, one h x w image],
    as graph-capturable inputs: the RoPE table (kept as real pairs, so a graph's static inputs are all real tensors),
    the target-token mask, the text length and the prefix segments (plain ints)."""
    image_pad_mask = torch.cat([torch.zeros(text_len, dtype=torch.bool), torch.ones(h * w, dtype=torch.bool)])
    image_pad_mask = image_pad_mask.to(device)
    shapes = [(1, h, w)]
    rotary = model.pos_embed(shapes, image_pad_mask, device=device)
    image_ids, target_token_mask = model.build_token_metadata(image_pad_mask, shapes)
    prefix_len = int((~target_token_mask).sum())
    assert prefix_len == text_len, (prefix_len, text_len)
    return {"rotary": torch.view_as_real(rotary), "target": target_token_mask, "text_len": text_len,
            "segments": stock._qwenimage21_prefix_segments(image_ids, prefix_len)}


class QwenImage21Trainable(QwenImage21Transformer2DModel):
    """The diffusers transformer (same config, weights and LoRA names) with the layout forward."""

    def forward(self, *args: Any, layout: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if layout is None:
            return super().forward(*args, **kwargs)
        return self._layout_forward(layout=layout, **kwargs)

    def _layout_forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                        timestep: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None,
                        layout: dict[str, Any]) -> tuple[torch.Tensor]:
        """The stock forward's prefill (no KV cache) with the layout given. Its joint sequence puts the
        image tokens after the text: `repeat_interleave` then the image scatter is this concatenation."""
        if any(isinstance(b.attn.processor, stock.QwenImage21FlexAttnProcessor) for b in self.transformer_blocks):
            raise ValueError("the layout forward takes QwenImage21AttnProcessor's segments, not flex attention's "
                             "BlockMask (not a tensor a CUDA graph can take as input): call it without `layout`")
        batch_size, text_len = hidden_states.shape[0], layout["text_len"]
        hidden_states = self.img_in(hidden_states)
        encoder_hidden_states = self.txt_in(encoder_hidden_states)
        joint = torch.cat([encoder_hidden_states, hidden_states.to(encoder_hidden_states.dtype)], dim=1)
        rotary_emb = torch.view_as_complex(layout["rotary"])
        target_token_mask = layout["target"]

        timestep = timestep.to(hidden_states.dtype)
        if self.config.causal_condition:
            timestep = torch.cat([timestep, timestep.new_zeros(1)], dim=0)
            modulation_mask = target_token_mask
        else:
            modulation_mask = None
        temb = self.time_text_embed(timestep, hidden_states)
        modulation = self.modulation(temb)

        key_valid = None
        if encoder_hidden_states_mask is not None:  # the text keys as masked, every image key valid
            key_valid = torch.cat([encoder_hidden_states_mask.bool(),
                                   encoder_hidden_states_mask.new_ones(batch_size, joint.shape[1] - text_len,
                                                                       dtype=torch.bool)], dim=1)
        for block in self.transformer_blocks:
            args = (joint, modulation, rotary_emb, None, modulation_mask, None, None, None, layout["segments"], key_valid)
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                joint = self._gradient_checkpointing_func(block, *args)
            else:
                joint = block(*args)
        joint = self.norm_out(joint, temb, modulation_mask)
        return (self.proj_out(joint),)
