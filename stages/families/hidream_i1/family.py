"""HiDream-I1 (Full, Dev, Fast): a 17B MoE DiT conditioned on two CLIPs' pooled projections, T5-XXL and the
hidden states of every layer of Llama-3.1-8B-Instruct; FLUX.1's VAE, latents patched 2x2 by the transformer.

Checked against diffusers 0.42.1 `pipelines/hidream_image/pipeline_hidream_image.py` and
`models/transformers/transformer_hidream_image.py`:
- `encode_prompt` with one caption for all four encoders: each CLIPTextModelWithProjection's `text_embeds`
  (tokens padded to min(max_sequence_length, 218), no mask), concatenated; T5's `last_hidden_state` (padded to
  min(max_sequence_length, 512), run with its mask); Llama's `hidden_states[1:]` stacked, every layer after the
  embeddings (padded with EOS to max_sequence_length, run with its mask, BOS first). The transformer reads all
  the padded tokens, unmasked, and picks the Llama layers of its `llama_layers`, so rows are stored whole.
- `__call__`: latents (B, 16, h, w) unpacked (the transformer patches them; a non-square latent is padded to
  `max_seq` tokens whose keys are zeroed), timestep = scheduler timestep = sigma x 1000, and the velocity is
  the NEGATED output: `noise_pred = -transformer(...)`. Flow target noise - x0. Sigmas `linspace(1, 1/N, N)`
  with the scheduler's static shift (HiDream-I1-Full 3.0, Dev 6.0); a dynamic-shift scheduler would get
  mu from the transformer's fixed `max_seq`, never from the image.
- latents decode as `z / scaling_factor + shift_factor` (FLUX.1's VAE): `KLVAELatents`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

from stages.core import flow
from stages.core.kohya import GENERIC as KOHYA_LAYOUT
from stages.core.lazy import lazy_module, no_grad
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.families.base import BatchMeta, FamilyTraits
from stages.families.hidream_i1.comfyui import LAYOUT as COMFYUI_LAYOUT
from stages.families.kl_vae import KLVAELatents
from stages.families.text_encoders import load_text_model, require_max_length

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

CLIP_TOKENS = 218  # _get_clip_prompt_embeds: min(max_sequence_length, 218)


class HiDreamTextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, LlamaForCausalLM, T5EncoderModel

        from stages.core.runtime import precision_dtype
        from stages.families.hidream_i1 import MAX_TOKENS

        require_max_length(cfg, MAX_TOKENS, "HiDreamImagePipeline")
        dtype = precision_dtype(cfg.text_encoder_precision, rt.device)
        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.clip_toks = [src.load(AutoTokenizer, t) for t in ("tokenizer", "tokenizer_2")]
        self.clips = [src.load(CLIPTextModelWithProjection, c, dtype=dtype).to(rt.device).eval()  # the CLIPs stay whole
                      for c in ("text_encoder", "text_encoder_2")]
        self.t5_tok = src.load(AutoTokenizer, "tokenizer_3")
        self.t5 = load_text_model(T5EncoderModel, src, "text_encoder_3", cfg, rt)
        self.llama_tok = src.load(AutoTokenizer, "tokenizer_4")
        self.llama_tok.pad_token = self.llama_tok.eos_token  # as HiDreamImagePipeline.__init__ sets it
        # the pipeline's class; encode runs its decoder only: the same hidden states, no logits over 128k tokens
        self.llama = load_text_model(LlamaForCausalLM, src, "text_encoder_4", cfg, rt)

    def _tokens(self, tokenizer: Any, texts: list[str], limit: int) -> Any:
        return tokenizer(texts, padding="max_length", max_length=min(self.max_len, limit), truncation=True,
                         add_special_tokens=True, return_tensors="pt")

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """{"pooled": (B, CLIP-L + CLIP-G projections), "t5": (B, L, 4096), "llama": (B, layers, L, 4096)}, as
        encode_prompt returns them (its llama tensor is (layers, B, L, D))."""
        pooled = []
        for tok, clip in zip(self.clip_toks, self.clips):
            ids = self._tokens(tok, texts, CLIP_TOKENS).input_ids
            pooled.append(clip(ids.to(self.device)).text_embeds.to(clip.dtype))
        t5 = self._tokens(self.t5_tok, texts, self.t5_tok.model_max_length)
        t5_states = self.t5(t5.input_ids.to(self.device), attention_mask=t5.attention_mask.to(self.device))[0]
        llama = self._tokens(self.llama_tok, texts, self.llama_tok.model_max_length)
        out = self.llama.model(llama.input_ids.to(self.device), attention_mask=llama.attention_mask.to(self.device),
                         output_hidden_states=True)
        return {"pooled": torch.cat(pooled, dim=-1), "t5": t5_states.to(self.t5.dtype),
                "llama": torch.stack(out.hidden_states[1:], dim=1)}

    def token_counts(self, texts: list[str]) -> list[int]:
        """The longer of T5's and Llama's token counts (each is cut at max_sequence_length)."""
        t5 = self.t5_tok(texts, truncation=False).input_ids
        llama = self.llama_tok(texts, truncation=False).input_ids
        return [max(len(a), len(b)) for a, b in zip(t5, llama)]


class HiDreamI1(KLVAELatents, FamilyTraits):
    name = "hidream-i1"
    title = "HiDream-I1"
    pipeline_class = "HiDreamImagePipeline"
    lora_prefix = "transformer"
    denoiser_class = "HiDreamImageTransformer2DModel"
    # Both streams' attention and the shared expert of each MoE feed-forward, which every token runs: names
    # HiDreamImagePipeline.load_lora_weights reads back. Not the router (`ff_i.gate`, a bare weight that picks
    # the experts) nor the routed experts (each sees only the tokens routed to it; list `ff_i.experts.N.w1`
    # and the like in train.target_modules to train them).
    default_lora_targets = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out",
                            "attn1.to_q_t", "attn1.to_k_t", "attn1.to_v_t", "attn1.to_out_t",
                            "ff_i.shared_experts.w1", "ff_i.shared_experts.w2", "ff_i.shared_experts.w3")
    text_component_classes = ("CLIPTextModelWithProjection", "T5EncoderModel", "LlamaForCausalLM")
    text_components = ("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4",
                       "text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")
    text_offload_components = ("text_encoder_3", "text_encoder_4")  # by load_text_model: nf4 or layer offload
    vae_components = ("vae",)
    denoiser_components = ("transformer",)
    text_tokens_beyond_max = 0  # each encoder reads at most captions.max_sequence_length tokens (CLIP: 218)
    text_whole_components = ("text_encoder", "text_encoder_2")  # the CLIPs stay bf16 under nf4
    repeated_blocks = ("HiDreamBlock",)  # diffusers' class names none (denoiser.HiDreamTrainable)
    # Estimates from the layer widths: FLUX.1's 17 units of a block with attention and an MLP, the MoE's routed
    # copies (2 experts x 4 tensors of 2.7x the width) and its shared expert: 40 and 48 (the --vram 16 row, eager,
    # held 0.94x its plan); a compiled or graphed step runs every routed expert on every token
    # (denoiser.DenseRoutedMoE): 2 more experts' 4 tensors, and the stacked outputs and their weighted copy, 4 + 4,
    # less the routed path's repeated input and output, 2 + 2: 26 more units
    block_saved_units = {"HiDreamBlock": 66.0}
    block_work_units = 74.0
    fp8_faster_from_tokens = 4173  # 1024 px, 77-token captions, compiled, on an H100: fp8 0.86x bf16's step (batch 4: 0.83x)
    kohya_layout = KOHYA_LAYOUT
    comfyui_layout = COMFYUI_LAYOUT

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> HiDreamTextEncoder:
        return HiDreamTextEncoder(src, cfg, rt)

    # ---- cache-latents and sample_timesteps: KLVAELatents (the static shift; config_errors refuses the dynamic one)

    # ---- sample
    @contextlib.contextmanager
    def sample_context(self, size: tuple[int, int]) -> Iterator[None]:
        """HiDreamImagePipeline renders at the area of its `default_sample_size` x VAE scale squared (1024 x 1024)
        whatever height and width ask, keeping their aspect; here it renders the asked size, as trained. The
        area is 1 + 1e-9 times the asked one, so the pipeline's floor to multiples of 16 keeps both sides."""
        from diffusers import HiDreamImagePipeline

        side = math.sqrt(size[0] * size[1]) * (1 + 1e-9)
        HiDreamImagePipeline.default_sample_size = property(lambda pipe: side / pipe.vae_scale_factor,
                                                            lambda pipe, value: None)
        try:
            yield
        finally:
            del HiDreamImagePipeline.default_sample_size  # the instance's own value (128) shows again

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from stages.families.hidream_i1.denoiser import HiDreamTrainable

        return load_denoiser_weights(HiDreamTrainable, src, "transformer", precision, rt, tcfg.nf4_double_quant).dense_moe()

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        from stages.families.hidream_i1.denoiser import latent_grid

        _, _, h, w = x0.shape
        config, dtype, device = denoiser.config, base_dtype(denoiser), x0.device
        self._check_size(config, h, w)
        out = denoiser(
            hidden_states=flow.noisy_latents(x0, noise, t).to(dtype),
            timesteps=t.float() * 1000,  # the scheduler's timesteps: sigma x num_train_timesteps
            encoder_hidden_states_t5=cond["t5"].to(device, dtype),
            encoder_hidden_states_llama3=cond["llama"].to(device, dtype).transpose(0, 1),  # (layers, B, L, D)
            pooled_embeds=cond["pooled"].to(device, dtype),
            return_dict=False,
        )[0]
        training = denoiser.training and not config.force_inference_output
        pred = -latent_grid(out, training, h, w, config.patch_size)  # the pipeline negates the output: noise - x0
        return flow.per_sample_loss(pred, flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)

    @staticmethod
    def _check_size(config: Any, h: int, w: int) -> None:
        """A non-square latent is padded to the transformer's max_seq tokens: a larger one cannot be."""
        from stages.core.errors import ConfigError

        p, (mh, mw) = config.patch_size, config.max_resolution
        if h != w and (h // p) * (w // p) > mh * mw // (p * p):
            raise ConfigError(f"a {w}x{h} latent bucket has {(h // p) * (w // p)} patches, more than the "
                              f"{mh * mw // (p * p)} that hidream-i1's transformer pads to; lower data.resolution")
