"""Applying a plan at run time: the config it sets, where the weights load, the VAE's slicing and tiling,
block swap, and an out-of-memory error turned into what to change."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stages.core.errors import ResourceError
from stages.core.lazy import lazy_module
from stages.core.memory import calibration as cal
from stages.core.memory import train
from stages.core.memory.stage_plan import StagePlan

torch = lazy_module("torch")  # imported at first use: `status` and a no-op `run` need no torch

if TYPE_CHECKING:
    from stages.core import blockswap


def apply_vae_plan(vae: torch.nn.Module, plan: StagePlan, tile_px: int | None = None) -> None:
    """Sliced and tiled encode as the plan says. Tiles are calibration.VAE_TILE_PIXELS square (`tile_px` instead:
    tests and `bench/tiling.py --tiny` use small tiles so tiny images really tile), overlapping by a
    quarter, as both diffusers tilings do by default; bench/tiling.py measures what tiling changes."""
    if plan.settings.get("sliced") and hasattr(vae, "enable_slicing"):
        vae.enable_slicing()
    if not (plan.settings.get("tiled") and hasattr(vae, "enable_tiling")):
        return
    side = tile_px or cal.VAE_TILE_PIXELS.get(type(vae).__name__, 512)
    if hasattr(vae, "tile_sample_min_size"):  # AutoencoderKL(-Flux2) tiles at its sample_size (1024) by default
        vae.enable_tiling()
        scale = 2 ** (len(vae.config.block_out_channels) - 1)  # 8 for the released VAEs
        vae.tile_sample_min_size, vae.tile_latent_min_size = side, side // scale
    elif hasattr(vae, "tile_sample_min_height"):  # the Qwen-Image and Wan VAEs: 256 px tiles every 192 px by default
        # by keyword: LTX-2's VAE takes a frame count third
        vae.enable_tiling(tile_sample_min_height=side, tile_sample_min_width=side,
                          tile_sample_stride_height=side * 3 // 4, tile_sample_stride_width=side * 3 // 4)
    else:
        vae.enable_tiling()


def load_device(plan: StagePlan, rt: Any) -> Any:
    """Where train loads the base: host memory when blocks will be swapped (only what stays resident
    then reaches the GPU; an nf4 base is quantized there block by block), else the runtime's device.
    A plan whose bf16 read (swap, fp8) does not fit the available host memory stops here with what to
    do, before anything loads (the kernel's OOM killer would end the process without a word). A plan
    whose fp8 base keeps only its first blocks in fp8 loads it as a MixedLoad."""
    from stages.core.runtime import HostLoad, MixedLoad

    short = train.host_shortfall(plan)
    if short:
        raise ResourceError(short)
    if plan.settings.get("fp8_blocks") is not None:  # fp8 for the first blocks, nf4 for the rest
        return MixedLoad(rt.device, rt.dtype, fp8_blocks=plan.settings["fp8_blocks"])
    swapped = plan.settings.get("swapped_blocks")
    if not swapped:
        return rt
    return HostLoad(torch.device("cpu"), rt.dtype, target=rt.device, swapped_blocks=swapped,
                    swap_layout=plan.settings.get("swap_layout", "last"))


def text_encoder_runtime(plan: StagePlan, rt: Any) -> Any:
    """Where encode-captions loads its text encoders: `rt`, or under a layer-offload plan an
    OffloadLoad giving rt's device the plan's share of the weights (accelerate checked here, before
    anything loads)."""
    from stages.core.runtime import OffloadLoad, require_accelerate

    share = plan.settings.get("gpu_weights_gb")
    if share is None:
        return rt
    require_accelerate("the encode-captions plan (layer offload of the text encoder)")
    return OffloadLoad(rt.device, rt.dtype, device_bytes=int(share * cal.GB))


def checkpointed_blocks(plan: StagePlan, blocks: int) -> int:
    """How many of the model's `blocks` repeated blocks the train plan checkpoints (all of them when the
    plan says checkpointing without a number: on CPU, or a plan made before partial checkpointing)."""
    if not plan.settings.get("gradient_checkpointing"):
        return 0
    k = plan.settings.get("checkpointed_blocks")
    return blocks if k is None else min(k, blocks)


def apply_train_plan(model: torch.nn.Module, plan: StagePlan, rt: Any) -> blockswap.BlockSwap | None:
    """Install the plan's block swap (after LoRA is attached, before the optimizer is made)."""
    from stages.core import blockswap

    swap = blockswap.install_block_swap(model, plan.settings.get("swapped_blocks", 0), rt.device,
                                        plan.settings.get("swap_layout", "last"))
    blockswap.move_unswapped(model, swap, rt.device)
    return swap
