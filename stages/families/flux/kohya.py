"""FLUX.1's kohya/ComfyUI key layout: Black Forest Labs' checkpoint names (`double_blocks_0_img_attn_qkv`).

kohya sd-scripts and ComfyUI name FLUX's layers as BFL's checkpoint does, where q, k and v are one
fused linear; the fused LoRA is written block-diagonal (down rows stacked, up blocks on the
diagonal), which is exactly the separate LoRAs summed, and which diffusers' converter splits back
without loss (stages.core.kohya does the fusing).
"""

from __future__ import annotations

import re
from typing import Any

from stages.core.kohya import KohyaError, Layout

# diffusers module path -> (BFL module name, member index, member count) for FLUX.1's transformer.
# Fused members are ordered as in BFL's weights: qkv = [q, k, v]; linear1 = [q, k, v, mlp].
FLUX_RULES: list[tuple[str, str, int, int]] = [
    (r"transformer_blocks\.(\d+)\.attn\.to_q", r"double_blocks_\1_img_attn_qkv", 0, 3),
    (r"transformer_blocks\.(\d+)\.attn\.to_k", r"double_blocks_\1_img_attn_qkv", 1, 3),
    (r"transformer_blocks\.(\d+)\.attn\.to_v", r"double_blocks_\1_img_attn_qkv", 2, 3),
    (r"transformer_blocks\.(\d+)\.attn\.to_out\.0", r"double_blocks_\1_img_attn_proj", 0, 1),
    (r"transformer_blocks\.(\d+)\.attn\.add_q_proj", r"double_blocks_\1_txt_attn_qkv", 0, 3),
    (r"transformer_blocks\.(\d+)\.attn\.add_k_proj", r"double_blocks_\1_txt_attn_qkv", 1, 3),
    (r"transformer_blocks\.(\d+)\.attn\.add_v_proj", r"double_blocks_\1_txt_attn_qkv", 2, 3),
    (r"transformer_blocks\.(\d+)\.attn\.to_add_out", r"double_blocks_\1_txt_attn_proj", 0, 1),
    (r"transformer_blocks\.(\d+)\.ff\.net\.0\.proj", r"double_blocks_\1_img_mlp_0", 0, 1),
    (r"transformer_blocks\.(\d+)\.ff\.net\.2", r"double_blocks_\1_img_mlp_2", 0, 1),
    (r"transformer_blocks\.(\d+)\.ff_context\.net\.0\.proj", r"double_blocks_\1_txt_mlp_0", 0, 1),
    (r"transformer_blocks\.(\d+)\.ff_context\.net\.2", r"double_blocks_\1_txt_mlp_2", 0, 1),
    (r"transformer_blocks\.(\d+)\.norm1\.linear", r"double_blocks_\1_img_mod_lin", 0, 1),
    (r"transformer_blocks\.(\d+)\.norm1_context\.linear", r"double_blocks_\1_txt_mod_lin", 0, 1),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_q", r"single_blocks_\1_linear1", 0, 4),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_k", r"single_blocks_\1_linear1", 1, 4),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_v", r"single_blocks_\1_linear1", 2, 4),
    (r"single_transformer_blocks\.(\d+)\.proj_mlp", r"single_blocks_\1_linear1", 3, 4),
    (r"single_transformer_blocks\.(\d+)\.proj_out", r"single_blocks_\1_linear2", 0, 1),
    (r"single_transformer_blocks\.(\d+)\.norm\.linear", r"single_blocks_\1_modulation_lin", 0, 1),
    (r"x_embedder", "img_in", 0, 1),
    (r"context_embedder", "txt_in", 0, 1),
    (r"time_text_embed\.timestep_embedder\.linear_1", "time_in_in_layer", 0, 1),
    (r"time_text_embed\.timestep_embedder\.linear_2", "time_in_out_layer", 0, 1),
    (r"time_text_embed\.text_embedder\.linear_1", "vector_in_in_layer", 0, 1),
    (r"time_text_embed\.text_embedder\.linear_2", "vector_in_out_layer", 0, 1),
    (r"time_text_embed\.guidance_embedder\.linear_1", "guidance_in_in_layer", 0, 1),
    (r"time_text_embed\.guidance_embedder\.linear_2", "guidance_in_out_layer", 0, 1),
    (r"proj_out", "final_layer_linear", 0, 1),
    (r"norm_out\.linear", "final_layer_adaLN_modulation_1", 0, 1),
]
# BFL's final adaLN outputs (shift, scale); diffusers' norm_out.linear outputs (scale, shift).
SWAP_HALVES = frozenset({"final_layer_adaLN_modulation_1"})


def bfl_name(rules: list[tuple[str, str, int, int]], model: str, module: str) -> tuple[str, int, int]:
    """(BFL module name, member index, member count) of a diffusers module path, by the first matching rule."""
    for pattern, name, index, count in rules:
        m = re.fullmatch(pattern, module)
        if m:
            return m.expand(name), index, count
    raise KohyaError(f"{model} module '{module}' has no kohya (BFL) name; drop it from train.target_modules "
                     f"or export with --format diffusers")


def flux_bfl(module: str) -> tuple[str, int, int]:
    return bfl_name(FLUX_RULES, "FLUX", module)


def flux_widths(config: dict[str, Any]) -> dict[str, int]:
    """Output width of every member of FLUX's fused layers, from the transformer's config.json.

    Needed when only some members of a fused layer are trained: the default targets (attn.to_q/k/v)
    train q, k and v of a single block's linear1 but not its proj_mlp, whose block stays zero."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    widths: dict[str, int] = {}
    for i in range(config.get("num_layers", 0)):
        for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            widths[f"transformer_blocks.{i}.attn.{p}"] = inner
    for i in range(config.get("num_single_layers", 0)):
        for p in ("attn.to_q", "attn.to_k", "attn.to_v"):
            widths[f"single_transformer_blocks.{i}.{p}"] = inner
        widths[f"single_transformer_blocks.{i}.proj_mlp"] = inner * 4  # FluxSingleTransformerBlock mlp_ratio 4.0
    return widths




LAYOUT = Layout(flux_bfl, flux_widths, SWAP_HALVES)
