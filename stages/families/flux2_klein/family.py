"""FLUX.2 [klein] (4B, 9B): Qwen3 states of three layers, 32-channel VAE with batch-norm statistics,
2x2-patchified flow DiT with 4-axis position ids. The latent and denoiser side is FLUX.2's, shared
with FLUX.2 [dev] (`stages.families.common.flux2_dit`, where it is described).

Checked against diffusers 0.42.1:
- `pipelines/flux2/pipeline_flux2_klein.py` `_get_qwen3_prompt_embeds` / `encode_prompt`: each
  caption goes through the tokenizer's chat template (`add_generation_prompt=True,
  enable_thinking=False`), is padded (and truncated) to `max_sequence_length` (512 by default,
  template included), Qwen3 runs with the attention mask, and `hidden_states[9]`, `[18]` and `[27]`
  are stacked per token into (L, 3 x hidden). Nothing is dropped: the padding positions are part
  of the prompt and the transformer gets no text mask, so rows are stored whole.
  `_prepare_text_ids`: text ids (0, 0, 0, l).
- the transformer gets `guidance=None` (klein's `guidance_embeds` is false; the distilled 4B/9B are
  step-distilled, `is_distilled` in model_index.json, not guidance-embedded): the training forward
  passes the same.
- sigmas: `train.dynamic_shift` trains at the pipeline's `compute_empirical_mu` shift
  (diffusers' train_dreambooth_lora_flux2_klein.py draws from the scheduler's unshifted table
  instead: `dynamic_shift = false, shift = 1.0`).
"""

from __future__ import annotations

from typing import Any

from stages.core.lazy import lazy_module, no_grad
from stages.families.common.flux2_dit import Flux2DiT, require_text_layers, stacked_text_states
from stages.families.text_encoders import chat_prompts, load_chat_tokenizer, load_text_model

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

HIDDEN_STATES_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers default


class Flux2KleinTextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import Qwen3Model

        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.tokenizer = load_chat_tokenizer(src, "FLUX.2 klein")
        # The pipeline's Qwen3ForCausalLM minus its lm_head: the hidden states are the same.
        self.model = load_text_model(Qwen3Model, src, "text_encoder", cfg, rt)
        require_text_layers(src, self.model.config.num_hidden_layers, HIDDEN_STATES_LAYERS, "FLUX.2 klein")

    def _templated(self, texts: list[str]) -> list[str]:
        return chat_prompts(self.tokenizer, texts, enable_thinking=False)

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        tokens = self.tokenizer(self._templated(texts), padding="max_length", max_length=self.max_len,
                                truncation=True, return_tensors="pt").to(self.device)
        return stacked_text_states(self.model, tokens, HIDDEN_STATES_LAYERS)

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(self._templated(texts), truncation=False).input_ids]


class Flux2Klein(Flux2DiT):
    name = "flux2-klein"
    title = "FLUX.2 [klein]"
    pipeline_class = "Flux2KleinPipeline"
    text_component_classes = ("Qwen3Model",)
    text_components = ("tokenizer", "text_encoder")
    text_offload_components = ("text_encoder",)  # loaded by text_encoders.load_text_model: the planner may offload its layers
    # 1024 px b1, 77-token captions: fp8 4.80 samples/s at 5.64 GB against bf16 4.16 at 9.16 (0.87x its step;
    # bench/results/bench-flux2-klein-KF.json, -KL.json)
    fp8_faster_from_tokens = 4173
    # pipeline_flux2_klein.py: do_classifier_free_guidance = guidance_scale > 1 and not is_distilled
    distilled_ignores_guidance = True

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> Flux2KleinTextEncoder:
        return Flux2KleinTextEncoder(src, cfg, rt)

    # ---- cache-latents and train: Flux2DiT
