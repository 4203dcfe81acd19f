"""SDXL's UNet as ComfyUI loads it: Stability's layout (`input_blocks.4.1.transformer_blocks.0.attn1.to_q`),
reached from diffusers' paths through ComfyUI's `unet_to_diffusers` table, which lists the attention
blocks' linears, the ResNets' convs and time projections, the samplers and the embeddings."""

from __future__ import annotations

import re
from typing import Any

from stages.core.comfyui import ComfyLayout, Native

RESNET = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
          "conv_shortcut": "skip_connection"}
ATTENTION = (r"proj_in|proj_out|transformer_blocks\.\d+\.(attn[12]\.to_(q|k|v|out\.0)|ff\.net\.0\.proj|ff\.net\.2)")
BASIC = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "time_embedding.linear_1": "time_embed.0",
         "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
         "add_embedding.linear_2": "label_emb.0.2"}


def sgm_name(module: str, config: dict[str, Any]) -> Native | None:
    """Stability's name of a UNet module, or None where ComfyUI's table has none."""
    per = config["layers_per_block"]
    per = per[0] if isinstance(per, list) else per
    if module in BASIC:
        return Native(BASIC[module])
    m = re.fullmatch(r"(down|up)_blocks\.(\d+)\.(attentions|resnets)\.(\d+)\.(.+)", module)
    if m:
        side, block, kind, i, rest = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
        n = (1 + (per + 1) * block if side == "down" else (per + 1) * block) + i
        return _inner(f"{'input' if side == 'down' else 'output'}_blocks.{n}", kind, rest)
    m = re.fullmatch(r"mid_block\.(attentions|resnets)\.(\d)\.(.+)", module)
    if m:
        return _inner(f"middle_block.{1 if m.group(1) == 'attentions' else 2 * int(m.group(2))}", m.group(1),
                      m.group(3), middle=True)
    m = re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv", module)
    if m:
        return Native(f"input_blocks.{(per + 1) * (int(m.group(1)) + 1)}.0.op")
    m = re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv", module)
    if m:
        block = int(m.group(1))
        has_attention = "CrossAttn" in config["up_block_types"][block]
        return Native(f"output_blocks.{(per + 1) * block + per}.{2 if has_attention else 1}.conv")
    return None


def _inner(prefix: str, kind: str, rest: str, middle: bool = False) -> Native | None:
    if kind == "attentions":
        return Native(f"{prefix}{'' if middle else '.1'}.{rest}") if re.fullmatch(ATTENTION, rest) else None
    return Native(f"{prefix}{'' if middle else '.0'}.{RESNET[rest]}") if rest in RESNET else None


LAYOUT = ComfyLayout("sdxl", native=sgm_name)
