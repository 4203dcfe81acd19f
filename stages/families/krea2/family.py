"""Krea 2: Qwen3-VL states tapped at several layers, the Qwen-Image VAE, a single-stream MMDiT.

Checked against diffusers 0.42.1:
- `pipelines/krea2/pipeline_krea2.py` `get_text_hidden_states` / `encode_prompt`: the caption goes
  after the Qwen-Image system prefix, is truncated and padded to `max_sequence_length + 34 - 5`
  tokens, and the 5-token assistant suffix is appended after the padding; positions count valid
  tokens only (`cumsum(mask) - 1`, the same on the 3 mRoPE axes); `hidden_states[i]` of Qwen3VLModel
  for each i in the pipeline's `text_encoder_select_layers` (model_index.json) are stacked per token
  (B, L, layers, D); the first 34 positions (the system prefix) are dropped; a bool mask marks the
  valid tokens.
- `models/transformers/transformer_krea2.py`: text positions are all zero (`prepare_position_ids`),
  padded text tokens are masked as attention keys everywhere and the layer-wise text fusion works per
  token, so the image tokens' output depends only on the valid text tokens, not on where the padding
  sits. Captions are therefore stored as their valid tokens (caption + suffix) zero-padded with a
  length, and a training batch is cut to its longest caption and masked. The transformer takes
  `timestep = t / 1000` = sigma and predicts the velocity the scheduler steps with (noise - x0);
  latents are packed 2x2 exactly as `_pack_latents`, image position ids (0, row, col).
- `__call__` decode: `latents / (1 / latents_std) + latents_mean` per channel, then the Qwen-Image VAE
  on one frame; so x = (z - mean) / std (the VAE methods are Qwen-Image's, shared below).
- Shift: `calculate_shift(image_seq_len, 256, 6400, 0.5, 1.15)` from the scheduler config (exponential
  time shift, shift = exp(mu)); the distilled (Turbo, `is_distilled=True`) checkpoint uses a fixed
  mu = 1.15 instead. No guidance embedding: Base (Raw) samples with two forwards (CFG), Turbo with
  one; a training step is one conditional forward for both. Krea's guidance is to train on Base/Raw.
"""

from __future__ import annotations

import math
from typing import Any

from stages.core import flow
from stages.core.lazy import lazy_module, no_grad
from stages.families.krea2.comfyui import LAYOUT as COMFYUI_LAYOUT
from stages.core.kohya import GENERIC as KOHYA_LAYOUT
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.families.base import BatchMeta, FamilyTraits
from stages.families.common.channel_norm import ChannelNormalized
from stages.families.krea2 import SUFFIX_TOKENS
from stages.families.common.qwen_image import DROP_IDX, QwenImageBase
from stages.families.text_encoders import load_text_model, pad_valid_tokens, trim_to_longest

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

PROMPT_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
PROMPT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
# Krea2Pipeline's defaults and the scheduler settings its docstring asks for (resolution-aware shift).
SHIFT_BASE_SEQ_LEN, SHIFT_MAX_SEQ_LEN, SHIFT_BASE, SHIFT_MAX = 256, 6400, 0.5, 1.15
# Krea2Pipeline's taps when model_index.json sets none: 12 of Qwen3-VL-4B's 37 hidden states.
DEFAULT_SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)


