"""FLUX.2's kohya/ComfyUI key layout: Black Forest Labs' checkpoint names (`double_blocks_0_img_attn_qkv`),
as diffusers 0.42.1's `_convert_kohya_flux2_lora_to_diffusers` (loaders/lora_conversion_utils.py) reads them.

q, k and v of each stream of a double block are one fused linear in BFL's weights, written
block-diagonal (stages.core.kohya does the fusing, as for FLUX.1); the single blocks' fused
q/k/v/MLP input is one linear in diffusers too (`to_qkv_mlp_proj`), so it maps one to one. The
modulation layers (`double_stream_modulation_*`, `single_stream_modulation`, `norm_out`) have no
name the converter reads: they are refused.
"""

from __future__ import annotations

from typing import Any

from stages.core.kohya import Layout
from stages.families.flux.kohya import bfl_name

# diffusers module path -> (BFL module name, member index, member count); qkv = [q, k, v].
FLUX2_RULES: list[tuple[str, str, int, int]] = [
    *[(rf"transformer_blocks\.(\d+)\.attn\.to_{p}", r"double_blocks_\1_img_attn_qkv", i, 3) for i, p in enumerate("qkv")],
    *[(rf"transformer_blocks\.(\d+)\.attn\.add_{p}_proj", r"double_blocks_\1_txt_attn_qkv", i, 3)
      for i, p in enumerate("qkv")],
    (r"transformer_blocks\.(\d+)\.attn\.to_out\.0", r"double_blocks_\1_img_attn_proj", 0, 1),
    (r"transformer_blocks\.(\d+)\.attn\.to_add_out", r"double_blocks_\1_txt_attn_proj", 0, 1),
    (r"transformer_blocks\.(\d+)\.ff\.linear_in", r"double_blocks_\1_img_mlp_0", 0, 1),
    (r"transformer_blocks\.(\d+)\.ff\.linear_out", r"double_blocks_\1_img_mlp_2", 0, 1),
    (r"transformer_blocks\.(\d+)\.ff_context\.linear_in", r"double_blocks_\1_txt_mlp_0", 0, 1),
    (r"transformer_blocks\.(\d+)\.ff_context\.linear_out", r"double_blocks_\1_txt_mlp_2", 0, 1),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_qkv_mlp_proj", r"single_blocks_\1_linear1", 0, 1),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_out", r"single_blocks_\1_linear2", 0, 1),
    (r"x_embedder", "img_in", 0, 1),
    (r"context_embedder", "txt_in", 0, 1),
    (r"time_guidance_embed\.timestep_embedder\.linear_1", "time_in_in_layer", 0, 1),
    (r"time_guidance_embed\.timestep_embedder\.linear_2", "time_in_out_layer", 0, 1),
    (r"proj_out", "final_layer_linear", 0, 1),
]


def flux2_bfl(module: str) -> tuple[str, int, int]:
    return bfl_name(FLUX2_RULES, "FLUX.2", module)


def flux2_widths(config: dict[str, Any]) -> dict[str, int]:
    """Output width of every member of the double blocks' fused qkv layers (all heads x head dim)."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    return {f"transformer_blocks.{i}.attn.{p}": inner for i in range(config.get("num_layers", 0))
            for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")}


LAYOUT = Layout(flux2_bfl, flux2_widths)
