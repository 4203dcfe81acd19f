"""SDXL (base 1.0 and compatible fine-tunes): two CLIP text encoders, 4-channel VAE, DDPM UNet.

    lorapipe run --config configs/sdxl.toml

Checked against diffusers 0.42 `pipelines/stable_diffusion_xl/pipeline_stable_diffusion_xl.py` and
`training_utils.compute_snr`, and the math of `examples/text_to_image/train_text_to_image_lora_sdxl.py`:
- prompt: both encoders tokenized padded to 77; `hidden_states[-2]` of each, concatenated on the
  feature axis; the pooled embedding is encoder 2's `text_embeds` (the pipeline takes
  `prompt_embeds[0]` of the last encoder whose first output is 2-D).
- latents: `z * scaling_factor`, or `(z - latents_mean) * scaling_factor / latents_std` when the VAE
  config has per-channel statistics (as the pipeline's decode inverts it).
- UNet conditioning: `add_time_ids` = original size (h, w) + crop top-left (top, left) + target
  size (h, w), per sample, with the pooled embedding as `text_embeds`.
- DDPM objective: integer timesteps uniform in [0, num_train_timesteps), `x_t` from
  `DDPMScheduler.add_noise`, target epsilon or `get_velocity` (v-prediction), min-SNR-gamma weights
  min(snr, gamma) / snr for epsilon and min(snr, gamma) / (snr + 1) for v-prediction.
"""

from __future__ import annotations

from typing import Any

from stages.core import flow
from stages.core.config import ConfigError
from stages.core.lazy import lazy_module, no_grad
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.core.model_source import ModelError
from stages.families.base import BatchMeta, FamilyTraits
from stages.families.sdxl.comfyui import LAYOUT as COMFYUI_LAYOUT
from stages.families.sdxl.kohya import LAYOUT as KOHYA_LAYOUT

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

PREDICTION_TYPES = ("epsilon", "v_prediction")
# SDXL base 1.0's training schedule (its scheduler_config.json). The train stage replaces it with the
# model's own in load_denoiser; it only serves callers that evaluate the loss of a bare family
# object (the family tests), since the protocol hands sample_timesteps/loss no model source.
SDXL_BASE_SCHEDULE = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                      "beta_schedule": "scaled_linear", "prediction_type": "epsilon"}


class SDXLTextEncoder:
    """CLIP ViT-L (`text_encoder`) + OpenCLIP bigG with projection (`text_encoder_2`)."""

    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

        from stages.core.runtime import precision_dtype

        if cfg.text_encoder_precision == "nf4":
            raise ConfigError("captions.text_encoder_precision = 'nf4' is not offered for SDXL: its two CLIP "
                              "encoders need ~1.6 GB in bf16; use 'auto' or 'bf16'")
        dtype = precision_dtype(cfg.text_encoder_precision, rt.device)
        self.device = rt.device
        self.tokenizers = [src.load(AutoTokenizer, "tokenizer"), src.load(AutoTokenizer, "tokenizer_2")]
        self._check_length(cfg.max_sequence_length)
        self.encoders = [src.load(CLIPTextModel, "text_encoder", dtype=dtype).to(rt.device).eval(),
                         src.load(CLIPTextModelWithProjection, "text_encoder_2", dtype=dtype).to(rt.device).eval()]

    def _check_length(self, wanted: int) -> None:
        # The UNet attends to all 77 positions (no mask), so captions must be padded exactly as the
        # pipeline pads them at inference; a different length would train on other inputs.
        n = self.tokenizers[0].model_max_length
        if wanted != n:
            raise ConfigError(f"captions.max_sequence_length = {wanted}, but SDXL's CLIP encoders always read "
                              f"{n} tokens (longer captions are truncated): set captions.max_sequence_length = {n}")

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        states, pooled = [], None
        for tok, enc in zip(self.tokenizers, self.encoders):
            ids = tok(texts, padding="max_length", max_length=tok.model_max_length, truncation=True,
                      return_tensors="pt").input_ids
            out = enc(ids.to(self.device), output_hidden_states=True)
            states.append(out.hidden_states[-2])  # penultimate layer, as SDXL was trained (clip_skip=None)
            pooled = getattr(out, "text_embeds", pooled)  # only encoder 2 has a projection
        dtype = self.encoders[1].dtype
        return {"prompt_embeds": torch.cat(states, dim=-1).to(dtype), "pooled": pooled.to(dtype)}

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizers[0](texts, truncation=False).input_ids]


