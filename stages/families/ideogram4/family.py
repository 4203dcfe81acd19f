"""Ideogram 4: Qwen3-VL-8B states of 13 layers per token, FLUX.2's VAE with batch-norm statistics, one
single-stream DiT over [text | image] tokens with MRoPE, trained with a logit-normal, resolution-shifted
schedule. LoRA trains the conditional `transformer`; the `unconditional_transformer` (asymmetric CFG) stays
as it is.

Checked against diffusers 0.42.1 `pipelines/ideogram4/pipeline_ideogram4.py`:
- `encode_prompt`: each caption as the user turn `[{"type": "text", "text": caption}]` of the tokenizer's
  chat template with the generation prompt, tokenized without special tokens, left-padded; positions count
  from 0 at the first caption token, the same on the 3 MRoPE axes; `_get_text_encoder_hidden_states` (called
  here, not copied) runs the language model's layers and taps the outputs of layers
  QWEN3_VL_ACTIVATION_LAYERS = (0, 3, ..., 33, 35), stacked per token as (D, 13) flattened (feature
  d * 13 + k), zeroed on padding. A caption's features do not depend on the padding (causal attention, the
  padding masked, positions from its first token), so rows are stored as the caption's own tokens, zero-padded
  on the right with a length.
- `_prepare_ids` (called here): a batch is laid out [left padding | text | image] over its longest caption T:
  text positions (n, n, n), image positions (0, row, col) + 65536, segment 1 for text and image, -1 for the
  padding, which attends only to itself; the image tokens therefore see the same sequence at any T, so a batch
  is cut to its longest caption (the pipeline pads to 2048).
- latents: the VAE posterior patchified 2x2 with channel order (row, col, c) (the decode's
  `permute(0, 5, 1, 3, 2, 4)`), normalized with the VAE's batch-norm running statistics over those 128
  channels; the cache keeps the raw posterior, `normalize_latents` applies the statistics unpatchified.
- the transformer gets `timestep = 1 - sigma` (model time: 0 noise, 1 data) and text-padding rows of zero
  latents; its image rows predict v with x_{sigma - d} = x_sigma + d * v (the scheduler steps with -v), so
  v = x0 - noise: the loss compares -v with noise - x0.
- sigmas: `_logit_normal_sigmas`: sigma = sigmoid(mu + std * z) with mu = base + 0.5 * log(pixels / 512^2),
  std 1.5, clamped to log-SNR [-15, 18]. A shift of the logit by log(s) is the scheduler's static shift s, so
  `train.dynamic_shift` trains at shift sqrt(pixels) / 512 with logit-normal draws of std train.logit_std
  (the preset's 1.5); sigmas are continuous, not looked up in a 1000-step table.

diffusers' examples/dreambooth/train_dreambooth_lora_ideogram4.py trains the same: sigma ~ sigmoid(N(mu + 0.5
log(pixels / 512^2), 1.5)) continuous, target x0 - noise against the prediction, MSE, no loss weighting,
`timestep = 1 - sigma`. It does not clamp sigma to the pipeline's range (a difference below 1e-8 of the draws
at std 1.5), pads every caption to max_sequence_length (2048 by default) and runs the text norm and
projection over the whole sequence.
"""

from __future__ import annotations

import math
from typing import Any

from stages.core import flow
from stages.core.kohya import GENERIC as KOHYA_LAYOUT
from stages.core.lazy import lazy_module, no_grad
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.families.base import BatchMeta, FamilyTraits
from stages.families.common.patch_bn import PatchBatchNormalized
from stages.families.ideogram4.comfyui import LAYOUT as COMFYUI_LAYOUT
from stages.families.text_encoders import load_chat_tokenizer, load_text_model, pad_valid_tokens, trim_to_longest

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

# The pipeline's clamp of model time t = 1 - sigma to log-SNR [-15, 18] (`_logit_normal_sigmas`).
SIGMA_MIN, SIGMA_MAX = 1 / (1 + math.exp(7.5)), 1 / (1 + math.exp(-9.0))
BASE_PIXELS = 512 * 512  # `_resolution_aware_mu`'s base resolution


def messages(text: str) -> list[dict[str, Any]]:
    """The pipeline's chat turn for one caption."""
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


