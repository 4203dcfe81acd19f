"""FLUX.2 [dev]'s tiny random-weight pipeline, "flux2-dev" (stages.tiny builds and saves it).

Real config values kept: the klein tiny's VAE and transformer (32 latent channels, 4 x 32 input
channels, four RoPE axes, rope_theta 2000, mlp_ratio 3), here with the guidance embedding
(`guidance_embeds`, as FLUX.2-dev); `joint_attention_dim` = 3 x the Mistral hidden size (three
stacked layers); 31 Mistral layers so that hidden_states[30] is an intermediate layer as in
Mistral Small 3's 40; a one-layer Pixtral vision tower with [IMG] as its image token. The
processor stands in for PixtralProcessor, which needs torchvision (no CPU build for torch 2.13 on
these machines): LlavaProcessor with Pixtral's PIL image processor runs the same text path
(ProcessorMixin's apply_chat_template, then the tokenizer with the pipeline's padding arguments).
"""

from __future__ import annotations

from typing import Any

from stages.families.common.flux2_tiny import LATENT_CHANNELS, flux2_vae
from stages.tiny.parts import HEAD_DIM, HEADS, QWEN_HIDDEN, seeded

PIPELINE_CLASS = "Flux2Pipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
MISTRAL_HIDDEN = QWEN_HIDDEN  # real 5120
TEXT_LAYERS = 31
TINY_DIMS: dict[str, dict[str, Any]] = {"flux2-dev": {
    "latent_channels": LATENT_CHANNELS, "vae_scale_factor": 2, "image_multiple": 4,
    "text_hidden": {"text_encoder": MISTRAL_HIDDEN},
    "max_sequence_length": {"tokenizer": 512},  # pipeline default; system message included
    "transformer_in_channels": 4 * LATENT_CHANNELS,
}}


def _processor() -> Any:
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import LlavaProcessor, PixtralImageProcessorPil

    from stages.tiny.tokenizers import MISTRAL_CHAT_TEMPLATE, build_mistral_tokenizer

    return LlavaProcessor(image_processor=PixtralImageProcessorPil(patch_size=14), patch_size=14,
                          tokenizer=build_mistral_tokenizer((SYSTEM_MESSAGE,)), chat_template=MISTRAL_CHAT_TEMPLATE,
                          image_token="[IMG]")


def mistral3(tokenizer: Any, text: dict[str, Any], vision: dict[str, Any]) -> Any:
    """Mistral3ForConditionalGeneration (the pipeline's text encoder) of the given text and vision
    configs, with the tokenizer's special ids."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    tie = text.get("tie_word_embeddings", True)  # Mistral3Config's own default: tied
    config = Mistral3Config(text_config={"model_type": "mistral", **text, **ids}, tie_word_embeddings=tie,
                            vision_config={"model_type": "pixtral", **vision},
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
                            projector_hidden_act="gelu", multimodal_projector_bias=False, **ids)
    return Mistral3ForConditionalGeneration(config)


def _text_encoder(tokenizer: Any) -> Any:
    text = {"vocab_size": len(tokenizer), "hidden_size": MISTRAL_HIDDEN, "intermediate_size": MISTRAL_HIDDEN * 2,
            "num_hidden_layers": TEXT_LAYERS, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1e9, "sliding_window": None}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "head_dim": 16, "patch_size": 14, "image_size": 56}
    return mistral3(tokenizer, text, vision).eval()


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    processor = _processor()
    transformer = seeded(seed, lambda: Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=3 * MISTRAL_HIDDEN,
        timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000,
        guidance_embeds=True,
    ).eval())
    # FLUX.2's published scheduler_config.json: the pipeline shifts by compute_empirical_mu per call.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential",
    )
    return {
        "scheduler": scheduler,
        "vae": seeded(seed, flux2_vae),
        "text_encoder": seeded(seed, lambda: _text_encoder(processor.tokenizer)),
        "tokenizer": processor,
        "transformer": transformer,
    }
