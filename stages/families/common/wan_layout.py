"""Wan's module names outside diffusers, which both Wan families share: ComfyUI's and kohya's (musubi-tuner's).

Wan as ComfyUI loads it (`comfy/model_base.py` WAN21, WAN22): `model_lora_keys_unet` has no table of
diffusers paths for it, so only its own weight names reach it (`diffusion_model.<name>`, `lora_unet_<name
with _>`). Those are the original Wan names, which diffusers renames when it converts a checkpoint
(`loaders/single_file_utils.py` `convert_wan_transformer_to_diffusers`); the rules below invert that table."""

from __future__ import annotations

from stages.core.comfyui import ComfyLayout, Rule
from stages.core.kohya import KohyaError, Layout

B = r"blocks\.(\d+)\."
ATTN = {"attn1": "self_attn", "attn2": "cross_attn"}
PROJ = {"to_q": "q", "to_k": "k", "to_v": "v", r"to_out\.0": "o", "add_k_proj": "k_img", "add_v_proj": "v_img"}

LAYOUT = ComfyLayout("wan", (
    *(Rule(rf"{B}{a}\.{p}", rf"blocks.\1.{native_a}.{native_p}", mapped=False)
      for a, native_a in ATTN.items() for p, native_p in PROJ.items()),
    Rule(rf"{B}ffn\.net\.0\.proj", r"blocks.\1.ffn.0", mapped=False),
    Rule(rf"{B}ffn\.net\.2", r"blocks.\1.ffn.2", mapped=False),
    Rule(r"condition_embedder\.time_embedder\.linear_1", "time_embedding.0", mapped=False),
    Rule(r"condition_embedder\.time_embedder\.linear_2", "time_embedding.2", mapped=False),
    Rule(r"condition_embedder\.text_embedder\.linear_1", "text_embedding.0", mapped=False),
    Rule(r"condition_embedder\.text_embedder\.linear_2", "text_embedding.2", mapped=False),
    Rule(r"condition_embedder\.time_proj", "time_projection.1", mapped=False),
    Rule(r"proj_out", "head.head", mapped=False),
    Rule(r"patch_embedding", "patch_embedding", mapped=False),
))


def musubi_name(module: str) -> tuple[str, int, int]:
    """kohya name of a diffusers module as musubi-tuner writes Wan LoRAs (`lora_unet_blocks_0_self_attn_q`: the
    original Wan names with "_"), what diffusers' `_convert_musubi_wan_lora_to_diffusers` and ComfyUI read."""
    native = LAYOUT.locate(module, {})
    if native is None:
        raise KohyaError(f"'{module}' has no name in Wan's original layout, so kohya-format readers cannot load it: "
                         f"leave it out of train.target_modules, or export with --format diffusers")
    return native.name.replace(".", "_"), 0, 1


KOHYA_LAYOUT = Layout(musubi_name)
