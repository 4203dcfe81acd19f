"""FLUX.1's and FLUX.2's transformers in Black Forest Labs' checkpoint layout, which ComfyUI loads them in.

ComfyUI keeps q, k and v of each attention as one `qkv` linear, and the single blocks' q, k, v and MLP
input as one `linear1`; a LoRA on a diffusers member lands on its rows. Its table of diffusers paths
(`comfy/utils.py` `flux_to_diffusers`) lists the modules marked mapped here; the final adaLN's delta
has its (scale, shift) halves swapped into BFL's (shift, scale). FLUX.2's shared modulation layers and
time/guidance embedders are outside that table: only their BFL names reach them.
"""

from __future__ import annotations

from stages.core.comfyui import ComfyLayout, Rule

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
