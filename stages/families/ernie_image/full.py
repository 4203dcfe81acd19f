"""ERNIE-Image at full size for bench/ (bench/full_configs.py builds it): the released architecture, what
the bench runs with, and the denoiser's attention FLOPs and meta-device call.

Where the numbers come from (no download is possible here):
- TRANSFORMER: baidu/ERNIE-Image's transformer/config.json as ComfyUI builds the model from it
  (`comfy/ldm/ernie/model.py` `ErnieImageModel` defaults: 36 blocks of 32 x 128 heads, ffn 12288,
  text_in_dim 3072, RoPE axes (32, 48, 48), theta 256), the same values MLX-Gen's port reads from the
  official config fields; 8.03B parameters, the "8B" of the model card.
- text encoder: Mistral3Model of Ministral 3 3B (text: 26 layers, 3072 wide, 32 heads / 8 KV heads of
  128, ffn 9216, 131072 tokens, yarn RoPE as Ministral3Config's defaults; vision: Pixtral's 24-layer
  1024-wide tower), 3.85B parameters = the 7.17 GiB bf16 text_encoder/model.safetensors of the release.
- VAE: FLUX.2's, AutoencoderKLFlux2's defaults in diffusers 0.42.1 (`stages.families.common.flux2_full`).
"""

from __future__ import annotations

from typing import Any

from stages.families.common.flux2_full import VAE
from stages.families.ernie_image.tiny import mistral3_model
from stages.families.full_parts import diffusers_model

PRESET = "configs/ernie-image.toml"
TEXT_PRECISION = "nf4"
# estimate: 23.8 GB of bf16 safetensors (8.03B transformer + 3.85B Mistral3); Z-Image's 20.5 GB took 38-54 s
BUILD_SECONDS = 55
TRAIN_SECONDS = 70  # estimate: a compiled 512 px b1 train item (load, regional compile, 8 steps), as Chroma's 8.9B
TEXT_IN_SEQUENCE = True
# every base at every bench shape: the bench's short plan runs each (nf4 first: its export and load check)
BASE_PRECISIONS = ("nf4", "fp8", "bf16")

TRANSFORMER = dict(hidden_size=4096, num_attention_heads=32, num_layers=36, ffn_hidden_size=12288, in_channels=128,
                   out_channels=128, patch_size=1, text_in_dim=3072, rope_theta=256, rope_axes_dim=(32, 48, 48),
                   eps=1e-6, qk_layernorm=True)
MINISTRAL_3B_TEXT = dict(vocab_size=131072, hidden_size=3072, intermediate_size=9216, num_hidden_layers=26,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                         rms_norm_eps=1e-5)
PIXTRAL_VISION = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                      head_dim=64, patch_size=14, image_size=1540)

COMPONENTS = {
    "transformer": diffusers_model("ErnieImageTransformer2DModel", TRANSFORMER),
    "vae": diffusers_model("AutoencoderKLFlux2", VAE),
    "text_encoder": lambda c: mistral3_model(c["tokenizer"], MINISTRAL_3B_TEXT, PIXTRAL_VISION),
}


def attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    """One joint self-attention over image + text tokens per block (scores and values: 4 S^2 width)."""
    return 4.0 * cfg.hidden_size * batch * (img + txt) ** 2 * cfg.num_layers


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    """The forward on the meta device, its RoPE table an empty tensor of the table's shape: the model's
    `rope` opens `torch.autocast(device_type="meta")`, which torch refuses (no Linear there, no FLOPs lost)."""
    import torch

    cfg, head_dim = model.config, model.config.hidden_size // model.config.num_attention_heads
    model.pos_embed.forward = lambda ids: torch.empty(*ids.shape[:-1], 1, head_dim, device=ids.device)
    return model(hidden_states=empty(b, cfg.in_channels, h // 2, w // 2), timestep=empty(b),
                 text_bth=empty(b, txt, cfg.text_in_dim), text_lens=empty(b, long=True), return_dict=False)
