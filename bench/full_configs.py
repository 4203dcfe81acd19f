"""Full-size architecture configs of the four families, and random-weight pipelines built from them.

    from bench.full_configs import build_full_pipeline
    build_full_pipeline("flux", "/dev/shm/flux-full", device="cuda")   # ~34 GB of bf16 safetensors

The numbers are the released checkpoints' config.json values (FLUX.1-dev, Qwen-Image,
Z-Image-Turbo, SDXL base 1.0 and their text encoders and VAEs). Weights are random (each
class's own init, on the GPU, in bf16); tokenizers and schedulers come from `stages.tiny` (a
tokenizer's vocabulary is smaller than the model's, which only narrows the ids it emits). The
folder is an ordinary diffusers pipeline, so the stages load it exactly as they load the real one.

`denoiser_flops` counts the forward matmul FLOPs of a denoiser at a training shape by running it
on the meta device with a hook on every Linear (no memory, no GPU), for the MFU in bench/RESULTS.md.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

VARIANT = {"flux": "flux-dev", "qwen-image": "qwen-image", "z-image": "z-image", "sdxl": "sdxl"}

FLUX_DEV_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                            guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, norm_num_groups=32, act_fn="silu", sample_size=1024, scaling_factor=0.3611,
                shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True,
                force_upcast=True)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5)
CLIP_BIGG = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, projection_dim=1280,
                 num_hidden_layers=32, num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu",
                 layer_norm_eps=1e-5)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
              layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
QWEN_IMAGE_TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                              num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                              axes_dims_rope=(16, 56, 56))
QWEN_IMAGE_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True], dropout=0.0)
QWEN2_5_VL_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                          num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                          rms_norm_eps=1e-6, tie_word_embeddings=False,
                          rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0})
QWEN2_5_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                            fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14,
                            spatial_merge_size=2, temporal_patch_size=2, in_chans=3, hidden_act="silu")
Z_IMAGE_TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                           n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True,
                           cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48],
                           axes_lens=[1536, 512, 512])
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=True)
SDXL_UNET = dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                 block_out_channels=(320, 640, 1280), transformer_layers_per_block=(1, 2, 10),
                 attention_head_dim=(5, 10, 20), cross_attention_dim=2048, use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816, norm_num_groups=32, upcast_attention=False)
SDXL_VAE = dict(FLUX_VAE, latent_channels=4, scaling_factor=0.13025, shift_factor=None, use_quant_conv=True,
                use_post_quant_conv=True, mid_block_add_attention=True)


def _ids(tok: Any) -> dict[str, Any]:
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def _clip(tok: Any, cfg: dict[str, Any], projection: bool) -> torch.nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(CLIPTextConfig(**cfg, **_ids(tok)))


def _t5(tok: Any) -> torch.nn.Module:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**T5_XXL, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                   decoder_start_token_id=tok.pad_token_id))


def _qwen2_5_vl(tok: Any) -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tok.convert_tokens_to_ids
    special = {"bos_token_id": ids("<|endoftext|>"), "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={**QWEN2_5_VL_7B_TEXT, **special}, vision_config=QWEN2_5_VL_7B_VISION,
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False, **special))


def _qwen3(tok: Any) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(**QWEN3_4B, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))


def _diffusers(name: str, cfg: dict[str, Any]) -> Callable[[dict[str, Any]], torch.nn.Module]:
    def build(_: dict[str, Any]) -> torch.nn.Module:
        import diffusers

        return getattr(diffusers, name)(**cfg)
    return build


def _qwen_image_vae(_: dict[str, Any]) -> torch.nn.Module:
    from diffusers import AutoencoderKLQwenImage

    from stages.tiny.models import QWEN_IMAGE_LATENTS_MEAN, QWEN_IMAGE_LATENTS_STD

    return AutoencoderKLQwenImage(**QWEN_IMAGE_VAE, latents_mean=list(QWEN_IMAGE_LATENTS_MEAN),
                                  latents_std=list(QWEN_IMAGE_LATENTS_STD))


# family -> component name -> builder(tiny components, for their tokenizers) -> full-size module
FULL: dict[str, dict[str, Callable[[dict[str, Any]], torch.nn.Module]]] = {
    "flux": {
        "transformer": _diffusers("FluxTransformer2DModel", FLUX_DEV_TRANSFORMER),
        "vae": _diffusers("AutoencoderKL", FLUX_VAE),
        "text_encoder": lambda c: _clip(c["tokenizer"], CLIP_L, projection=False),
        "text_encoder_2": lambda c: _t5(c["tokenizer_2"]),
    },
    "qwen-image": {
        "transformer": _diffusers("QwenImageTransformer2DModel", QWEN_IMAGE_TRANSFORMER),
        "vae": _qwen_image_vae,
        "text_encoder": lambda c: _qwen2_5_vl(c["tokenizer"]),
    },
    "z-image": {
        "transformer": _diffusers("ZImageTransformer2DModel", Z_IMAGE_TRANSFORMER),
        "vae": _diffusers("AutoencoderKL", FLUX_VAE),
        "text_encoder": lambda c: _qwen3(c["tokenizer"]),
    },
    "sdxl": {
        "unet": _diffusers("UNet2DConditionModel", SDXL_UNET),
        "vae": _diffusers("AutoencoderKL", SDXL_VAE),
        "text_encoder": lambda c: _clip(c["tokenizer"], CLIP_L, projection=False),
        "text_encoder_2": lambda c: _clip(c["tokenizer_2"], CLIP_BIGG, projection=True),
    },
}
DENOISER = {"flux": "transformer", "qwen-image": "transformer", "z-image": "transformer", "sdxl": "unet"}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_module(family: str, name: str, device: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """One full-size component with random weights, made directly on `device` (meta: no memory)."""
    from stages.tiny.models import build_tiny_components

    tiny = build_tiny_components(VARIANT[family])
    with torch.device(device), default_dtype(dtype):
        return FULL[family][name](tiny).eval()


def build_full_pipeline(family: str, folder: str | Path, device: str = "cuda",
                        dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Build every component at full size on `device` and save_pretrained the pipeline into folder.
    Returns parameter counts (billions) per component."""
    import diffusers

    from stages.tiny.models import PIPELINE_CLASS_NAMES, build_tiny_components

    variant = VARIANT[family]
    tiny = build_tiny_components(variant)
    parts = {k: v for k, v in tiny.items() if not isinstance(v, torch.nn.Module)}  # tokenizers, scheduler
    with torch.device(device), default_dtype(dtype):
        for name, build in FULL[family].items():
            parts[name] = build(tiny).eval()
    counts = {name: sum(p.numel() for p in parts[name].parameters()) / 1e9 for name in FULL[family]}
    extra = {"add_watermarker": False, "force_zeros_for_empty_prompt": True} if family == "sdxl" else {}
    pipe = getattr(diffusers, PIPELINE_CLASS_NAMES[variant])(**parts, **extra)
    Path(folder).mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return counts


