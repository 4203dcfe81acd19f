"""Krea 2 as ComfyUI loads it (`comfy/utils.py` `krea2_to_diffusers`): its own short names (`blocks.N.attn.wq`,
`mlp.gate`, `first`, `tmlp`, `txtfusion`, `last`). ComfyUI's table covers two text-fusion blocks of each kind."""

from __future__ import annotations

from stages.core.comfyui import ComfyLayout, Rule

BLOCK = {r"attn\.to_q": "attn.wq", r"attn\.to_k": "attn.wk", r"attn\.to_v": "attn.wv", r"attn\.to_gate": "attn.gate",
         r"attn\.to_out\.0": "attn.wo", r"ff\.gate": "mlp.gate", r"ff\.up": "mlp.up", r"ff\.down": "mlp.down"}
BLOCKS = ((r"transformer_blocks\.(\d+)", r"blocks.\1"),
          (r"text_fusion\.layerwise_blocks\.([01])", r"txtfusion.layerwise_blocks.\1"),
          (r"text_fusion\.refiner_blocks\.([01])", r"txtfusion.refiner_blocks.\1"))
TOP = {"img_in": "first", r"time_embed\.linear_1": "tmlp.0", r"time_embed\.linear_2": "tmlp.2",
       "time_mod_proj": "tproj.1", r"txt_in\.linear_1": "txtmlp.1", r"txt_in\.linear_2": "txtmlp.3",
       r"text_fusion\.projector": "txtfusion.projector", r"final_layer\.linear": "last.linear"}

LAYOUT = ComfyLayout("krea2", (
    *[Rule(rf"{block}\.{d}", rf"{native}.{c}") for block, native in BLOCKS for d, c in BLOCK.items()],
    *[Rule(d, c) for d, c in TOP.items()],
))
