"""Qwen-Image 2.1. The protocol class is in `family.py`; this file holds what is known without torch:
the config checks run before any model loads, and the demo's hints.

QwenImage21Pipeline sets no token limit of its own; the transformer's RoPE table has 8192 positive
positions, and a caption's tokens take one each before the image's frame position."""

from __future__ import annotations

from typing import Any

from stages.families import checks

ROPE_POSITIONS = 8192  # QwenImage21Rope: torch.arange(8192) positive positions
DEMO_VARIANT = "qwen-image-2.1"
DEMO_CONFIG = "demo-qwen-image-2.1.toml"


# What QwenImage21Pipeline prints that is no news: the sample stage renders without a negative prompt (true
# CFG off by design), and the tiny pipeline's torchvision-free processor stand-in (tiny.py: the same text
# path) fails diffusers' type check of the slot, since Qwen3VLProcessor cannot be built without torchvision.
LIBRARY_NOTICES = {
    "diffusers.pipelines.qwenimage21.pipeline_qwenimage21":
        ("but classifier-free guidance is not enabled since no negative_prompt",),
    "diffusers.pipelines.pipeline_utils": (
        "Expected types for processor: (<class 'transformers.models.qwen3_vl.processing_qwen3_vl.Qwen3VLProcessor'>,), "
        "got <class 'transformers.models.llava.processing_llava.LlavaProcessor'>",),
}

def config_errors(cfg: Any) -> list[str]:
    return (checks.max_tokens(cfg, ROPE_POSITIONS - 1, "the transformer's RoPE table has 8192 positions and the "
                              "image's frame position follows the caption")
            + checks.bucket_step_multiple(cfg, 32, "the pipeline's 16x VAE times the 2x2 latent groups of "
                                                   "the joint sequence's image slots"))