class Ideogram4TextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import Qwen3VLModel

        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.tokenizer = load_chat_tokenizer(src, "Ideogram 4")
        self.model = load_text_model(Qwen3VLModel, src, "text_encoder", cfg, rt)

    def _ids(self, texts: list[str]) -> list[list[int]]:
        """Each caption's template tokens as the pipeline tokenizes them (no special tokens added)."""
        prompts = [self.tokenizer.apply_chat_template(messages(t), add_generation_prompt=True, tokenize=False)
                   for t in texts]
        return self.tokenizer(prompts, add_special_tokens=False).input_ids

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """{"prompt_embeds": (B, max_len, 13 D) each caption's features from row 0, "prompt_length": (B,)};
        a caption over max_len tokens keeps its first max_len (the pipeline refuses it)."""
        from diffusers import Ideogram4Pipeline

        rows = [ids[: self.max_len] for ids in self._ids(texts)]
        longest = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask, positions = torch.zeros_like(ids), torch.zeros_like(ids)
        for b, row in enumerate(rows):  # left-padded as encode_prompt: the features do not depend on it
            ids[b, longest - len(row):] = torch.tensor(row)
            mask[b, longest - len(row):] = 1
            positions[b, longest - len(row):] = torch.arange(len(row))
        device = self.device
        taps = Ideogram4Pipeline._get_text_encoder_hidden_states(self.model, ids.to(device), mask.to(device),
                                                                 positions.to(device))
        features = torch.stack(taps, dim=0).permute(1, 2, 3, 0).flatten(2)  # (B, L, D * 13), feature d * 13 + k
        features = features * mask.to(device, features.dtype).unsqueeze(-1)
        return pad_valid_tokens(features, mask.to(device), 0, self.max_len)

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self._ids(texts)]


