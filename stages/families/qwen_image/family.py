"""Qwen-Image: the family of `stages.families.common.qwen_image` (whose docstring says what was checked
against diffusers) with its text encoder, QwenImagePipeline's `_get_qwen_prompt_embeds`."""

from __future__ import annotations

from typing import Any

from stages.core.lazy import lazy_module, no_grad
from stages.families.common.qwen_image import DROP_IDX, QwenImageBase
from stages.families.qwen_image import PIPELINE_MAX_SEQUENCE_LENGTH
from stages.families.text_encoders import load_text_model, pad_valid_tokens, require_max_length

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


class QwenImageTextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        require_max_length(cfg, PIPELINE_MAX_SEQUENCE_LENGTH, "Qwen-Image")
        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.tokenizer = src.load(AutoTokenizer, "tokenizer")
        self.model = load_text_model(Qwen2_5_VLForConditionalGeneration, src, "text_encoder", cfg, rt)

    @no_grad
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        # Truncating at max_len + 34 (the pipeline: 1024 + 34, then cuts to max_len) keeps the same
        # first max_len states: the decoder is causal, later tokens never change earlier ones.
        tokens = self.tokenizer([PROMPT_TEMPLATE.format(t) for t in texts], max_length=self.max_len + DROP_IDX,
                                padding=True, truncation=True, return_tensors="pt").to(self.device)
        out = self.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True)
        return pad_valid_tokens(out.hidden_states[-1], tokens.attention_mask, DROP_IDX, self.max_len)

    def token_counts(self, texts: list[str]) -> list[int]:
        ids = self.tokenizer([PROMPT_TEMPLATE.format(t) for t in texts], truncation=False).input_ids
        return [len(i) - DROP_IDX for i in ids]


class QwenImage(QwenImageBase):
    name = "qwen-image"
    title = "Qwen-Image"

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> QwenImageTextEncoder:
        return QwenImageTextEncoder(src, cfg, rt)
