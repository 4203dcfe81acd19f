"""Sizes from the meta device: each component built from its config.json (no weights read), and its
weights' bytes per precision (bf16, fp32, fp8, nf4, a mix of fp8 and nf4 blocks)."""

from __future__ import annotations

from typing import Any, Callable

from stages.core.lazy import lazy_module
from stages.core.memory import calibration as cal

torch = lazy_module("torch")  # imported at first use: `status` and a no-op `run` need no torch


# (library, class, config.json) -> its meta module: one stage process plans several times before it
# loads anything (its own plan; the fingerprints of its cache and the upstream ones, each of which
# asks what the stage would plan, and under "auto" plans train as well), and a big denoiser or text
# encoder takes 0.1-0.5 s to build on the meta device each time.
_META_CACHE: dict[tuple[str, str, str], torch.nn.Module] = {}
_META_CACHE_SIZE = 8


def with_named_blocks(model: torch.nn.Module, family: Any) -> torch.nn.Module:
    """`model` with its repeated block classes named where its diffusers class names none (family.repeated_blocks:
    HiDream-I1), so blockswap finds its blocks."""
    if family.repeated_blocks:
        model._repeated_blocks = list(family.repeated_blocks)
    return model


def meta_component(src: Any, subfolder: str) -> torch.nn.Module:
    """The component's module built from its config on the meta device (no weights, no memory),
    once per process for each class and config (`_META_CACHE`). Shared: callers only read sizes
    (`offload_placement` sets its dtype first, which no other size here reads)."""
    import json

    library, class_name = src.component_config("", "model_index.json")[subfolder]
    config = src.component_config(subfolder)
    key = (library, class_name, json.dumps(config, sort_keys=True))
    if key in _META_CACHE:
        _META_CACHE[key] = _META_CACHE.pop(key)  # most recently used last
        return _META_CACHE[key]
    module = _build_meta(component_class(library, class_name), config)
    _META_CACHE[key] = module
    while len(_META_CACHE) > _META_CACHE_SIZE:
        _META_CACHE.pop(next(iter(_META_CACHE)))
    return module


def component_class(library: str, class_name: str) -> Any:
    """A model_index.json entry's class, found as diffusers finds it: a library named after one of diffusers'
    pipeline modules (LTX-2's "ltx2" text connectors and vocoder) is that module, else an importable package."""
    import importlib

    from diffusers import pipelines

    module = getattr(pipelines, library) if hasattr(pipelines, library) else importlib.import_module(library)
    return getattr(module, class_name, None)


def _build_meta(cls: type, config: dict[str, Any]) -> torch.nn.Module:
    from diffusers.configuration_utils import ConfigMixin

    with torch.device("meta"):
        return cls.from_config(config) if issubclass(cls, ConfigMixin) else cls(cls.config_class.from_dict(config))


def weight_bytes(module: torch.nn.Module, precision: str, codes_only: bool = False) -> float:
    """Bytes of `module`'s weights at `precision` (nf4: every Linear weight 4-bit, the rest bf16).
    `codes_only`: an nf4 weight's 4-bit codes without its absmax (what block swap moves to host
    memory; the quant_state stays on the GPU, stages/core/blockswap.py)."""
    if precision == "fp8":
        return _fp8_weight_bytes(module)
    if precision != "nf4":
        return sum(p.numel() for p in module.parameters()) * (4 if precision == "fp32" else 2)
    return sum(_nf4_param_bytes(module, codes_only).values())


def _nf4_param_bytes(module: torch.nn.Module, codes_only: bool = False) -> dict[int, float]:
    """Each parameter's bytes (by id) in an nf4 load of `module` (weight_bytes)."""
    # transformers leaves `_keep_in_fp32_modules` unquantized (T5's `wo`: measured 4.41 GB for FLUX's
    # nf4 text encoders on the H200 where all-4-bit predicted 2.81; bench/results/memory-flux-h200.json)
    kept = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    # nor does it quantize the output embedding (Qwen2.5-VL's lm_head: 1.09 GB bf16; the nf4 encode
    # of Qwen-Image measured 6.33 GB allocated where counting it as 4-bit predicted 4.81)
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    skip = {id(head.weight)} if isinstance(head, torch.nn.Linear) else set()
    linear = {id(m.weight) for name, m in module.named_modules()
              if isinstance(m, torch.nn.Linear) and not any(k in name.split(".") for k in kept)} - skip
    per_weight = 0.5 if codes_only else cal.NF4_BYTES_PER_WEIGHT
    return {id(p): p.numel() * (per_weight if id(p) in linear else 2) for p in module.parameters()}


