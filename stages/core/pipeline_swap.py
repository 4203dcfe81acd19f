"""A diffusers pipeline whose denoiser swaps blocks, for the sample stage under a budget its nf4 pipeline does not
fit even offloaded (stages/core/memory/sample.py `swap_candidates`).

    pipe = load(cfg, family, src, rt, FluxPipeline, quantization_config=...)  # denoiser loaded as train does
    ... pipe.load_lora_weights(...) for every adapter ...
    swap = install(pipe, family, 42, rt.device, offload=True)                 # then render

- The denoiser loads as train loads a base it swaps (stages/core/lora.py `load_denoiser_weights`): an nf4 base
  quantized block by block, here every block left in host memory; the pipeline's other components load as the
  plan says (nf4 text encoders, the VAE as it is).
- `install` runs once every adapter is loaded, so each is in place when the swap packs its block (a column then
  switches adapters with `set_adapters`, loading nothing), and brings the blocks it does not swap to the GPU. Two
  GPU slots of the largest block stay there; swapped blocks are copied into them as they run
  (stages/core/blockswap.py, without gradients).
- With `offload`, one component is on the GPU at a time, the denoiser's resident part (all but its swapped
  blocks) and its two slots counted as one: before a component runs, the others go to host memory, and the
  slots' memory is given back until the denoiser runs again. diffusers' own model offload
  would move the whole denoiser, swapped blocks and all, so accelerate hooks of this module do it instead; the
  VAE's `decode` calls its hook as diffusers' offload relies on.
"""

from __future__ import annotations

from typing import Any

import torch


def load(cfg: Any, family: Any, src: Any, rt: Any, cls: Any, **pipeline_kwargs: Any) -> Any:
    """The pipeline (`cls`, the family's) with its denoiser loaded for swapping: every repeated block in host
    memory (nf4: quantized one at a time on the GPU first), not yet swapped (`install` does that, and brings the
    blocks it leaves resident to the GPU once the other components have left it)."""
    import sys

    from stages.core.runtime import HostLoad

    name = family.denoiser_components[0]
    precision = "nf4" if cfg.sample.precision == "nf4" else "fp32" if rt.dtype == torch.float32 else "bf16"
    # every block to host memory (blockswap.swapped_positions takes at most all of them)
    host = HostLoad(torch.device("cpu"), rt.dtype, target=rt.device, swapped_blocks=sys.maxsize)
    denoiser = family.load_denoiser(src, precision, host, cfg.train).eval()
    return src.load_pipeline(cls, torch_dtype=rt.dtype, **{name: denoiser}, **pipeline_kwargs)


def install(pipe: Any, family: Any, swapped_blocks: int, device: torch.device, offload: bool) -> Any:
    """Swap the denoiser's last `swapped_blocks` blocks (after its adapters are loaded), its other weights on
    `device`; the other components on `device` too, or with `offload` one at a time. -> the BlockSwap."""
    from stages.core import blockswap

    denoiser = getattr(pipe, family.denoiser_components[0])
    others = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module) and m is not denoiser]
    if offload:  # before the denoiser's resident part arrives (nf4 text encoders load onto the GPU)
        for module in others:
            module.to("cpu")
    swap = blockswap.install_block_swap(denoiser, swapped_blocks, device)
    blockswap.move_unswapped(denoiser, swap, device)
    if offload:
        one_at_a_time(denoiser, swap, others, device)
    else:
        for module in others:
            module.to(device)
    return swap


def one_at_a_time(denoiser: torch.nn.Module, swap: Any, others: list[torch.nn.Module], device: torch.device) -> None:
    """Before any of `others` or the denoiser runs, the rest go to host memory and it comes to `device` (the
    denoiser: all but its swapped blocks, which the swap copies itself, and its two slots, whose memory another
    component has while it runs: `BlockSwap.release_slots`)."""
    from accelerate.hooks import ModelHook, add_hook_to_module
    from accelerate.utils import send_to_device

    from stages.core import blockswap

    on_device: list[torch.nn.Module | None] = [denoiser]  # install leaves the denoiser's resident part there

    def bring(module: torch.nn.Module) -> None:
        if on_device[0] is module:
            return
        for other in others:
            if other is not module:
                other.to("cpu")
        if swap is not None:
            swap.restore_slots() if module is denoiser else swap.release_slots()
        blockswap.move_unswapped(denoiser, swap, device if module is denoiser else torch.device("cpu"))
        if module is not denoiser:
            module.to(device)
        on_device[0] = module

    class OnDevice(ModelHook):
        """accelerate's hook (diffusers' pipelines read `execution_device`; the VAE's decode calls pre_forward)."""

        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module, self.execution_device = module, device

        def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            bring(self.module)
            return send_to_device(args, device), send_to_device(kwargs, device)

    for module in (*others, denoiser):
        add_hook_to_module(module, OnDevice(module))
