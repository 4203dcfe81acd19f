"""Random-weight full-size pipelines of every registered family, and their denoisers' FLOPs.

    from bench.full_configs import build_full_pipeline
    build_full_pipeline("flux", "/dev/shm/flux-full", device="cuda")   # ~34 GB of bf16 safetensors

Each family's full-size facts live with it (`stages/families/<family>/full.py`: COMPONENTS, PRESET,
TEXT_PRECISION, BUILD_SECONDS, attention_flops, meta_forward); the numbers are the released checkpoints' config.json values (FLUX.1-dev, Qwen-Image,
Z-Image-Turbo, SDXL base 1.0 and their text encoders and VAEs). Weights are random (each
class's own init, on the GPU, in bf16); tokenizers and schedulers come from `stages.tiny` (a
tokenizer's vocabulary is smaller than the model's, which only narrows the ids it emits). The
folder is an ordinary diffusers pipeline, so the stages load it exactly as they load the real one.

`denoiser_flops` counts the forward matmul FLOPs of a denoiser at a training shape by running it
on the meta device with a hook on every Linear (no memory, no GPU), for the MFU in bench/RESULTS.md.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import torch

from stages.families import FAMILIES, demo_variant, family_part, get_family
from stages.families.flux.full import T5_XXL, TRANSFORMER as FLUX_DEV_TRANSFORMER  # noqa: F401 - bench/multigpu, block_probe


def full(family: str) -> ModuleType:
    """The family's full-size module (stages/families/<family>/full.py)."""
    return family_part(family, "full")


# family -> component name -> builder(tiny components, for their tokenizers) -> full-size module
FULL = {name: full(name).COMPONENTS for name in FAMILIES}


def denoiser_name(family: str) -> str:
    return get_family(family).denoiser_components[0]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_module(family: str, name: str, device: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """One full-size component with random weights, made directly on `device` (meta: no memory)."""
    from stages.tiny.models import build_tiny_components

    tiny = build_tiny_components(demo_variant(family))
    with torch.device(device), default_dtype(dtype):
        return FULL[family][name](tiny).eval()


def pipeline_extra(family: str) -> dict[str, Any]:
    """The pipeline's own init arguments for the full-size folder (model_index.json): full.py's
    PIPELINE_EXTRA where the released checkpoint's differ from the tiny model's (Krea 2's tapped text
    layers), else the tiny module's."""
    return getattr(full(family), "PIPELINE_EXTRA", None) or family_part(family, "tiny").PIPELINE_EXTRA


def build_full_pipeline(family: str, folder: str | Path, device: str = "cuda",
                        dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Build every component at full size on `device` and save_pretrained the pipeline into folder.
    Returns parameter counts (billions) per component."""
    import diffusers

    tiny_module = family_part(family, "tiny")
    tiny = tiny_module.build_components(demo_variant(family), 0)
    parts = {k: v for k, v in tiny.items() if not isinstance(v, torch.nn.Module)}  # tokenizers, scheduler
    with torch.device(device), default_dtype(dtype):
        for name, build in FULL[family].items():
            parts[name] = build(tiny).eval()
    counts = {name: sum(p.numel() for p in parts[name].parameters()) / 1e9 for name in FULL[family]}
    pipe = getattr(diffusers, tiny_module.PIPELINE_CLASS)(**parts, **pipeline_extra(family))
    Path(folder).mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return counts


# ---- FLOPs for MFU ---------------------------------------------------------------------------------


def denoiser_flops(family: str, batch: int, latent_hw: tuple[int, int], text_tokens: int) -> dict[str, float]:
    """Forward FLOPs of one denoiser call on the meta device: every Linear (2 * in * out per row it
    sees) and the attention products (the family's `attention_flops`; DiT families only). Also the
    usual rule of thumb 2 * params * tokens."""
    model = build_module(family, denoiser_name(family), "meta")
    params = sum(p.numel() for p in model.parameters())
    linear = [0]

    def hook(mod: torch.nn.Linear, inputs: tuple[torch.Tensor, ...], _: Any) -> None:
        linear[0] += 2 * (inputs[0].numel() // mod.in_features) * mod.in_features * mod.out_features

    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(hook)
    h, w = latent_hw
    img = getattr(full(family), "image_tokens", lambda h, w: (h // 2) * (w // 2))(h, w)  # 2x2 packing by default
    with torch.no_grad():
        full(family).meta_forward(model, batch, h, w, text_tokens, _meta_empty)
    attn = full(family).attention_flops(model.config, batch, img, text_tokens)
    images = getattr(full(family), "IMAGES_IN_SEQUENCE", 1)  # edit families: the control's tokens join the target's
    tokens = batch * (images * img + (text_tokens if full(family).TEXT_IN_SEQUENCE else 0))
    return {"params": float(params), "linear_fwd": float(linear[0]), "attention_fwd": float(attn),
            "tokens": float(tokens), "rule_of_thumb_fwd": 2.0 * params * tokens}


def _meta_empty(*shape: int, fp32: bool = False, long: bool = False) -> torch.Tensor:
    """An input of the meta forward: bf16, or float32 (timesteps, guidance) / int64 (UNet timesteps)."""
    dtype = torch.long if long else torch.float32 if fp32 else torch.bfloat16
    return torch.empty(*shape, device="meta", dtype=dtype)