def fp8_nf4_weight_bytes(model: torch.nn.Module) -> list[float]:
    """Bytes of the base with its first m repeated blocks in fp8 and the rest of it in nf4, for m = 0..n
    (stages/core/fp8.py `quantize_fp8_nf4`): m = 0 is the nf4 base; a block in fp8 counts its eligible
    Linears' weights at one byte plus a 4-byte scale per output channel, its other weights bf16."""
    from stages.core import blockswap

    nf4 = _nf4_param_bytes(model)
    sizes = [sum(nf4.values())]
    for block in blockswap.repeated_blocks(model):
        as_fp8 = _fp8_bytes_where(block, lambda name, linear: False)  # every eligible Linear of the block
        sizes.append(sizes[-1] - sum(nf4[id(p)] for p in block.parameters()) + as_fp8)
    return sizes


def _fp8_weight_bytes(module: torch.nn.Module) -> float:
    """An fp8 base as stages/core/fp8.py makes it: each eligible Linear inside the repeated blocks one
    byte per weight plus a 4-byte scale per output channel, everything else bf16 (a denoiser: fp8 blocks
    are never swapped, so no single block is sized)."""
    from stages.core import fp8

    return _fp8_bytes_where(module, fp8.inside_repeated_blocks(module))


def _fp8_bytes_where(module: torch.nn.Module, keep: Callable[[str, torch.nn.Module], bool]) -> float:
    """`module`'s bytes with each eligible Linear that `keep(name, linear)` rejects in fp8 (a byte per weight
    plus a 4-byte scale per output channel, as stages/core/fp8.py makes it) and every other weight bf16."""
    from stages.core import fp8

    quantized = {id(m.weight): m.weight.shape[0] for name, m in module.named_modules()
                 if type(m) is torch.nn.Linear and fp8.fp8_eligible(m) and not keep(name, m)}
    return sum(p.numel() + 4 * quantized[id(p)] if id(p) in quantized else 2 * p.numel() for p in module.parameters())


def _width(module: torch.nn.Module) -> int:
    """The hidden width activations scale with: a text model's hidden_size (a vision-language
    encoder's first Linear is its vision tower's, 1280 wide in Qwen2.5-VL against 3584), else the
    first Linear's input width."""
    from transformers import PretrainedConfig

    config = getattr(module, "config", None)
    if isinstance(config, PretrainedConfig):
        hidden = getattr(getattr(config, "text_config", None) or config, "hidden_size", None)
        if isinstance(hidden, int):
            return hidden
    return next(m.in_features for m in module.modules() if isinstance(m, torch.nn.Linear))


def text_dims(module: torch.nn.Module) -> tuple[int, int, int, int]:
    """A text encoder's (width, attention heads, layers, vocabulary of its output head) from its config: the
    sizes encode-captions' activations scale with. The head is 0 where the model has none (an encoder, or a
    base model without its language-model head); heads and layers 0 where the config does not say."""
    from transformers import PretrainedConfig

    config = getattr(module, "config", None)
    text = (getattr(config, "text_config", None) or config) if isinstance(config, PretrainedConfig) else None
    heads, layers = (getattr(text, k, 0) for k in ("num_attention_heads", "num_hidden_layers"))
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    vocab = head.out_features if isinstance(head, torch.nn.Linear) else 0
    return work_width(module), heads if isinstance(heads, int) else 0, layers if isinstance(layers, int) else 0, vocab


def work_width(model: Any) -> int:
    """The width a model's work runs at: its repeated blocks' (their first Linear's input), else the text width its
    config gives, else the width most of its Linears take. A denoiser's first Linear is its patch projection (LTX-2:
    128 channels, against its blocks' 4096) and LTX-2's text connectors' is their projection of every Gemma layer
    at once (188,160 wide, against their blocks' 3840)."""
    from collections import Counter

    from transformers import PretrainedConfig

    from stages.core import blockswap

    blocks = blockswap.repeated_blocks(model)
    if blocks:
        return _width(blocks[0])
    if isinstance(getattr(model, "config", None), PretrainedConfig):
        return _width(model)
    widths = Counter(m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    return widths.most_common(1)[0][0] if widths else _width(model)


def module_components(src: Any, names: tuple[str, ...]) -> list[str]:
    """The components among `names` that are torch modules (not a tokenizer, processor or scheduler)."""
    index = src.component_config("", "model_index.json")
    return [c for c in names if c in index and isinstance(index[c], list) and index[c][0]
            and isinstance(cls := component_class(*index[c]), type)
            and issubclass(cls, torch.nn.Module)]


def latent_frames(family: Any, frames: int) -> int:
    """Latent frames of a clip of `frames` frames (1 for an image family): the causal VAE keeps the first
    frame alone, then one latent frame per family.frames_per_latent frames."""
    return (frames - 1) // family.frames_per_latent + 1 if family.trains_video else 1


def planned_frames(cfg: Any, family: Any) -> int:
    """The most frames a sample of the run's datasets has: data.frames for a video family, else 1."""
    return max(d.frames for d in cfg.dataset_configs()) if family.trains_video else 1


def sample_tokens(family: Any, width: int, height: int, frames: int = 1) -> int:
    """Denoiser tokens of one sample: (side / pixels_per_token)^2 per latent frame."""
    step = family.pixels_per_token
    return (width // step) * (height // step) * latent_frames(family, frames)