# ---- FLOPs for MFU ---------------------------------------------------------------------------------


def denoiser_flops(family: str, batch: int, latent_hw: tuple[int, int], text_tokens: int) -> dict[str, float]:
    """Forward FLOPs of one denoiser call on the meta device: every Linear (2 * in * out per row it
    sees) and the attention products (4 * S^2 * inner_dim per joint-attention layer, S = image +
    text tokens; DiT families only). Also the issue's rule of thumb 2 * params * tokens."""
    model = build_module(family, DENOISER[family], "meta")
    params = sum(p.numel() for p in model.parameters())
    linear = [0]

    def hook(mod: torch.nn.Linear, inputs: tuple[torch.Tensor, ...], _: Any) -> None:
        linear[0] += 2 * (inputs[0].numel() // mod.in_features) * mod.in_features * mod.out_features

    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(hook)
    h, w = latent_hw
    img = (h // 2) * (w // 2)
    with torch.no_grad():
        _meta_forward(family, model, batch, h, w, text_tokens)
    attn = 0.0
    if family == "flux":
        cfg = model.config
        layers, inner = cfg.num_layers + cfg.num_single_layers, cfg.num_attention_heads * cfg.attention_head_dim
        attn = 4.0 * (img + text_tokens) ** 2 * inner * layers * batch
    elif family == "qwen-image":
        cfg = model.config
        attn = 4.0 * (img + text_tokens) ** 2 * cfg.num_attention_heads * cfg.attention_head_dim * cfg.num_layers * batch
    elif family == "z-image":
        cfg = model.config
        s = img + text_tokens
        attn = 4.0 * cfg.dim * batch * (s ** 2 * cfg.n_layers + (img ** 2 + text_tokens ** 2) * cfg.n_refiner_layers)
    tokens = batch * (img + (text_tokens if family != "sdxl" else 0))
    return {"params": float(params), "linear_fwd": float(linear[0]), "attention_fwd": attn,
            "tokens": float(tokens), "rule_of_thumb_fwd": 2.0 * params * tokens}


def _meta_forward(family: str, model: torch.nn.Module, b: int, h: int, w: int, txt: int) -> Any:
    d, bf = "meta", torch.bfloat16
    e = lambda *shape, dtype=bf: torch.empty(*shape, device=d, dtype=dtype)  # noqa: E731
    if family == "flux":
        cfg = model.config
        return model(hidden_states=e(b, (h // 2) * (w // 2), cfg.in_channels), encoder_hidden_states=e(b, txt, cfg.joint_attention_dim),
                     pooled_projections=e(b, cfg.pooled_projection_dim), timestep=e(b), img_ids=e((h // 2) * (w // 2), 3),
                     txt_ids=e(txt, 3), guidance=e(b, dtype=torch.float32), return_dict=False)
    if family == "qwen-image":
        cfg = model.config
        return model(hidden_states=e(b, (h // 2) * (w // 2), cfg.in_channels), encoder_hidden_states=e(b, txt, cfg.joint_attention_dim),
                     encoder_hidden_states_mask=None, timestep=e(b), img_shapes=[[(1, h // 2, w // 2)]] * b,
                     return_dict=False)
    if family == "z-image":
        cfg = model.config
        return model([e(cfg.in_channels, 1, h, w) for _ in range(b)], e(b, dtype=torch.float32),
                     [e(txt, cfg.cap_feat_dim) for _ in range(b)], return_dict=False)
    cfg = model.config
    return model(e(b, cfg.in_channels, h, w), e(b, dtype=torch.long), encoder_hidden_states=e(b, 77, cfg.cross_attention_dim),
                 added_cond_kwargs={"text_embeds": e(b, 1280), "time_ids": e(b, 6)}, return_dict=False)
