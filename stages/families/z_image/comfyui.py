"""Z-Image as ComfyUI loads it (its Lumina2 layout, `comfy/utils.py` `z_image_to_diffusers`): each block's
q, k and v are one `attention.qkv`, `to_out.0` is `attention.out`, and the grouped top-level layers
(`all_x_embedder.2-1`, `all_final_layer.2-1`) drop their group names."""

from __future__ import annotations

from stages.core.comfyui import ComfyLayout, Rule

B = r"(layers|noise_refiner|context_refiner)\.(\d+)\."

LAYOUT = ComfyLayout("lumina2", (
    *[Rule(rf"{B}attention\.to_{p}", r"\1.\2.attention.qkv", i, 3) for i, p in enumerate("qkv")],
    Rule(rf"{B}attention\.to_out\.0", r"\1.\2.attention.out"),
    Rule(rf"{B}(feed_forward\.w[123]|adaLN_modulation\.0)", r"\1.\2.\3"),
    Rule(r"all_final_layer\.2-1\.(linear|adaLN_modulation\.1)", r"final_layer.\1"),
    Rule(r"all_x_embedder\.2-1", "x_embedder"),
    Rule(r"(cap_embedder\.1|t_embedder\.mlp\.[02])", r"\1"),
))