class Krea2TextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import AutoTokenizer, Qwen3VLModel

        self.device, self.max_len = rt.device, cfg.max_sequence_length
        index = src.component_config("", "model_index.json")
        self.layers = tuple(index.get("text_encoder_select_layers") or DEFAULT_SELECT_LAYERS)
        self.tokenizer = src.load(AutoTokenizer, "tokenizer")
        self.model = load_text_model(Qwen3VLModel, src, "text_encoder", cfg, rt)

    def _tokens(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """[prefix | caption | padding | suffix] ids and bool mask, as get_text_hidden_states builds them."""
        text = self.tokenizer([PROMPT_PREFIX + t for t in texts], truncation=True, padding="max_length",
                              max_length=self.max_len + DROP_IDX - SUFFIX_TOKENS, return_tensors="pt")
        suffix = self.tokenizer([PROMPT_SUFFIX] * len(texts), return_tensors="pt")
        ids = torch.cat([text.input_ids, suffix.input_ids], dim=1)
        return ids.to(self.device), torch.cat([text.attention_mask, suffix.attention_mask], dim=1).bool().to(self.device)

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        ids, mask = self._tokens(texts)
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        hidden = torch.stack([out.hidden_states[i] for i in self.layers], dim=2)  # (B, L, layers, D)
        return pad_valid_tokens(hidden[:, DROP_IDX:], mask[:, DROP_IDX:], 0, self.max_len)

    def token_counts(self, texts: list[str]) -> list[int]:
        ids = self.tokenizer([PROMPT_PREFIX + t for t in texts], truncation=False).input_ids
        return [len(i) - DROP_IDX + SUFFIX_TOKENS for i in ids]


class Krea2(ChannelNormalized, FamilyTraits):
    name = "krea2"
    title = "Krea 2"
    pipeline_class = "Krea2Pipeline"
    captions_cut_to_longest = True
    lora_prefix = "transformer"
    denoiser_class = "Krea2Transformer2DModel"
    vae_class = "AutoencoderKLQwenImage"
    # Self-attention of the 28 single-stream blocks and of the 4 text-fusion blocks (same module names).
    default_lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
    # Qwen3VLModel builds its language and vision sub-models as PreTrainedModels too.
    text_component_classes = ("Qwen3VLModel", "Qwen3VLTextModel", "Qwen3VLVisionModel")
    text_components = ("tokenizer", "text_encoder")
    text_offload_components = ("text_encoder",)  # loaded by text_encoders.load_text_model: the planner may offload its layers
    # 1024 px b1, 77-token captions: fp8 1.256 samples/s at 15.72 GB against bf16 1.049 at 27.02 (0.84x its step;
    # bench/results/bench-krea2-I9.json, -I5.json)
    fp8_faster_from_tokens = 4173
    vae_components = ("vae",)
    denoiser_components = ("transformer",)
    kohya_layout = KOHYA_LAYOUT
    comfyui_layout = COMFYUI_LAYOUT

    # ---- cache-latents: Krea2Pipeline uses the Qwen-Image VAE exactly as QwenImagePipeline does
    load_vae = QwenImageBase.load_vae
    pixel_multiple = QwenImageBase.pixel_multiple  # vae_scale_factor x patch_size 2
    encode_posterior = QwenImageBase.encode_posterior

    def __init__(self) -> None:
        self._positions: dict[tuple, torch.Tensor] = {}

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> Krea2TextEncoder:
        return Krea2TextEncoder(src, cfg, rt)

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from diffusers import Krea2Transformer2DModel

        return load_denoiser_weights(Krea2Transformer2DModel, src, "transformer", precision, rt, tcfg.nf4_double_quant)

    def sample_timesteps(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator, tcfg: Any,
                         first: int | None = None) -> torch.Tensor:
        u = flow.draw_u(n, generator, tcfg, first)
        shift = tcfg.shift
        if tcfg.dynamic_shift:  # Krea 2's range: 0.5..1.15 over 256..6400 image tokens (FLUX: ..4096)
            seq_len = (latent_hw[0] // 2) * (latent_hw[1] // 2)
            shift = math.exp(flow.dynamic_shift_mu(seq_len, SHIFT_BASE_SEQ_LEN, SHIFT_MAX_SEQ_LEN, SHIFT_BASE, SHIFT_MAX))
        return flow.lookup_sigmas(u, flow.sigma_table(shift))

    def position_ids(self, text_len: int, h: int, w: int, device: torch.device) -> torch.Tensor:
        """(text_len + h/2 * w/2, 3): text rows zero, image rows (0, row, col); built once per shape."""
        key = (text_len, h, w, device)
        if key not in self._positions:
            image = torch.zeros(h // 2, w // 2, 3)
            image[..., 1] = torch.arange(h // 2)[:, None]
            image[..., 2] = torch.arange(w // 2)[None, :]
            self._positions[key] = torch.cat([torch.zeros(text_len, 3), image.reshape(-1, 3)]).to(device)
        return self._positions[key]

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        _, _, h, w = x0.shape
        dtype, device = base_dtype(denoiser), x0.device
        text, mask = trim_to_longest(cond["prompt_embeds"].to(device, dtype), cond["prompt_length"], meta.text_multiple)
        pred = denoiser(
            hidden_states=flow.pack_2x2(flow.noisy_latents(x0, noise, t)).to(dtype),
            encoder_hidden_states=text,
            timestep=t.to(device, dtype),  # the pipeline passes t / 1000 = sigma
            position_ids=self.position_ids(text.shape[1], h, w, device),
            encoder_attention_mask=mask,  # the pipeline always passes its bool mask
            return_dict=False,
        )[0]
        return flow.per_sample_loss(flow.unpack_2x2(pred, h, w), flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)
