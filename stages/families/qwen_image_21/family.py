"""Qwen-Image 2.1: Qwen3-VL text states, a 16x RGBA VAE with 64 channels, a block-causal single-stream DiT.

Checked against diffusers 0.42.1:
- `pipelines/qwenimage21/pipeline_qwenimage21.py` `_get_qwen_prompt_embeds` / `encode_prompt`: an
  empty caption becomes " "; the caption goes into `prompt_template_t2i` (system prompt "Comprehend
  and analyze the provided prompt."), the batch is tokenized with `padding_side="left"`;
  Qwen3VLForConditionalGeneration's `hidden_states[-1]` is taken with the final RMSNorm bypassed (a
  forward hook returning its input: the last decoder layer's output, which the transformer was
  trained on); the states at the unmasked tokens are kept, minus the system prefix
  (`_drop_idx` = the token count of the chat-templated system message), right-padded with a
  mask that is None when all ones. The pipeline truncates nothing. Its left padding gives a short
  caption in a batch shifted positions; we pass positions counted over each caption's own tokens,
  so every cached row equals the pipeline's encoding of that caption alone (the test checks it).
- `__call__` (text to image): latents (B, 64, h, w) flattened to (B, h*w, 64) (`_pack_latents`, no
  patching); `img_mask` = the prompt's image-slot mask (all False without condition images) plus
  h*w/4 True slots; `img_shapes = [[(1, h, w)]] * B`; `timestep = t / 1000`, i.e. sigma; only the
  last h*w output tokens are the prediction; mu = calculate_shift(h*w, ...) from the scheduler
  config with defaults 256 / 4096 / 0.5 / 1.15; decode `z = x * latents_std + latents_mean`.
- `models/autoencoders/autoencoder_kl_qwenimage21.py`: input (B, 4, T, H, W), RGBA (the pipeline
  converts images with `img.convert("RGBA")`, so an opaque image has alpha +1 in [-1, 1]); the
  posterior a DiagonalGaussianDistribution (logvar clamped to [-30, 20]).
- `models/transformers/transformer_qwenimage21.py`: no guidance embedding and no distilled variant;
  text tokens are modulated from t = 0 (`causal_condition`). Training calls it with the sequence
  layout built once per shape (`denoiser.py`: the stock forward syncs with the GPU, so no CUDA graph
  could capture it). The scheduler steps
  `x + (sigma_next - sigma) * pred`, so the flow target is noise - x0.

Captions are stored padded with their lengths. A batch is LEFT-padded to its longest caption and
masked: the RoPE frame position of the image follows the (padded) text, so right padding would move
a short caption's image relative to its words; left padding keeps every caption at the distance it
has alone, which is what the pipeline does for a batch of one (no padding).
"""

from __future__ import annotations

from typing import Any

from stages.core import flow
from stages.core.lazy import lazy_module, no_grad
from stages.families.qwen_image_21.comfyui import LAYOUT as COMFYUI_LAYOUT
from stages.core.kohya import GENERIC as KOHYA_LAYOUT
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.families.base import BatchMeta, FamilyTraits
from stages.families.common.channel_norm import ChannelNormalized
from stages.families.common.qwen_image import QwenImageBase
from stages.families.qwen_image_21 import ROPE_POSITIONS
from stages.families.text_encoders import load_text_model, pad_valid_tokens, require_max_length, require_tokens

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
SYSTEM_PREFIX = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"  # the chat template's system message
PROMPT_TEMPLATE = SYSTEM_PREFIX + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
VAE_SCALE_FACTOR = 16  # QwenImage21Pipeline.vae_scale_factor, fixed in its __init__
IMG_TOKENS_PER_SLOT = 4  # transformer_qwenimage21._IMG_TOKENS_PER_SLOT: one slot per 2x2 latent tokens
LAYOUT_CACHE = 16  # (caption length, h, w) layouts kept: buckets times caption lengths in a batch