# ---- DDPM math (pure functions; the unit tests check them against the formulas) -----------------


def snr(alphas_cumprod: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """alpha_bar / (1 - alpha_bar) at integer timesteps t, as diffusers' compute_snr."""
    ab = alphas_cumprod.to(t.device)[t].float()
    return ab / (1.0 - ab)


def min_snr_weights(snr_t: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma (Hang et al. 2023) weights of the per-sample MSE; gamma <= 0 turns them off.

    Epsilon: min(snr, gamma) / snr. V-prediction: min(snr, gamma) / (snr + 1), since the v-loss is
    already (snr + 1) times the epsilon loss. At snr = 0 (zero-terminal-SNR schedules) the epsilon
    form is 0/0; its limit, 1, is used.
    """
    if gamma <= 0:
        return torch.ones_like(snr_t)
    clipped = torch.clamp(snr_t, max=gamma)
    if prediction_type == "v_prediction":
        return clipped / (snr_t + 1)
    return torch.where(snr_t > 0, clipped / snr_t.clamp(min=torch.finfo(snr_t.dtype).tiny), torch.ones_like(snr_t))


def add_time_ids(meta: BatchMeta) -> torch.Tensor:
    """(B, 6) per sample: original (h, w), crop (top, left), target (h, w), as _get_add_time_ids."""
    return torch.cat([meta.original_size, meta.crop_top_left, meta.target_size], dim=1)


def offset_noise(noise: torch.Tensor, offset: float) -> torch.Tensor:
    """noise + offset * N(0, 1) per (sample, channel), as the diffusers examples' --noise_offset.

    Drawn from torch's global CPU generator: the trainer seeds it and saves it in every checkpoint
    (it also drives LoRA dropout), so resumed runs repeat it; the protocol passes no generator here.
    """
    if not offset:
        return noise
    b, c = noise.shape[:2]
    return noise + offset * torch.randn(b, c, 1, 1).to(noise.device, noise.dtype)


class SDXL(FamilyTraits):
    name = "sdxl"
    title = "SDXL"
    fp8_faster_from_tokens = 1101  # 512 px b1 as the planner counts it: fp8 0.88x bf16's step (1024 px: 0.94x)
    pipeline_class = "StableDiffusionXLPipeline"
    lora_prefix = "unet"
    denoiser_class = "UNet2DConditionModel"
    vae_class = "AutoencoderKL"
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    text_component_classes = ("CLIPTextModel", "CLIPTextModelWithProjection")
    text_components = ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2")
    vae_components = ("vae",)
    denoiser_components = ("unet", "scheduler")
    kohya_layout = KOHYA_LAYOUT
    comfyui_layout = COMFYUI_LAYOUT
    blocks_in_run_order = False  # the UNet lists its blocks down, up, mid and runs them down, mid, up
    attention_per_block = False  # a UNet block holds 0-10 transformer layers of two attentions each
    # The train activations outside the repeated (transformer) blocks, which the planner's per-block units
    # do not see: the ResNets, down/upsamplers and time embedding. (GB, GB per 512x512 sample): what the
    # H200's SDXL rows allocated over the block model, 0.21-0.25 GB at 512 px b1 and b4 / 1024 px b1,
    # 0.40-0.46 at 1024 px b4, in bf16, nf4 and fp8 alike (bench/results/bench-sdxl-*.json).
    outside_block_gb = (0.2, 0.015)

    def __init__(self) -> None:
        self.scheduler: Any = None  # DDPMScheduler of the model, set by load_denoiser (config only)

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> SDXLTextEncoder:
        return SDXLTextEncoder(src, cfg, rt)

    # ---- cache-latents
    def load_vae(self, src: Any, rt: Any) -> torch.nn.Module:
        # SDXL's VAE overflows in fp16; latents.vae_precision offers fp32 (default) and bf16 only.
        from diffusers import AutoencoderKL

        return src.load(AutoencoderKL, "vae", torch_dtype=rt.dtype).to(rt.device).eval()

    def pixel_multiple(self, src: Any) -> int:
        """VAE downsampling x the UNet's: each down block but the last halves the latent (8 x 4 = 32)."""
        vae = 2 ** (len(src.component_config("vae")["block_out_channels"]) - 1)
        unet = 2 ** (len(src.component_config("unet")["block_out_channels"]) - 1)
        return vae * unet

    @no_grad
    def encode_posterior(self, vae: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        return dist.mean, dist.logvar  # logvar already clamped to [-30, 20] by DiagonalGaussianDistribution

    def latent_normalization(self, vae: torch.nn.Module) -> dict[str, Any]:
        cfg = vae.config
        stats = getattr(cfg, "latents_mean", None) is not None and getattr(cfg, "latents_std", None) is not None
        return {"scaling_factor": float(cfg.scaling_factor),
                "latents_mean": [float(x) for x in cfg.latents_mean] if stats else None,
                "latents_std": [float(x) for x in cfg.latents_std] if stats else None}

    @staticmethod
    def _stats(norm: dict[str, Any], z: torch.Tensor) -> tuple[Any, Any]:
        if norm["latents_mean"] is None:  # SDXL base: scaling_factor only
            return 0.0, 1.0
        shape = (1, -1) + (1,) * (z.dim() - 2)
        return (torch.tensor(norm["latents_mean"], dtype=z.dtype, device=z.device).view(shape),
                torch.tensor(norm["latents_std"], dtype=z.dtype, device=z.device).view(shape))

    def normalize_latents(self, z: torch.Tensor, norm: dict[str, Any]) -> torch.Tensor:
        mean, std = self._stats(norm, z)
        return (z - mean) * norm["scaling_factor"] / std

    def denormalize_latents(self, x: torch.Tensor, norm: dict[str, Any]) -> torch.Tensor:
        mean, std = self._stats(norm, x)
        return x * std / norm["scaling_factor"] + mean

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from diffusers import UNet2DConditionModel

        self.load_noise_schedule(src)
        self.prediction_type(tcfg)  # fail before any weights load
        return load_denoiser_weights(UNet2DConditionModel, src, "unet", precision, rt, tcfg.nf4_double_quant)

    def load_noise_schedule(self, src: Any) -> Any:
        """DDPMScheduler from the pipeline's scheduler config (betas, prediction_type; no weights),
        whatever inference scheduler class it names, as the diffusers training examples do."""
        from diffusers import DDPMScheduler

        self.scheduler = DDPMScheduler.from_config(src.component_config("scheduler", "scheduler_config.json"))
        return self.scheduler

    def prediction_type(self, tcfg: Any) -> str:
        kind = tcfg.prediction_type
        if kind == "auto":
            kind = self._ddpm().config.prediction_type
        if kind not in PREDICTION_TYPES:
            raise ModelError(f"the model's scheduler/scheduler_config.json has prediction_type = {kind!r}, which "
                             f"training does not support; set train.prediction_type to one of {PREDICTION_TYPES}")
        return kind

    def _ddpm(self) -> Any:
        if self.scheduler is None:
            from diffusers import DDPMScheduler

            self.scheduler = DDPMScheduler(**SDXL_BASE_SCHEDULE)
        return self.scheduler

    def sample_timesteps(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator,
                         tcfg: Any, first: int | None = None) -> torch.Tensor:
        """Integer DDPM timesteps, uniform in [0, num_train_timesteps) (no stratification: the flow-only
        train.timestep_buckets is refused for SDXL)."""
        return torch.randint(0, self._ddpm().config.num_train_timesteps, (n,), generator=generator)

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        sched, kind = self._ddpm(), self.prediction_type(tcfg)
        dtype, device = base_dtype(denoiser), x0.device
        t = t.to(device).long()
        noise = offset_noise(noise, tcfg.noise_offset)
        x_t = sched.add_noise(x0, noise, t)
        target = noise if kind == "epsilon" else sched.get_velocity(x0, noise, t)
        pred = denoiser(
            x_t.to(dtype), t,
            encoder_hidden_states=cond["prompt_embeds"].to(device, dtype),
            added_cond_kwargs={"text_embeds": cond["pooled"].to(device, dtype),
                               "time_ids": add_time_ids(meta).to(device, dtype)},
            return_dict=False,
        )[0]
        weights = min_snr_weights(snr(sched.alphas_cumprod, t), tcfg.snr_gamma, kind)
        return flow.per_sample_loss(pred, target, meta.loss_mask, tcfg) * weights
