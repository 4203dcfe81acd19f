"""FLUX.2 klein's tiny random-weight pipeline, "flux2-klein" (stages.tiny builds and saves it).

Real config values kept: FLUX.2's tiny VAE (stages/families/common/flux2_tiny.py), the transformer's
`in_channels` = 4 x 32, four RoPE axes, `rope_theta` 2000, `mlp_ratio` 3 and no guidance embedding;
`joint_attention_dim` = 3 x the Qwen3 hidden size (three stacked layers); 28 Qwen3 layers so that
hidden_states[27] is an intermediate layer as in Qwen3-4B's 36; `is_distilled` as in
FLUX.2-klein-4B's model_index.json.
"""

from __future__ import annotations

from typing import Any

from stages.families.common.flux2_tiny import LATENT_CHANNELS, flux2_vae
from stages.tiny.parts import HEAD_DIM, HEADS, QWEN_HIDDEN, qwen3_text, seeded

PIPELINE_CLASS = "Flux2KleinPipeline"
PIPELINE_EXTRA: dict[str, Any] = {"is_distilled": True}
TEXT_LAYERS = 28
TINY_DIMS: dict[str, dict[str, Any]] = {"flux2-klein": {
    "latent_channels": LATENT_CHANNELS, "vae_scale_factor": 2, "image_multiple": 4,
    "text_hidden": {"text_encoder": QWEN_HIDDEN},
    "max_sequence_length": {"tokenizer": 512},  # pipeline default; chat template included
    "transformer_in_channels": 4 * LATENT_CHANNELS,
}}


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    from stages.tiny.tokenizers import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer("qwen3")
    vae = seeded(seed, flux2_vae)
    transformer = seeded(seed, lambda: Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,  # 2x2 patchified
        num_layers=1,  # double-stream blocks
        num_single_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=3 * QWEN_HIDDEN,
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4),  # sums to HEAD_DIM; real (32, 32, 32, 32) of 128
        rope_theta=2000,
        guidance_embeds=False,
    ).eval())
    # FLUX.2's published scheduler_config.json: the pipeline shifts by compute_empirical_mu per call.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential",
    )
    return {
        "scheduler": scheduler,
        "vae": vae,
        "text_encoder": seeded(seed, lambda: qwen3_text(tokenizer, TEXT_LAYERS, causal_lm=True)),
        "tokenizer": tokenizer,
        "transformer": transformer,
    }
