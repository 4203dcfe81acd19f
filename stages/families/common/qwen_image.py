"""Qwen-Image: Qwen2.5-VL text states under a chat template, 3-D Wan VAE, 2x2-packed MMDiT; the family
class that `qwen-image` and `qwen-image-edit` share (each adds its text encoder), whose VAE side
Qwen-Image 2.1 and Krea 2 borrow.

Checked against diffusers 0.42.1:
- `pipelines/qwenimage/pipeline_qwenimage.py` `_get_qwen_prompt_embeds` / `encode_prompt`: the
  caption goes into `prompt_template_encode`, the last hidden state of
  Qwen2_5_VLForConditionalGeneration is taken at the non-padding tokens, the first 34 tokens (the
  template's system prefix, `prompt_template_encode_start_idx`) are dropped, the rest is cut to
  `max_sequence_length` and right-padded with a mask.
- `__call__`: latents (B, C, 1, h, w) packed 2x2 like FLUX; `img_shapes = [[(1, h/2, w/2)]] * B`;
  the transformer gets `timestep = t / 1000`, i.e. sigma; `encoder_hidden_states_mask` (None when
  all ones); decode `z = x * latents_std + latents_mean` per channel, so x = (z - mean) / std.
- `models/autoencoders/autoencoder_kl_qwenimage.py`: input (B, 3, T, H, W), posterior a
  DiagonalGaussianDistribution (logvar clamped to [-30, 20]); vae scale 2 ** len(temperal_downsample).
- The scheduler steps `x + (sigma_next - sigma) * pred`, so the flow target is noise - x0.

Captions are stored padded to `max_sequence_length` with their length; a training batch is cut to
its longest caption and the rest masked, so padding never changes an item's loss.
"""

from __future__ import annotations

import math
from typing import Any

from stages.core import flow
from stages.core.comfyui import ComfyLayout
from stages.core.kohya import GENERIC as KOHYA_LAYOUT
from stages.core.lazy import lazy_module, no_grad
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.families.base import BatchMeta, FamilyTraits
from stages.families.common.channel_norm import ChannelNormalized
from stages.families.text_encoders import trim_to_longest

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

DROP_IDX = 34  # QwenImagePipeline.prompt_template_encode_start_idx: the system prefix's token count
# FlowMatchEulerDiscreteScheduler config of Qwen/Qwen-Image: the resolution-dependent shift's range.
SHIFT_BASE_SEQ_LEN, SHIFT_MAX_SEQ_LEN, SHIFT_BASE, SHIFT_MAX = 256, 8192, 0.5, 0.9
# Qwen-Image (and Qwen-Image-Edit) as ComfyUI loads it: its weights keep diffusers' module paths, and its
# key map accepts each path bare, after `transformer.` and as `lycoris_<path with _>`.
COMFYUI_LAYOUT = ComfyLayout("qwen_image", same_names=True)


class QwenImageBase(ChannelNormalized, FamilyTraits):
    """Qwen-Image less its text encoder (`load_text_encoder`), which each family using it adds."""

    fp8_faster_from_tokens = 4173  # 1024 px b1, 77-token captions: fp8 0.91x bf16's step (512 px b1: 1.11x)
    pipeline_class = "QwenImagePipeline"
    captions_cut_to_longest = True
    text_padded_to_longest = True
    lora_prefix = "transformer"
    denoiser_class = "QwenImageTransformer2DModel"
    vae_class = "AutoencoderKLQwenImage"
    # Joint attention of the image and text streams (diffusers' Qwen-Image LoRA example uses the same four).
    default_lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
    # Qwen2_5_VLForConditionalGeneration builds its language and vision sub-models as PreTrainedModels too.
    text_component_classes = ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel", "Qwen2_5_VLTextModel",
                              "Qwen2_5_VisionTransformerPretrainedModel")
    text_components = ("tokenizer", "text_encoder")
    text_offload_components = ("text_encoder",)  # loaded by text_encoders.load_text_model: the planner may offload its layers
    vae_components = ("vae",)
    denoiser_components = ("transformer",)
    kohya_layout = KOHYA_LAYOUT
    comfyui_layout = COMFYUI_LAYOUT

    # ---- cache-latents
    def load_vae(self, src: Any, rt: Any) -> torch.nn.Module:
        from diffusers import AutoencoderKLQwenImage

        return src.load(AutoencoderKLQwenImage, "vae", torch_dtype=rt.dtype).to(rt.device).eval()

    def pixel_multiple(self, src: Any) -> int:
        downsample = src.component_config("vae")["temperal_downsample"]
        return 2 ** len(downsample) * 2  # QwenImagePipeline.vae_scale_factor x 2x2 packing

    @no_grad
    def encode_posterior(self, vae: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        video = pixels.to(vae.device, vae.dtype).unsqueeze(2)  # one frame: (B, 3, 1, H, W)
        dist = vae.encode(video).latent_dist  # logvar clamped to [-30, 20] by DiagonalGaussianDistribution
        return dist.mean.squeeze(2), dist.logvar.squeeze(2)

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from diffusers import QwenImageTransformer2DModel

        return load_denoiser_weights(QwenImageTransformer2DModel, src, "transformer", precision, rt, tcfg.nf4_double_quant)

    def sample_timesteps(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator, tcfg: Any,
                         first: int | None = None) -> torch.Tensor:
        u = flow.draw_u(n, generator, tcfg, first)
        shift = tcfg.shift
        if tcfg.dynamic_shift:  # Qwen-Image's own range (not FLUX's 0.5..1.15 over 256..4096 tokens)
            seq_len = (latent_hw[0] // 2) * (latent_hw[1] // 2)
            shift = math.exp(flow.dynamic_shift_mu(seq_len, SHIFT_BASE_SEQ_LEN, SHIFT_MAX_SEQ_LEN, SHIFT_BASE, SHIFT_MAX))
        return flow.lookup_sigmas(u, flow.sigma_table(shift))

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        b, _, h, w = x0.shape
        dtype, device = base_dtype(denoiser), x0.device
        text, mask = trim_to_longest(cond["prompt_embeds"].to(device, dtype), cond["prompt_length"], meta.text_multiple)
        guidance = None
        if denoiser.config.guidance_embeds:
            guidance = torch.full((b,), tcfg.guidance_scale, device=device, dtype=torch.float32)
        pred = denoiser(
            hidden_states=flow.pack_2x2(flow.noisy_latents(x0, noise, t)).to(dtype),
            timestep=t.to(device, dtype),  # the pipeline passes t / 1000 = sigma
            guidance=guidance,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,  # as encode_prompt: None if all ones
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return flow.per_sample_loss(flow.unpack_2x2(pred, h, w), flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)
