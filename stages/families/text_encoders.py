"""Text-encoder helpers shared by the families whose captions are variable-length decoder states
(Qwen-Image's Qwen2.5-VL, Z-Image's and FLUX.2 klein's Qwen3): load in fp32/bf16/nf4, store padded with lengths, and
cut a batch back to its longest caption.
"""

from __future__ import annotations

from typing import Any

from stages.core.errors import ArtifactError, ConfigError, ResourceError
from stages.core.lazy import lazy_module

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch


def require_max_length(cfg: Any, limit: int, model: str) -> None:
    """The text encoder's own guard on captions.max_sequence_length (a loaded config has already been
    refused by the family's config_errors; this covers an encoder built from a bare CaptionsConfig)."""
    if cfg.max_sequence_length > limit:
        raise ConfigError(f"captions.max_sequence_length = {cfg.max_sequence_length} is above {model}'s {limit}; "
                          f"set it to {limit} or less")


def load_text_model(cls: Any, src: Any, subfolder: str, cfg: Any, rt: Any) -> torch.nn.Module:
    """A text encoder in fp32/bf16, or nf4 through transformers' bitsandbytes integration (CUDA);
    with layer offload (`rt` an OffloadLoad) in fp32/bf16 only, through transformers' device_map."""
    from transformers import BitsAndBytesConfig

    from stages.core.runtime import OffloadLoad, precision_dtype, require_cuda_for_nf4

    kwargs: dict[str, Any] = {"dtype": precision_dtype(cfg.text_encoder_precision, rt.device)}
    if isinstance(rt, OffloadLoad):
        kwargs.update(offload_kwargs(rt, cfg.text_encoder_precision))
        return src.load(cls, subfolder, **kwargs).eval()  # dispatched: accelerate's hooks place each layer
    if cfg.text_encoder_precision == "nf4":
        require_cuda_for_nf4("captions.text_encoder_precision", "nf4", rt)
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["device_map"] = {"": rt.device}  # bitsandbytes places the weights; no .to() afterwards
    model = src.load(cls, subfolder, **kwargs)
    if cfg.text_encoder_precision != "nf4":
        model.to(rt.device)
    return model.eval()


def offload_kwargs(rt: Any, precision: str) -> dict[str, Any]:
    """from_pretrained's layer-offload arguments: `device_map="auto"` with `max_memory` giving the
    runtime's device `rt.device_bytes` of weights (accelerate keeps room in it for the largest layer,
    the one in flight) and the rest to CPU memory, whose offloaded layers run on the device.

    Dense precisions only. bitsandbytes nf4 refuses a device map with CPU entries unless
    `llm_int8_enable_fp32_cpu_offload=True`, and then leaves every CPU-mapped module unquantized
    (transformers 5 quantizer_bnb_4bit.py adds them to `modules_to_not_convert`): the rows would mix
    nf4 and bf16 layers in a split that depends on the budget. A bf16 encoder offloaded computes
    exactly what the whole bf16 encoder computes (same weights, same kernels, only placement
    changes), so its rows and the captions' fingerprint are the bf16 ones."""
    from stages.core.runtime import require_accelerate

    require_accelerate("captions: the text encoder's layer offload")
    if precision == "nf4":
        raise ResourceError("captions.text_encoder_precision = 'nf4' cannot be combined with layer offload (bitsandbytes "
                            "leaves offloaded layers unquantized): set it to 'auto' or 'bf16'")
    if rt.device.type == "cuda":
        import psutil

        index = rt.device.index if rt.device.index is not None else torch.cuda.current_device()
        return {"device_map": "auto", "max_memory": {index: int(rt.device_bytes), "cpu": psutil.virtual_memory().available}}
    # A CPU runtime (tests): the tier below is the disk, through the same dispatch hooks
    return {"device_map": "auto", "max_memory": {"cpu": int(rt.device_bytes)}}


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
        from stages.core.runspec import command_for

        raise ArtifactError("a caption in this batch has 0 tokens in captions.zarr (a damaged or foreign row): "
                            f"rebuild it with `{command_for(None, 'encode-captions', '--force')}`")


def padded_length(lengths: torch.Tensor, stored: int, multiple: int = 1) -> int:
    """The batch's longest caption in tokens, rounded up to a multiple of `multiple` (at most the `stored` rows'
    length): fewer distinct batch shapes, each a CUDA graph, where captions of many lengths would make many."""
    longest = int(lengths.max())
    return min(stored, -(-longest // multiple) * multiple) if multiple > 1 else longest


def trim_to_longest(embeds: torch.Tensor, lengths: torch.Tensor, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut stored padding down to the batch's longest caption (rounded up to `multiple` tokens: padded_length);
    (embeds (B, L, D), mask (B, L) bool, False on padding)."""
    require_tokens([int(lengths.max())])
    longest = padded_length(lengths, embeds.shape[1], multiple)
    mask = torch.arange(longest, device=embeds.device)[None, :] < lengths.to(embeds.device)[:, None]
    return embeds[:, :longest], mask
