"""An nf4 base quantized block by block, for a plan that swaps blocks: the GPU never holds the whole base.

    model = load_nf4_by_block(FluxTransformer2DModel, src, "transformer", torch.device("cuda"), swapped_blocks=40)

diffusers' own nf4 load (`BitsAndBytesConfig`) quantizes every weight on the GPU as it reads it, so the
whole nf4 base sits on the GPU once even when most blocks will then move to host memory: FLUX.1-dev
needs ~6.7 GB for that, and a 6 GB budget could not use nf4 with block swap at all. Here the bf16 base
is read into host memory, then quantized one layer at a time on `device`:

- everything outside the repeated blocks, then each block in order: its Linears become bitsandbytes
  `Linear4bit` (each bf16 weight copied to `device`, quantized there, the dense copy dropped);
- a block that the plan swaps goes back to host memory, quantized (a Params4bit's `.to` moves its
  quant_state too); the rest stays on `device`. Peak on `device`: the resident part plus one layer.

It is the same model as diffusers' nf4 load, built by diffusers' own quantizer object: its
`preprocess_model` swaps in the `Linear4bit`s by its rule (every `nn.Linear` except the class's
`_keep_in_fp32_modules`) and sets `is_loaded_in_4bit` (which peft reads to wrap a layer with its bnb
LoRA layer), its `create_quantized_param` makes each `Params4bit` exactly as a load does, and the
model gets the same `hf_quantizer` and `_pre_quantization_dtype`. Only the order (one block at a
time) and the placement differ. On CPU bitsandbytes (0.50) quantizes on the CPU, which the tests use.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.core import blockswap


def nf4_config(double_quant: bool) -> Any:
    """The BitsAndBytesConfig of train.base_precision = "nf4" (the diffusers load uses the same)."""
    from diffusers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                              bnb_4bit_use_double_quant=double_quant)


def _keep_in_fp32(model: torch.nn.Module) -> list[str]:
    """What diffusers' from_pretrained passes its quantizer as `keep_in_fp32_modules`."""
    keep = getattr(type(model), "_keep_in_fp32_modules", None)
    return [] if keep is None else list(keep) if isinstance(keep, (list, tuple)) else [keep]


def _groups(model: torch.nn.Module, swapped_blocks: int, layout: str = "last") -> list[tuple[list[torch.nn.Module], bool]]:
    """(modules, goes to host) in quantization order: the modules outside the repeated blocks, then
    each block with its submodules; the `swapped_blocks` blocks blockswap swaps for `layout` go to host."""
    blocks = blockswap.repeated_blocks(model)
    swapped = {id(blocks[i]) for i in blockswap.swapped_positions(len(blocks), swapped_blocks, layout)}
    inside = {id(m) for b in blocks for m in b.modules()}
    rest = [m for m in model.modules() if id(m) not in inside]
    return [(rest, False)] + [(list(b.modules()), id(b) in swapped) for b in blocks]


def _move_own(module: torch.nn.Module, device: torch.device | str) -> None:
    """The module's own parameters and buffers to `device` (a Params4bit with its quant_state)."""
    for name, p in module._parameters.items():
        if p is None:
            continue
        if blockswap.quantized(p):
            module._parameters[name] = p.to(device)
        else:
            p.data = p.data.to(device)
    for name, buf in module._buffers.items():
        if buf is not None:
            module._buffers[name] = buf.to(device)


def quantize_nf4_by_block(model: torch.nn.Module, double_quant: bool, device: torch.device | str,
                          swapped_blocks: int, layout: str = "last", keep: list[str] = ()) -> torch.nn.Module:
    """Turn a dense bf16 `model` (in host memory) into diffusers' nf4 model, block by block on `device`;
    the `swapped_blocks` repeated blocks swapped for `layout` end in host memory, everything else on `device`.
    The Linears named in `keep` (full module names) are not quantized, only moved (a mixed fp8/nf4 base's
    fp8 blocks, stages/core/fp8.py `quantize_fp8_nf4`)."""
    import bitsandbytes as bnb
    from diffusers.quantizers import DiffusersAutoQuantizer

    device = torch.device(device)
    dense = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    quantizer = DiffusersAutoQuantizer.from_config(nf4_config(double_quant), pre_quantized=False)
    # diffusers leaves a Linear unconverted whose full name equals one of these (or has one as a prefix + ".")
    quantizer.preprocess_model(model=model, device_map=None, keep_in_fp32_modules=_keep_in_fp32(model) + list(keep))
    names = {id(m): name for name, m in model.named_modules()}
    for modules, to_host in _groups(model, swapped_blocks, layout):
        for module in modules:
            if isinstance(module, bnb.nn.Linear4bit):  # quantized on `device` (one layer there at a time)
                name, old = names[id(module)], dense.pop(names[id(module)])
                quantizer.create_quantized_param(model, old.weight.detach(), f"{name}.weight", device, {})
                if old.bias is not None:
                    quantizer.create_quantized_param(model, old.bias.detach(), f"{name}.bias", device, {})
                if to_host:
                    _move_own(module, "cpu")
            elif not to_host:
                _move_own(module, device)
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    model.register_to_config(_pre_quantization_dtype=torch.bfloat16)
    model.requires_grad_(False)
    return model


def load_nf4_by_block(cls: Any, src: Any, subfolder: str, device: torch.device, swapped_blocks: int,
                      double_quant: bool, layout: str = "last") -> torch.nn.Module:
    """Read the bf16 base into host memory and quantize it block by block (see the module doc)."""
    model = src.load(cls, subfolder, torch_dtype=torch.bfloat16)
    return quantize_nf4_by_block(model, double_quant, device, swapped_blocks, layout)
