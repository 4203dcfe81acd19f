"""FLUX.1's and FLUX.2's transformers in Black Forest Labs' checkpoint layout, which ComfyUI and kohya
sd-scripts name them in.

ComfyUI keeps q, k and v of each attention as one `qkv` linear, and the single blocks' q, k, v and MLP
input as one `linear1`; a LoRA on a diffusers member lands on its rows. Its table of diffusers paths
(`comfy/utils.py` `flux_to_diffusers`) lists the modules marked mapped here; the final adaLN's delta
has its (scale, shift) halves swapped into BFL's (shift, scale). FLUX.2's shared modulation layers and
time/guidance embedders are outside that table: only their BFL names reach them.

kohya's names are BFL's with underscores (`double_blocks_0_img_attn_qkv`); a fused layer's LoRA is written
block-diagonal (down rows stacked, up blocks on the diagonal), which is exactly the separate LoRAs summed
and which diffusers' converters split back without loss (stages.core.kohya does the fusing). FLUX.2's
names are those diffusers 0.42.1's `_convert_kohya_flux2_lora_to_diffusers` reads; its single blocks'
fused q/k/v/MLP input is one linear in diffusers too, and its modulation layers have no name the
converter reads: they are refused.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from stages.core.comfyui import ComfyLayout, Rule
from stages.core.kohya import KohyaError, Layout

D, S = r"transformer_blocks\.(\d+)\.", r"single_transformer_blocks\.(\d+)\."
DB, SB = r"double_blocks.\1.", r"single_blocks.\1."

_DOUBLE_ATTENTION = (
    *[Rule(rf"{D}attn\.to_{p}", rf"{DB}img_attn.qkv", i, 3) for i, p in enumerate("qkv")],
    *[Rule(rf"{D}attn\.add_{p}_proj", rf"{DB}txt_attn.qkv", i, 3) for i, p in enumerate("qkv")],
    Rule(rf"{D}attn\.to_out\.0", rf"{DB}img_attn.proj"),
    Rule(rf"{D}attn\.to_add_out", rf"{DB}txt_attn.proj"),
)


def _mlps(first: str, second: str) -> tuple[Rule, ...]:
    """Both streams' MLPs of a double block: the diffusers names of their two linears -> BFL's mlp.0, mlp.2."""
    return tuple(Rule(rf"{D}{ff}\.{d}", rf"{DB}{stream}_mlp.{c}")
                 for ff, stream in (("ff", "img"), ("ff_context", "txt")) for d, c in ((first, 0), (second, 2)))


_FINAL = (
    Rule(r"x_embedder", "img_in"),
    Rule(r"context_embedder", "txt_in"),
    Rule(r"proj_out", "final_layer.linear"),
    Rule(r"norm_out\.linear", "final_layer.adaLN_modulation.1", swap=True),
)

FLUX1 = ComfyLayout("flux", (
    *_DOUBLE_ATTENTION,
    *_mlps(r"net\.0\.proj", r"net\.2"),
    Rule(rf"{D}norm1\.linear", rf"{DB}img_mod.lin"),
    Rule(rf"{D}norm1_context\.linear", rf"{DB}txt_mod.lin"),
    *[Rule(rf"{S}attn\.to_{p}", rf"{SB}linear1", i, 4) for i, p in enumerate("qkv")],
    Rule(rf"{S}proj_mlp", rf"{SB}linear1", 3, 4),
    Rule(rf"{S}proj_out", rf"{SB}linear2"),
    Rule(rf"{S}norm\.linear", rf"{SB}modulation.lin"),
    *_FINAL,
    *[Rule(rf"time_text_embed\.{d}_embedder\.linear_{i}", f"{c}_in.{layer}_layer")
      for d, c in (("timestep", "time"), ("text", "vector"), ("guidance", "guidance"))
      for i, layer in ((1, "in"), (2, "out"))],
))
"""FLUX.1 [dev], [schnell] and Kontext."""

FLUX2 = ComfyLayout("flux", (
    *_DOUBLE_ATTENTION,
    *_mlps("linear_in", "linear_out"),
    Rule(rf"{S}attn\.to_qkv_mlp_proj", rf"{SB}linear1"),
    Rule(rf"{S}attn\.to_out", rf"{SB}linear2"),
    *_FINAL,
    *[Rule(rf"time_guidance_embed\.{d}_embedder\.linear_{i}", f"{c}_in.{layer}_layer", mapped=False)
      for d, c in (("timestep", "time"), ("guidance", "guidance")) for i, layer in ((1, "in"), (2, "out"))],
    *[Rule(rf"{m}\.linear", f"{m}.lin", mapped=False)
      for m in ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation")],
))
"""FLUX.2 [dev] and [klein]."""


# kohya sd-scripts names FLUX's layers as BFL's checkpoint does, with "_" for ".": the same table as ComfyUI's.
SWAP_HALVES = frozenset(r.native.replace(".", "_") for r in FLUX1.rules if r.swap)
"""BFL's final adaLN outputs (shift, scale); diffusers' norm_out.linear outputs (scale, shift)."""


def kohya_rules(layout: ComfyLayout, keep: Callable[[Rule], bool] = lambda r: True) -> list[tuple[str, str, int, int]]:
    """(diffusers pattern, kohya name, member index, member count) of the layout's rules that `keep` keeps."""
    return [(r.pattern, r.native.replace(".", "_"), r.index, r.count) for r in layout.rules if keep(r)]


FLUX_RULES = kohya_rules(FLUX1)
# diffusers' FLUX.2 kohya converter reads no name for the shared modulation layers, the guidance embedder
# or the final adaLN: the kohya layout leaves them out (refused by name)
FLUX2_RULES = kohya_rules(FLUX2, lambda r: not r.swap and "modulation" not in r.native and "guidance" not in r.native)


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


FLUX1_KOHYA = Layout(flux_bfl, flux_widths, SWAP_HALVES)
"""FLUX.1's kohya key layout."""


def flux2_bfl(module: str) -> tuple[str, int, int]:
    return bfl_name(FLUX2_RULES, "FLUX.2", module)


def flux2_widths(config: dict[str, Any]) -> dict[str, int]:
    """Output width of every member of the double blocks' fused qkv layers (all heads x head dim)."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    return {f"transformer_blocks.{i}.attn.{p}": inner for i in range(config.get("num_layers", 0))
            for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")}


FLUX2_KOHYA = Layout(flux2_bfl, flux2_widths)
"""FLUX.2's kohya key layout."""
