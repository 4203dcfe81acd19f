"""LTX-2's module names outside diffusers: ComfyUI's (its `LTXAV` model) and kohya's.

ComfyUI loads LTX-2 under its original Lightricks names (`comfy/ldm/lightricks/`), and `model_lora_keys_unet`
has no table of diffusers paths for LTXV / LTXAV: it accepts its own weight names only (`diffusion_model.<name>`,
`lora_unet_<name with _>`, and the bare `<name>`). The original names are diffusers' except the renames that
diffusers' `_convert_non_diffusers_ltx2_lora_to_diffusers` undoes (patchify_proj -> proj_in, adaln_single ->
time_embed, ...); the rules below invert that table, and every other module keeps its path. The ComfyUI copy
also loads back into LTX2Pipeline, whose loader converts `diffusion_model.` names."""

from __future__ import annotations

from stages.core.comfyui import ComfyLayout, Rule
from stages.core.kohya import Layout

# diffusers name -> original name (of a top-level module: the patterns match from the path's start)
RENAMES = (
    ("audio_proj_in", "audio_patchify_proj"),
    ("proj_in", "patchify_proj"),
    ("audio_time_embed", "audio_adaln_single"),
    ("time_embed", "adaln_single"),
    ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
    ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
    ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
    ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
    ("audio_prompt_adaln", "audio_prompt_adaln_single"),
    ("prompt_adaln", "prompt_adaln_single"),
)

LAYOUT = ComfyLayout("ltxav", (
    *(Rule(rf"{old}(\..+)?", rf"{new}\1", mapped=False) for old, new in RENAMES),
    Rule(r"(.+)", r"\1", mapped=False),  # the blocks, caption projections and proj_out keep their names
))


def kohya_name(module: str) -> tuple[str, int, int]:
    """kohya name of a diffusers module: ComfyUI's own name with "_" (`lora_unet_transformer_blocks_0_attn1_to_q`)."""
    native = LAYOUT.locate(module, {})
    assert native is not None  # the last rule matches every path
    return native.name.replace(".", "_"), 0, 1


KOHYA_LAYOUT = Layout(kohya_name)
