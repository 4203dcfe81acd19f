"""Full-size component configs that several families share, for bench/ (`stages/families/<family>/full.py`).

The numbers are the released checkpoints' config.json values. Each builder takes the family's tiny
components (for their tokenizers' special ids) and returns a random-weight module; bench/full_configs.py
builds them on the device and dtype it chooses.
"""

from __future__ import annotations

from typing import Any, Callable

FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, norm_num_groups=32, act_fn="silu", sample_size=1024, scaling_factor=0.3611,
                shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True,
                force_upcast=True)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5)
# Qwen3-4B's config.json: Z-Image's text encoder, and FLUX.2 klein 4B's
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=True)

Builder = Callable[[dict[str, Any]], Any]


def clip(tok: Any, cfg: dict[str, Any], projection: bool) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(CLIPTextConfig(**cfg, **ids))


def diffusers_model(name: str, cfg: dict[str, Any]) -> Builder:
    def build(_: dict[str, Any]) -> Any:
        import diffusers

        return getattr(diffusers, name)(**cfg)
    return build


def qwen3(tok: Any, cfg: dict[str, Any], causal_lm: bool) -> Any:
    """A Qwen3 text model of config `cfg` with the tokenizer's special ids: Qwen3Model, or
    Qwen3ForCausalLM where the pipeline declares it (FLUX.2 klein)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(**cfg, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config)
