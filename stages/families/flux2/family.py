"""FLUX.2 [dev] (32B, guidance-distilled): Mistral Small 3 states of three layers under BFL's system
message; the image side is FLUX.2's, shared with klein (`stages.families.common.flux2_dit`, described there).

Checked against diffusers 0.42.1 `pipelines/flux2/pipeline_flux2.py`:
- `_get_mistral_3_small_prompt_embeds` / `encode_prompt`: each caption ("[IMG]" removed) becomes
  the conversation `format_input` builds, [system: `SYSTEM_MESSAGE` of `system_messages.py`, user:
  the caption], which the processor's chat template renders (`add_generation_prompt=False`) and
  tokenizes padded and truncated to `max_sequence_length` (512 by default, system message
  included); Mistral3ForConditionalGeneration runs with that attention mask and `hidden_states[10]`,
  `[20]` and `[30]` are stacked per token into (L, 3 x 5120). The padding positions are part of the
  prompt and the transformer gets no text mask, so rows are stored whole. Text ids (0, 0, 0, l).
  The text path of the processor is its tokenizer and chat template, which is all that is loaded
  here (the real PixtralProcessor needs torchvision for its image side); Mistral3Model is the
  pipeline's model minus its lm_head: the hidden states are the same.
- guidance: `guidance_embeds` is true (FLUX.2 dev is guidance-distilled), and `__call__` passes
  `guidance = torch.full([1], guidance_scale, float32).expand(B)` (default 4.0; the transformer
  multiplies it by 1000 as the timestep). The training forward passes the same vector with
  `train.guidance_scale`: 1.0 in the preset, the guidance at which the distilled model's velocity is
  the unguided conditional one that the target noise - x0 is (diffusers'
  train_dreambooth_lora_flux2.py passes its `--guidance_scale`, default 3.5).
- timestep = sigma, target noise - x0, `dynamic_shift` = exp(compute_empirical_mu(tokens, 50)):
  as klein (the same helpers, `flux2_dit`).
"""

from __future__ import annotations

from typing import Any

from stages.core.lazy import lazy_module, no_grad
from stages.families.common.flux2_dit import Flux2DiT, require_text_layers, stacked_text_states
from stages.families.text_encoders import load_chat_tokenizer, load_text_model

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

HIDDEN_STATES_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers default


class Flux2TextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import Mistral3Model

        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.tokenizer = load_chat_tokenizer(src, "FLUX.2 dev")
        self.model = load_text_model(Mistral3Model, src, "text_encoder", cfg, rt)
        require_text_layers(src, self.model.config.text_config.num_hidden_layers, HIDDEN_STATES_LAYERS, "FLUX.2 dev")

    def _tokens(self, texts: list[str], **kwargs: Any) -> Any:
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        return self.tokenizer.apply_chat_template(format_input(texts, system_message=SYSTEM_MESSAGE),
                                                  add_generation_prompt=False, tokenize=True, return_dict=True, **kwargs)

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        tokens = self._tokens(texts, return_tensors="pt", padding="max_length", truncation=True,
                              max_length=self.max_len).to(self.device)
        return stacked_text_states(self.model, tokens, HIDDEN_STATES_LAYERS)

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self._tokens(texts).input_ids]


class Flux2(Flux2DiT):
    name = "flux2"
    title = "FLUX.2 [dev]"
    pipeline_class = "Flux2Pipeline"
    text_component_classes = ("Mistral3Model",)
    text_components = ("tokenizer", "text_encoder")
    text_offload_components = ("text_encoder",)  # loaded by text_encoders.load_text_model: the planner may offload its layers
    fp8_faster_from_tokens = 4173  # 1024 px b1, 77-token captions: fp8 0.78x bf16's step at 0.56x its peak (its one fp8 row)

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> Flux2TextEncoder:
        return Flux2TextEncoder(src, cfg, rt)

    # ---- cache-latents and train: Flux2DiT
