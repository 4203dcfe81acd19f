"""FLUX.1: CLIP pooled + T5 text conditioning, 16-channel VAE, 2x2-packed flow DiT; the family class
that `flux` (dev and schnell) and `flux-kontext` share, and `chroma` extends (its own text and predict).

Checked against diffusers 0.42 `pipelines/flux/pipeline_flux.py`:
- prompt: CLIP `pooler_output` (77 tokens, padded to max length) and T5 `last_hidden_state`
  (padded to max_sequence_length); text ids are zeros.
- latents: `(z - shift_factor) * scaling_factor`, packed 2x2 into tokens; image ids (0, row, col).
- transformer: timestep = sigma (the model multiplies by 1000), guidance = guidance_scale for dev
  (`guidance_embeds=True`), none for schnell. Flow target noise - x0.
"""

from __future__ import annotations

from typing import Any

from stages.core import flow
from stages.core.lazy import lazy_module, no_grad
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.families.base import BatchMeta, FamilyTraits
from stages.families.common.bfl import FLUX1 as COMFYUI_LAYOUT
from stages.families.common.bfl import FLUX1_KOHYA as KOHYA_LAYOUT
from stages.families.kl_vae import KLVAELatents
from stages.families.text_encoders import load_text_model

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch


class FluxTextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        from stages.core.runtime import precision_dtype

        dtype = precision_dtype(cfg.text_encoder_precision, rt.device)
        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.clip_tok = src.load(AutoTokenizer, "tokenizer")
        self.t5_tok = src.load(AutoTokenizer, "tokenizer_2")
        self.clip = src.load(CLIPTextModel, "text_encoder", dtype=dtype).to(rt.device).eval()  # CLIP stays whole
        self.t5 = load_text_model(T5EncoderModel, src, "text_encoder_2", cfg, rt)  # nf4 and layer offload are T5's

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        clip_ids = self.clip_tok(texts, padding="max_length", max_length=self.clip_tok.model_max_length,
                                 truncation=True, return_tensors="pt").input_ids
        pooled = self.clip(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        t5_ids = self.t5_tok(texts, padding="max_length", max_length=self.max_len, truncation=True,
                             return_tensors="pt").input_ids
        embeds = self.t5(t5_ids.to(self.device), output_hidden_states=False)[0]
        return {"prompt_embeds": embeds.to(self.t5.dtype), "pooled": pooled.to(self.clip.dtype)}

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.t5_tok(texts, truncation=False).input_ids]


class Flux1(KLVAELatents, FamilyTraits):
    """FLUX.1 [dev] and [schnell] whole; FLUX.1 Kontext adds its control tokens."""

    fp8_faster_from_tokens = 1101  # 512 px b1, 77-token captions: fp8 0.93x bf16's step (0.86-0.88x at the other three)
    # an un-checkpointed single-stream block keeps 13 units for its backward, not memory.BLOCK_SAVED_UNITS (17):
    # the H200 rows with some blocks checkpointed (tests/bench/test_bench_report.py)
    block_saved_units = {"FluxSingleTransformerBlock": 13.0}
    pipeline_class = "FluxPipeline"
    lora_prefix = "transformer"
    denoiser_class = "FluxTransformer2DModel"
    default_lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
    text_component_classes = ("CLIPTextModel", "T5EncoderModel")
    text_components = ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2")
    text_offload_components = ("text_encoder_2",)  # loaded by text_encoders.load_text_model: the planner may offload its layers
    text_keeps_hidden_states = False  # T5's last hidden state and CLIP's pooled output only
    text_tokens_beyond_max = 0  # T5 padded to captions.max_sequence_length, CLIP to 77
    text_whole_components = ("text_encoder",)  # CLIP stays bf16 under an nf4 T5
    vae_components = ("vae",)
    denoiser_components = ("transformer",)
    kohya_layout = KOHYA_LAYOUT
    comfyui_layout = COMFYUI_LAYOUT

    def __init__(self) -> None:
        self._ids: dict[tuple, torch.Tensor] = {}  # image/text ids and guidance, per shape

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> FluxTextEncoder:
        return FluxTextEncoder(src, cfg, rt)

    # ---- cache-latents and sample_timesteps: KLVAELatents

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from diffusers import FluxTransformer2DModel

        return load_denoiser_weights(FluxTransformer2DModel, src, "transformer", precision, rt, tcfg.nf4_double_quant)

    def image_ids(self, h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """(h/2 * w/2, 3) ids (0, row, col), built once per bucket shape."""
        key = (h, w, device, dtype)
        if key not in self._ids:
            ids = torch.zeros(h // 2, w // 2, 3)
            ids[..., 1] += torch.arange(h // 2)[:, None]
            ids[..., 2] += torch.arange(w // 2)[None, :]
            self._ids[key] = ids.reshape(-1, 3).to(device, dtype)
        return self._ids[key]

    def _constant(self, kind: str, shape: tuple[int, ...], value: float, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
        """Text ids (zeros) and the guidance vector, built once per shape instead of every step."""
        key = (kind, shape, value, device, dtype)
        if key not in self._ids:
            self._ids[key] = torch.full(shape, value, device=device, dtype=dtype)
        return self._ids[key]

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        _, _, h, w = x0.shape
        x_t = flow.noisy_latents(x0, noise, t)
        pred = self.predict(denoiser, flow.pack_2x2(x_t), self.image_ids(h, w, x0.device, base_dtype(denoiser)), t, cond, tcfg, meta)
        return flow.per_sample_loss(flow.unpack_2x2(pred, h, w), flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)

    def predict(self, denoiser: torch.nn.Module, tokens: torch.Tensor, img_ids: torch.Tensor, t: torch.Tensor,
                cond: dict[str, torch.Tensor], tcfg: Any, meta: BatchMeta) -> torch.Tensor:
        """One transformer forward over packed image tokens (B, N, C*4) with their ids (N, 3)."""
        b, device, dtype = tokens.shape[0], tokens.device, base_dtype(denoiser)
        text = cond["prompt_embeds"].to(device, dtype)
        guidance = None
        if denoiser.config.guidance_embeds:
            guidance = self._constant("guidance", (b,), tcfg.guidance_scale, device, torch.float32)
        return denoiser(
            hidden_states=tokens.to(dtype),
            timestep=t.to(device, dtype),
            guidance=guidance,
            pooled_projections=cond["pooled"].to(device, dtype),
            encoder_hidden_states=text,
            txt_ids=self._constant("txt_ids", (text.shape[1], 3), 0.0, device, dtype),
            img_ids=img_ids,
            return_dict=False,
        )[0]
