"""Text-encoder helpers shared by the families whose captions are variable-length decoder states
(Qwen-Image's Qwen2.5-VL, Z-Image's and FLUX.2 klein's Qwen3): load in fp32/bf16/nf4, store padded with lengths, and
cut a batch back to its longest caption.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.core.errors import ArtifactError


def load_text_model(cls: Any, src: Any, subfolder: str, cfg: Any, rt: Any) -> torch.nn.Module:
    """A text encoder in fp32/bf16, or nf4 through transformers' bitsandbytes integration (CUDA)."""
    from transformers import BitsAndBytesConfig

    from stages.core.runtime import precision_dtype, require_cuda_for_nf4

    kwargs: dict[str, Any] = {"dtype": precision_dtype(cfg.text_encoder_precision, rt.device)}
    if cfg.text_encoder_precision == "nf4":
        require_cuda_for_nf4("captions.text_encoder_precision", "nf4", rt)
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["device_map"] = {"": rt.device}  # bitsandbytes places the weights; no .to() afterwards
    model = src.load(cls, subfolder, **kwargs)
    if cfg.text_encoder_precision != "nf4":
        model.to(rt.device)
    return model.eval()


def load_chat_tokenizer(src: Any, family: str) -> Any:
    """The pipeline's tokenizer, which must carry the chat template the family's prompts go through."""
    from transformers import AutoTokenizer

    from stages.core.model_source import ModelError

    tokenizer = src.load(AutoTokenizer, "tokenizer")
    if not tokenizer.chat_template:  # a processor saved before chat_template.jinja keeps it in chat_template.json
        try:
            tokenizer.chat_template = src.component_config("tokenizer", "chat_template.json")["chat_template"]
        except (ModelError, KeyError):
            pass
    if not tokenizer.chat_template:
        raise ModelError(f"'{src.ref}' tokenizer/ has no chat template, which {family}'s prompts need: point "
                         f"'model' at a {family} pipeline whose tokenizer_config.json has a chat_template")
    return tokenizer


def chat_prompts(tokenizer: Any, texts: list[str], enable_thinking: bool) -> list[str]:
    """Each caption as the user turn of the chat template, with the assistant's generation prompt."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True,
                                          enable_thinking=enable_thinking) for t in texts]


def pad_valid_tokens(hidden: torch.Tensor, mask: torch.Tensor, drop: int, max_len: int) -> dict[str, torch.Tensor]:
    """Each row's unmasked hidden states (either padding side), minus the first `drop`, cut to
    max_len and right-padded with zeros: {"prompt_embeds": (B, max_len, ...), "prompt_length": (B,)}."""
    rows = [h[m.bool()][drop:drop + max_len] for h, m in zip(hidden, mask)]
    embeds = hidden.new_zeros(len(rows), max_len, *hidden.shape[2:])
    for i, row in enumerate(rows):
        embeds[i, :len(row)] = row
    return {"prompt_embeds": embeds, "prompt_length": torch.tensor([len(r) for r in rows], dtype=torch.int64)}


def require_tokens(lengths: list[int]) -> None:
    """A cached caption of 0 tokens is a damaged captions.zarr row (encoding always keeps the caption
    and template tokens): the fix is to rebuild that cache."""
    if min(lengths) == 0:
        raise ArtifactError("a caption in this batch has 0 tokens in captions.zarr (a damaged or foreign row): "
                            "re-run `python pipeline.py encode-captions --force` with this config")


def trim_to_longest(embeds: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut stored padding down to the batch's longest caption; (embeds (B, L, D), mask (B, L) bool)."""
    require_tokens([int(lengths.max())])
    longest = int(lengths.max())
    mask = torch.arange(longest, device=embeds.device)[None, :] < lengths.to(embeds.device)[:, None]
    return embeds[:, :longest], mask
