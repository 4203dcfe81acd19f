"""ERNIE-Image's tiny random-weight pipeline, "ernie-image" (stages.tiny builds and saves it).

Real config values kept: FLUX.2's tiny VAE (AutoencoderKLFlux2, 32 latent channels, batch-norm
statistics drawn away from 0 and 1: stages/families/common/flux2_tiny.py); the transformer's
`in_channels` = 4 x 32 (2x2 patchified), `ffn_hidden_size` = 3 x hidden, `rope_theta` 256, three RoPE
axes in the real (32, 48, 48) proportions and a `text_in_dim` unlike the hidden size, so `text_proj`
exists as in the real 3072 -> 4096; a Mistral3Model of a Ministral 3 text config (yarn RoPE, its
defaults) with 2 layers, so `hidden_states[-2]` is a layer output, and a one-layer Pixtral vision tower;
the scheduler's static shift 4.0 (baidu/ERNIE-Image's scheduler_config.json). No prompt enhancer
(`pe`, `pe_tokenizer`: optional components the pipeline skips when absent).
"""

from __future__ import annotations

from typing import Any

from stages.families.common.flux2_tiny import LATENT_CHANNELS, flux2_vae
from stages.tiny.parts import HEAD_DIM, HEADS, ROPE_AXES, seeded

PIPELINE_CLASS = "ErnieImagePipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
MISTRAL_HIDDEN = 48  # real 3072 (Ministral 3 3B); unlike the transformer's 32, so text_proj exists
SCHEDULER_SHIFT = 4.0
TINY_DIMS: dict[str, dict[str, Any]] = {"ernie-image": {
    # the pipeline's vae_scale_factor is 2 ** len(block_out_channels): the VAE's 2 times the 2x2 patches
    "latent_channels": LATENT_CHANNELS, "vae_scale_factor": 4, "image_multiple": 4,
    "text_hidden": {"text_encoder": MISTRAL_HIDDEN},
    "max_sequence_length": {"tokenizer": 131072},  # the pipeline truncates at the tokenizer's model_max_length
    "transformer_in_channels": 4 * LATENT_CHANNELS,
}}


def mistral3_model(tokenizer: Any, text: dict[str, Any], vision: dict[str, Any]) -> Any:
    """Mistral3Model (the pipeline's text encoder class) of a Ministral 3 text config and a Pixtral vision
    config, with the tokenizer's special ids."""
    from transformers import Mistral3Config, Mistral3Model

    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    config = Mistral3Config(text_config={"model_type": "ministral3", **text, **ids},
                            vision_config={"model_type": "pixtral", **vision},
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
                            projector_hidden_act="gelu", multimodal_projector_bias=False)
    return Mistral3Model(config)


def _text_encoder(tokenizer: Any) -> Any:
    text = {"vocab_size": len(tokenizer), "hidden_size": MISTRAL_HIDDEN, "intermediate_size": 2 * MISTRAL_HIDDEN,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "head_dim": 16, "patch_size": 14, "image_size": 56}
    return mistral3_model(tokenizer, text, vision).eval()


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler

    from stages.tiny.tokenizers import build_mistral_tokenizer

    tokenizer = build_mistral_tokenizer()
    transformer = seeded(seed, lambda: ErnieImageTransformer2DModel(
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_layers=2,  # real 36
        ffn_hidden_size=3 * HEADS * HEAD_DIM,  # real 12288 = 3 x 4096
        in_channels=4 * LATENT_CHANNELS,  # 2x2 patchified
        out_channels=4 * LATENT_CHANNELS,
        patch_size=1,
        text_in_dim=MISTRAL_HIDDEN,
        rope_theta=256,
        rope_axes_dim=ROPE_AXES,  # sums to HEAD_DIM; real (32, 48, 48) of 128
        eps=1e-6,
        qk_layernorm=True,
    ).eval())
    # diffusers zero-initializes the final projection and the shared modulation, which would make every
    # output 0 and every block an identity: they get torch's default Linear init, as the other layers
    seeded(seed + 1, lambda: [linear.reset_parameters() for linear in (transformer.final_linear,
                                                                       transformer.adaLN_modulation[-1])])
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT,
                                                     use_dynamic_shifting=False),
        "vae": seeded(seed, flux2_vae),
        "text_encoder": seeded(seed, lambda: _text_encoder(tokenizer)),
        "tokenizer": tokenizer,
        "transformer": transformer,
    }
