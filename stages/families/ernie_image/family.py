"""ERNIE-Image (8B single-stream DiT by Baidu; ERNIE-Image-Turbo the same architecture step-distilled):
Ministral 3 text states, FLUX.2's 32-channel VAE with ERNIE's own batch-norm epsilon, 2x2-patchified
latents fed to the transformer as an image (B, 128, h/2, w/2).

Checked against diffusers 0.42.1 `pipelines/ernie_image/pipeline_ernie_image.py` and
`models/transformers/transformer_ernie_image.py`:
- `encode_prompt`: each caption is tokenized alone (`add_special_tokens=True`: BOS first, no padding,
  truncated only at the tokenizer's model_max_length; an empty token list becomes [BOS]), Mistral3Model
  runs on it with no mask and `hidden_states[-2][0]` is kept: one variable-length (T, 3072) tensor per
  caption. Here captions are encoded in a batch, right-padded with the mask: the decoder is causal, so
  a caption's states are the ones it has alone. Rows are stored padded with their lengths.
- `_pad_text` / the transformer: text is zero-padded to the batch's longest caption with `text_lens`;
  the transformer masks the padding as keys, gives text token l the RoPE id (l, 0, 0) and every image
  token (text_len, row, col), so a caption sees the same sequence alone or in a padded batch.
- latents: the posterior (32 channels) is patchified 2x2 (`_patchify_latents`: channel c*4 + dy*2 + dx)
  and normalized per patchified channel with the VAE's batch-norm running statistics and eps 1e-5
  (the pipeline's decode hard-codes 1e-5, the value ERNIE-Image was trained with, not the config's
  `batch_norm_eps`). The cache keeps the raw posterior; `normalize_latents` applies the statistics
  unpatchified (FLUX.2's layout, `stages.families.common.flux2_dit`).
- `__call__`: sigmas `linspace(1, 0, N + 1)[:-1]` shifted by the scheduler's static shift (4.0);
  the transformer gets `timestep = t` = 1000 sigma in its dtype, and `scheduler.step` moves
  `x + (sigma_next - sigma) * pred`, so the target is noise - x0.
"""

from __future__ import annotations

from typing import Any

from stages.core import flow
from stages.core.kohya import GENERIC as KOHYA_LAYOUT
from stages.core.lazy import lazy_module, no_grad
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.families.base import BatchMeta, FamilyTraits
from stages.families.common.patch_bn import PatchBatchNormalized
from stages.families.ernie_image.comfyui import LAYOUT as COMFYUI_LAYOUT
from stages.families.text_encoders import load_text_model, pad_valid_tokens, trim_to_longest

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

HIDDEN_STATE = -2  # ErnieImagePipeline.encode_prompt: the second-to-last hidden state ("matches training")
BN_EPS = 1e-5  # the pipeline's decode: sqrt(running_var + 1e-5), whatever vae.config.batch_norm_eps says
NUM_TRAIN_TIMESTEPS = 1000  # the transformer is given the scheduler's timestep, 1000 sigma


class ErnieImageTextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import AutoTokenizer, Mistral3Model

        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.tokenizer = src.load(AutoTokenizer, "tokenizer")
        self.model = load_text_model(Mistral3Model, src, "text_encoder", cfg, rt)

    def _ids(self, texts: list[str], limit: int | None) -> list[list[int]]:
        """The pipeline's tokens per caption (cut at `limit` where given), [BOS] for an empty one."""
        kwargs = {"truncation": True, "max_length": limit} if limit else {"truncation": False}
        bos = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else 0
        tokens = self.tokenizer(texts, add_special_tokens=True, padding=False, **kwargs)
        return [ids or [bos] for ids in tokens.input_ids]

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """{"prompt_embeds": (B, max_len, D) each caption's states then zeros, "prompt_length": (B,)}."""
        rows = self._ids(texts, min(self.max_len, self.tokenizer.model_max_length))
        longest = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([r + [pad] * (longest - len(r)) for r in rows], device=self.device)
        mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in rows], device=self.device)
        out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        return pad_valid_tokens(out.hidden_states[HIDDEN_STATE], mask, 0, self.max_len)

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(r) for r in self._ids(texts, None)]