class QwenImage21TextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        require_max_length(cfg, ROPE_POSITIONS - 1, "Qwen-Image 2.1")
        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.tokenizer = src.load(AutoTokenizer, "processor")  # only the processor's text side is needed
        self.drop = len(self.tokenizer(SYSTEM_PREFIX).input_ids)
        self.model = load_text_model(Qwen3VLForConditionalGeneration, src, "text_encoder", cfg, rt)

    def _prompts(self, texts: list[str]) -> list[str]:
        return [PROMPT_TEMPLATE.format(t or " ") for t in texts]  # Qwen has no bos: never an empty caption

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        # Truncating at max_len + the prefix keeps the first max_len states: the decoder is causal.
        tokens = self.tokenizer(self._prompts(texts), padding=True, padding_side="left", truncation=True,
                                max_length=self.max_len + self.drop, return_tensors="pt").to(self.device)
        inner = self.model.model
        norm = getattr(inner, "language_model", inner).norm
        handle = norm.register_forward_hook(lambda module, args, output: args[0])  # as the pipeline: pre-norm states
        # Positions counted over each caption's own tokens, so left padding shifts none: a row is the
        # pipeline's encoding of that caption alone, whatever else shares its encode batch.
        positions = (tokens.attention_mask.cumsum(-1) - 1).clamp(min=0)
        try:
            out = self.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, position_ids=positions,
                             output_hidden_states=True)
        finally:
            handle.remove()
        return pad_valid_tokens(out.hidden_states[-1], tokens.attention_mask, self.drop, self.max_len)

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(ids) - self.drop for ids in self.tokenizer(self._prompts(texts), truncation=False).input_ids]


