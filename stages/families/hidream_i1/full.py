"""HiDream-I1-Full at full size for bench/ (bench/full_configs.py builds it): the released architecture, what
the bench runs with, and the denoiser's attention FLOPs and meta-device call.

Where the numbers come from (no download is possible here):
- transformer: ComfyUI's checkpoint detection for HiDream (`comfy/model_detection.py`, the branch keyed on
  `caption_projection.0.linear.weight`), which sets the released config: 16 double- and 32 single-stream
  blocks of 20 x 128 heads, 4 routed experts (2 active), caption channels [4096, 4096], pooled width 2048,
  RoPE axes (64, 32, 32), max_resolution (128, 128), llama_layers 0..31 then 31 sixteen times; the defaults
  of diffusers 0.42.1's HiDreamImageTransformer2DModel agree where it has them (16, 32, 128, 20, 4, 2, 2048);
- text encoders: Long-CLIP L and G (CLIP ViT-L/14 and OpenCLIP bigG/14 text towers with 248 positions;
  their projections, 768 + 1280, are the transformer's 2048), T5-XXL as FLUX.1's, and
  meta-llama/Meta-Llama-3.1-8B-Instruct's config.json; FLUX.1's VAE.
"""

from __future__ import annotations

from typing import Any

from stages.families.common import flux1_full
from stages.families.full_parts import CLIP_L, FLUX_VAE, clip, diffusers_model

PRESET = "configs/hidream-i1.toml"
TEXT_PRECISION = "nf4"  # bf16 T5-XXL + Llama 3.1 8B + the CLIPs are ~27 GB
BUILD_SECONDS = 110  # estimate: 17B transformer + 8B Llama + T5-XXL (~62 GB of bf16); FLUX.1's 34 GB took 57-68 s
TRAIN_SECONDS = 120  # estimate for a 512 px b1 train item (load, compile, 8 steps); eager it took 64 s on an H100
TEXT_IN_SEQUENCE = True
BASE_PRECISIONS = ("nf4", "fp8", "bf16")  # the bench's bases: nf4 first (its export check reads the nf4 run)

TRANSFORMER = dict(patch_size=2, in_channels=16, out_channels=16, num_layers=16, num_single_layers=32,
                   attention_head_dim=128, num_attention_heads=20, caption_channels=[4096, 4096], text_emb_dim=2048,
                   num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(64, 32, 32),
                   max_resolution=(128, 128), llama_layers=[*range(32), *[31] * 16])
LONG_CLIP_L = {**CLIP_L, "max_position_embeddings": 248}
LONG_CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, projection_dim=1280,
                   num_hidden_layers=32, num_attention_heads=20, max_position_embeddings=248, hidden_act="gelu",
                   layer_norm_eps=1e-5)
LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def llama(tok: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**LLAMA_31_8B, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))


COMPONENTS = {
    "transformer": diffusers_model("HiDreamImageTransformer2DModel", TRANSFORMER),
    "vae": diffusers_model("AutoencoderKL", FLUX_VAE),
    "text_encoder": lambda c: clip(c["tokenizer"], LONG_CLIP_L, projection=True),
    "text_encoder_2": lambda c: clip(c["tokenizer_2"], LONG_CLIP_G, projection=True),
    "text_encoder_3": lambda c: flux1_full.t5(c["tokenizer_3"]),
    "text_encoder_4": lambda c: llama(c["tokenizer_4"]),
}


def image_tokens(h: int, w: int) -> int:
    """2x2 patches; a non-square latent is padded to max_seq (128 x 128 latent cells: 4096 tokens)."""
    return (h // 2) * (w // 2) if h == w else TRANSFORMER["max_resolution"][0] * TRANSFORMER["max_resolution"][1] // 4


def attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    """4 * S^2 * inner_dim per block, S = image + 3 x text tokens: every block attends over the image, T5's and
    the last Llama layer's states, and its own Llama layer's."""
    layers, inner = cfg.num_layers + cfg.num_single_layers, cfg.num_attention_heads * cfg.attention_head_dim
    return 4.0 * (img + 3 * txt) ** 2 * inner * layers * batch


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    """The forward on the meta device in training mode, each MoE feed-forward run as its shared expert plus
    `num_activated_experts` experts over every token: the Linear work of top-k routing (which indexes by data)."""
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    cfg = model.config
    model.train()  # eval mode's unpatchify reads each sample's size as a Python number, which meta tensors lack
    for moe in (m for m in model.modules() if isinstance(m, MOEFeedForwardSwiGLU)):
        moe.forward = lambda x, moe=moe: moe.shared_experts(x) + sum(
            moe.experts[k](x) for k in range(moe.num_activated_experts))
    return model(hidden_states=empty(b, cfg.in_channels, h, w), timesteps=empty(b, fp32=True),
                 encoder_hidden_states_t5=empty(b, txt, cfg.caption_channels[0]),
                 encoder_hidden_states_llama3=empty(max(cfg.llama_layers) + 1, b, txt, cfg.caption_channels[1]),
                 pooled_embeds=empty(b, cfg.text_emb_dim), return_dict=False)
