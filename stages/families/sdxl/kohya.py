"""SDXL's kohya/ComfyUI key layout: the UNet's diffusers module paths, bar the added-conditioning MLP."""

from __future__ import annotations

from stages.core.kohya import Layout

# SDXL's added-conditioning MLP under kohya's (SGM) name: diffusers' kohya converter strips the
# trailing index of any `*emb*` name it does not know, so `add_embedding_linear_1` would not survive.
_SDXL_RENAMES = {"add_embedding.linear_1": "label_emb_0_0", "add_embedding.linear_2": "label_emb_0_2"}


def sdxl_unet(module: str) -> tuple[str, int, int]:
    return _SDXL_RENAMES.get(module) or module.replace(".", "_"), 0, 1


LAYOUT = Layout(sdxl_unet)