def left_padded(embeds: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored right-padded rows (B, L, D) -> (B, longest, D) with each caption at the right end, and
    its mask (B, longest) bool."""
    require_tokens([int(lengths.min())])
    longest = int(lengths.max())
    lengths = lengths.to(embeds.device)
    pos = torch.arange(longest, device=embeds.device)[None, :]
    mask = pos >= (longest - lengths)[:, None]
    src = (pos - (longest - lengths)[:, None]).clamp(min=0)
    text = torch.gather(embeds[:, :longest], 1, src[..., None].expand(-1, -1, embeds.shape[-1]))
    return text * mask[..., None].to(text.dtype), mask


def joint_img_mask(b: int, text_len: int, image_tokens: int, device: torch.device) -> torch.Tensor:
    """The pipeline's `img_mask` without condition images: text slots, then one slot per 2x2 latent tokens."""
    return torch.cat([torch.zeros(b, text_len, dtype=torch.bool, device=device),
                      torch.ones(b, image_tokens // IMG_TOKENS_PER_SLOT, dtype=torch.bool, device=device)], dim=1)


class QwenImage21(ChannelNormalized, FamilyTraits):
    name = "qwen-image-2.1"
    title = "Qwen-Image 2.1"
    vae_downsample = 16
    pipeline_class = "QwenImage21Pipeline"
    lora_prefix = "transformer"
    denoiser_class = "QwenImage21Transformer2DModel"
    vae_class = "AutoencoderKLQwenImage21"
    # The single stream's attention (text and image share these projections).
    default_lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
    text_component_classes = ("Qwen3VLForConditionalGeneration", "Qwen3VLModel", "Qwen3VLTextModel",
                              "Qwen3VLVisionModel")
    text_components = ("processor", "text_encoder")
    text_padded_to_longest = True
    text_offload_components = ("text_encoder",)  # loaded by text_encoders.load_text_model: the planner may offload its layers
    # 1024 px b1, 77-token captions: fp8 2.633 samples/s at 8.98 GB against bf16 2.136 at 15.47 in the same run (0.81x its
    # step; bench/results/bench-qwen-image-2.1-I8.json)
    fp8_faster_from_tokens = 4173
    vae_components = ("vae",)
    denoiser_components = ("transformer",)
    kohya_layout = KOHYA_LAYOUT
    comfyui_layout = COMFYUI_LAYOUT


    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> QwenImage21TextEncoder:
        return QwenImage21TextEncoder(src, cfg, rt)

    # ---- cache-latents
    def load_vae(self, src: Any, rt: Any) -> torch.nn.Module:
        from diffusers import AutoencoderKLQwenImage21

        return src.load(AutoencoderKLQwenImage21, "vae", torch_dtype=rt.dtype).to(rt.device).eval()

    def pixel_multiple(self, src: Any) -> int:
        return VAE_SCALE_FACTOR * 2  # the pipeline rounds sides to this: even latent sides fill whole slots

    @no_grad
    def encode_posterior(self, vae: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = pixels.to(vae.device, vae.dtype)
        b, _, h, w = pixels.shape
        alpha = pixels.new_ones(b, vae.config.in_channels - pixels.shape[1], h, w)  # opaque RGBA: alpha +1
        dist = vae.encode(torch.cat([pixels, alpha], dim=1).unsqueeze(2)).latent_dist  # one frame
        return dist.mean.squeeze(2), dist.logvar.squeeze(2)

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from stages.families.qwen_image_21.denoiser import QwenImage21Trainable

        return load_denoiser_weights(QwenImage21Trainable, src, "transformer", precision, rt, tcfg.nf4_double_quant)

    def _layout(self, denoiser: Any, text_len: int, h: int, w: int, device: torch.device) -> dict[str, Any]:
        """denoiser.py's `layout` for this shape, built once (its values never change)."""
        from stages.families.qwen_image_21.denoiser import layout

        cache = self.__dict__.setdefault("_layouts", {})
        rope = denoiser.pos_embed
        key = (text_len, h, w, str(device), rope.theta, tuple(rope.axes_dim))
        if key not in cache:
            if len(cache) >= LAYOUT_CACHE:
                cache.pop(next(iter(cache)))
            cache[key] = layout(denoiser, text_len, h, w, device)
        return cache[key]

    def sample_timesteps(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator, tcfg: Any,
                         first: int | None = None) -> torch.Tensor:
        # One token per latent pixel (no 2x2 packing): the shift's sequence length is h * w.
        return flow.sample_flow_sigmas(n, latent_hw[0] * latent_hw[1], generator, tcfg, first)

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        from stages.families.qwen_image_21.denoiser import QwenImage21Trainable

        b, c, h, w = x0.shape
        dtype, device = base_dtype(denoiser), x0.device
        text, mask = left_padded(cond["prompt_embeds"].to(device, dtype), cond["prompt_length"])
        kwargs = {"hidden_states": flow.noisy_latents(x0, noise, t).flatten(2).transpose(1, 2).to(dtype),  # _pack_latents
                  "encoder_hidden_states": text, "encoder_hidden_states_mask": None if bool(mask.all()) else mask,
                  "timestep": t.to(device, dtype)}  # the pipeline passes t / 1000 = sigma
        if isinstance(getattr(denoiser, "model", denoiser), QwenImage21Trainable):  # the train stage's (maybe graphed)
            # The pipeline's img_shapes and img_mask below, as the layout they make (denoiser.py: the stock
            # forward waits on the GPU, so no CUDA graph could capture it).
            kwargs["layout"] = self._layout(denoiser, text.shape[1], h, w, device)
        else:  # a pipeline's own transformer (the export check loads one): the pipeline's call
            kwargs.update(img_shapes=[[(1, h, w)]] * b, img_mask=joint_img_mask(b, text.shape[1], h * w, device),
                          return_dict=False)
        pred = denoiser(**kwargs)[0][:, -h * w:]  # the target image's tokens, as the pipeline slices them
        return flow.per_sample_loss(pred.transpose(1, 2).reshape(b, c, h, w), flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)