def pack(z: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4 C) with channel order (row, col, c), as the pipeline's tokens."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack` for latent height h and width w (the pipeline's decode)."""
    b, _, d = tokens.shape
    c = d // 4
    return tokens.view(b, h // 2, w // 2, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)


class Ideogram4(PatchBatchNormalized, FamilyTraits):
    name = "ideogram4"
    title = "Ideogram 4"
    pipeline_class = "Ideogram4Pipeline"
    captions_cut_to_longest = True
    lora_prefix = "transformer"
    denoiser_class = "Ideogram4Transformer2DModel"
    vae_class = "AutoencoderKLFlux2"
    # diffusers' train_dreambooth_lora_ideogram4.py's default targets: each block's attention and SwiGLU MLP
    default_lora_targets = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                            "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    # Qwen3VLModel builds its language and vision sub-models as PreTrainedModels too.
    text_component_classes = ("Qwen3VLModel", "Qwen3VLTextModel", "Qwen3VLVisionModel")
    text_components = ("tokenizer", "text_encoder")
    text_offload_components = ("text_encoder",)  # loaded by text_encoders.load_text_model: the planner may offload its layers
    vae_components = ("vae",)
    denoiser_components = ("transformer",)
    # fitted to the H200 row at 1024 px under --vram 16 (fp8, every block checkpointed): its eager step worked in
    # 2.96 GB of activations (the LoRA's gradients with them) where the default 24 units planned 2.39
    # (bench/results/ideogram4/)
    block_work_units = 41.0
    sample_components = ("unconditional_transformer",)  # the pipeline's CFG branch: sampled with, never trained
    kohya_layout = KOHYA_LAYOUT  # sd-scripts has no Ideogram 4 layout: the diffusers paths
    comfyui_layout = COMFYUI_LAYOUT
    fp8_faster_from_tokens = 4173  # 1024 px, 77-token captions, on an H100: fp8 0.87x bf16's step (batch 4: 0.88x)

    def __init__(self) -> None:
        self._layouts: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> Ideogram4TextEncoder:
        return Ideogram4TextEncoder(src, cfg, rt)

    # ---- cache-latents
    def load_vae(self, src: Any, rt: Any) -> torch.nn.Module:
        from diffusers import AutoencoderKLFlux2

        return src.load(AutoencoderKLFlux2, "vae", torch_dtype=rt.dtype).to(rt.device).eval()

    def pixel_multiple(self, src: Any) -> int:
        blocks = src.component_config("vae")["block_out_channels"]
        return 2 ** (len(blocks) - 1) * 2  # the pipeline's vae_scale_factor x its patch size 2

    @no_grad
    def encode_posterior(self, vae: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        return dist.mean, dist.logvar  # logvar already clamped to [-30, 20] by DiagonalGaussianDistribution

    def patch_stats(self, x: torch.Tensor, values: list[float]) -> torch.Tensor:
        """Ideogram 4's batch norm lists the packed channels in (row, col, c) order (`pack`)."""
        c = len(values) // 4
        stats = torch.tensor(values, device=x.device, dtype=x.dtype).view(2, 2, c).permute(2, 0, 1)
        return stats.reshape(1, c, 1, 2, 1, 2)

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from stages.families.ideogram4.denoiser import Ideogram4Trainable

        return load_denoiser_weights(Ideogram4Trainable, src, "transformer", precision, rt, tcfg.nf4_double_quant)

    def shift(self, latent_hw: tuple[int, int], tcfg: Any) -> float:
        """train.shift, or with train.dynamic_shift the pipeline's resolution shift exp(0.5 log(pixels / 512^2))."""
        if not tcfg.dynamic_shift:
            return tcfg.shift
        pixels = latent_hw[0] * latent_hw[1] * self.vae_downsample ** 2
        return math.exp(0.5 * math.log(pixels / BASE_PIXELS))

    def sigmas(self, u: torch.Tensor, latent_hw: tuple[int, int], tcfg: Any) -> torch.Tensor:
        """u (timestep 1 - u before the shift) -> sigma, shifted and clamped as `_logit_normal_sigmas`."""
        return flow.shift_sigmas(1 - u.double(), self.shift(latent_hw, tcfg)).clamp(SIGMA_MIN, SIGMA_MAX).float()

    def sample_timesteps(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator, tcfg: Any,
                         first: int | None = None) -> torch.Tensor:
        return self.sigmas(flow.draw_u(n, generator, tcfg, first), latent_hw, tcfg)

    def layout(self, lengths: list[int], grid: tuple[int, int], longest: int, device: torch.device) -> tuple:
        """(position_ids, segment_ids, indicator) of the packed [padding | text | image] sequence, from the
        pipeline's own `_prepare_ids`, built once per shape."""
        key = (tuple(lengths), grid, longest, device)
        if key not in self._layouts:
            from diffusers import Ideogram4Pipeline

            self._layouts[key] = Ideogram4Pipeline._prepare_ids(lengths, *grid, longest, device)
        return self._layouts[key]

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        b, _, h, w = x0.shape
        dtype, device = base_dtype(denoiser), x0.device
        lengths = cond["prompt_length"].tolist()
        text, _ = trim_to_longest(cond["prompt_embeds"].to(device, dtype), cond["prompt_length"], meta.text_multiple)
        longest = text.shape[1]
        left = torch.zeros_like(text)  # each caption right-aligned in the text rows, as the pipeline pads
        for i, n in enumerate(lengths):
            left[i, longest - n:] = text[i, :n]
        positions, segments, indicator = self.layout(lengths, (h // 2, w // 2), longest, device)
        tokens = pack(flow.noisy_latents(x0, noise, t))
        if hasattr(denoiser, "text_prefix_forward"):  # Ideogram4Trainable: text rows only, no mask for one segment
            segments = segments if min(lengths) < longest else None
        else:  # the stock forward (a pipeline's transformer): text features as long as the sequence
            left = torch.cat([left, left.new_zeros(b, tokens.shape[1], left.shape[2])], dim=1)
        pred = denoiser(
            hidden_states=torch.cat([tokens.new_zeros(b, longest, tokens.shape[2]), tokens], dim=1).to(dtype),
            timestep=(1 - t.float()).to(device, dtype),  # model time, from the float32 sigma as the pipeline
            encoder_hidden_states=left,
            position_ids=positions,
            segment_ids=segments,
            indicator=indicator,
            return_dict=False,
        )[0][:, longest:]
        # the model predicts x0 - noise (the scheduler steps with its negation)
        return flow.per_sample_loss(unpack(-pred, h, w), flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)

    # ---- sample
    def sample_kwargs(self, pipe: Any, prompts: list[str], scale: float, steps: int) -> dict[str, Any]:
        """Ideogram4Pipeline takes a guidance_scale or a guidance_schedule, never both: sample.guidance_scale
        (>= 0) as a constant scale, else the pipeline's recommended schedule (7.0, the last 3 steps 3.0) at
        sample.steps. Its text padding (2048 by default) is cut to the longest prompt, which changes no image
        (the padding is a segment of its own) and saves most of the text encoder's work."""
        polish = min(3, steps - 1)
        guidance = ({"guidance_scale": scale, "guidance_schedule": None} if scale >= 0 else
                    {"guidance_scale": None, "guidance_schedule": [7.0] * (steps - polish) + [3.0] * polish})
        texts = [pipe.tokenizer.apply_chat_template(messages(p), add_generation_prompt=True, tokenize=False)
                 for p in prompts]
        longest = max(len(ids) for ids in pipe.tokenizer(texts, add_special_tokens=False).input_ids)
        return {**guidance, "max_sequence_length": longest}