def patchify(z: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2), channel c*4 + dy*2 + dx: ErnieImagePipeline._patchify_latents."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(x: torch.Tensor) -> torch.Tensor:
    """Inverse of `patchify`: ErnieImagePipeline._unpatchify_latents."""
    b, c, h, w = x.shape
    return x.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)


class ErnieImage(PatchBatchNormalized, FamilyTraits):
    name = "ernie-image"
    title = "ERNIE-Image"
    pipeline_class = "ErnieImagePipeline"
    captions_cut_to_longest = True
    text_padded_to_longest = True
    lora_prefix = "transformer"
    denoiser_class = "ErnieImageTransformer2DModel"
    vae_class = "AutoencoderKLFlux2"
    # Self-attention of every block (36 in the 8B model)
    default_lora_targets = ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v",
                            "self_attention.to_out.0")
    text_component_classes = ("Mistral3Model",)
    text_components = ("tokenizer", "text_encoder")
    text_offload_components = ("text_encoder",)  # loaded by load_text_model: the planner may offload its layers
    vae_components = ("vae",)
    denoiser_components = ("transformer",)
    kohya_layout = KOHYA_LAYOUT  # lora_unet_<diffusers path>: ComfyUI's own names for ErnieImage
    comfyui_layout = COMFYUI_LAYOUT
    # Counted with torch's saved-tensor hooks on one bf16 block (4 x 128 heads, ffn 3 x width, 256 tokens),
    # LoRA on its attention, the shared modulation frozen: 32.2 units, above FLUX.1's 17 because the block
    # keeps float32 copies of its modulated input, scales and gated outputs (transformer_ernie_image.py).
    block_saved_units = {"ErnieImageSharedAdaLNBlock": 32.0}
    # those 32 units plus the 7 of backward temporaries FLUX.1's 24 has over its 17 (the --vram 16 row, fp8 whole,
    # held 0.90x its plan)
    block_work_units = 39.0
    fp8_faster_from_tokens = 4173  # 1024 px, 77-token captions, on an H100: fp8 0.92x bf16's step at batch 1 and 4

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> ErnieImageTextEncoder:
        return ErnieImageTextEncoder(src, cfg, rt)

    # ---- cache-latents
    def load_vae(self, src: Any, rt: Any) -> torch.nn.Module:
        from diffusers import AutoencoderKLFlux2

        return src.load(AutoencoderKLFlux2, "vae", torch_dtype=rt.dtype).to(rt.device).eval()

    def pixel_multiple(self, src: Any) -> int:
        blocks = src.component_config("vae")["block_out_channels"]
        return 2 ** len(blocks)  # the pipeline's vae_scale_factor: the VAE's 2 ** (blocks - 1) x the 2x2 patches

    @no_grad
    def encode_posterior(self, vae: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        return dist.mean, dist.logvar  # logvar already clamped to [-30, 20] by DiagonalGaussianDistribution

    def bn_eps(self, vae: torch.nn.Module) -> float:
        return BN_EPS

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from diffusers import ErnieImageTransformer2DModel

        return load_denoiser_weights(ErnieImageTransformer2DModel, src, "transformer", precision, rt,
                                     tcfg.nf4_double_quant)

    def sample_timesteps(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator, tcfg: Any,
                         first: int | None = None) -> torch.Tensor:
        """The scheduler's static shift at every resolution (train.dynamic_shift is refused by config_errors)."""
        return flow.lookup_sigmas(flow.draw_u(n, generator, tcfg, first), flow.sigma_table(tcfg.shift))

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        dtype, device = base_dtype(denoiser), x0.device
        lengths = cond["prompt_length"].to(device)
        text, _ = trim_to_longest(cond["prompt_embeds"].to(device, dtype), lengths, meta.text_multiple)
        pred = denoiser(
            hidden_states=patchify(flow.noisy_latents(x0, noise, t)).to(dtype),
            timestep=(NUM_TRAIN_TIMESTEPS * t.float()).to(device, dtype),  # the pipeline's t_batch, in its dtype
            text_bth=text,
            text_lens=lengths,
            return_dict=False,
        )[0]
        return flow.per_sample_loss(unpatchify(pred), flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)
