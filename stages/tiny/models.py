"""Tiny random-weight models of the real architectures, saved as ordinary diffusers pipelines.

:func:`build_tiny_pipeline` builds every component from the real diffusers / transformers class
with a tiny config (at least one block of each block type, widths of 16-64), assembles the real
pipeline class and ``save_pretrained``s it, so that offline (``HF_HUB_OFFLINE=1``)::

    FluxPipeline.from_pretrained(folder)                      # the whole pipeline
    FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    AutoencoderKL.from_pretrained(folder, subfolder="vae")
    CLIPTextModel.from_pretrained(folder, subfolder="text_encoder")

all work like they do for the real checkpoints.  Weights are float32 and random
(``torch.manual_seed(seed)`` before each component, so a folder is a pure function of
``(variant, seed)``); the images they generate are noise, but every shape, config relation and
code path is the real one.

Variants and what they end up with (:data:`TINY_DIMS` holds the same numbers):

=============  ======  =========  =====================================  ==========================
variant        latent  VAE scale  text encoders (hidden size)            image sides must divide by
=============  ======  =========  =====================================  ==========================
flux-dev       16      2          CLIP 32 (pooled, 77 tok), T5 32 (512)  4  (scale x 2x2 packing)
flux-schnell   16      2          CLIP 32 (pooled, 77 tok), T5 32 (512)  4
qwen-image     16      2          Qwen2.5-VL 32 (<=1024 after 34 drop)   4
z-image        16      2          Qwen3 32 (hidden_states[-2], <=512)    4
flux2-klein    32      2          Qwen3 32 (layers 9/18/27, 512)         4
flux2-dev      32      2          Mistral3 32 (layers 10/20/30, 512)     4
sdxl           4       2          CLIP 32 + CLIP-proj 64 (77 tok)        2  (UNet needs 4: 2 levels)
=============  ======  =========  =====================================  ==========================

VAE scale factor: AutoencoderKL with 2 down blocks downsamples by ``2 ** (2 - 1) = 2``;
AutoencoderKLQwenImage with ``dim_mult=[1, 2]`` has one ``temperal_downsample`` entry, and the
Qwen-Image pipeline computes ``2 ** len(temperal_downsample) = 2``.  A 64x64 image is a 32x32
latent, i.e. 256 packed 2x2 tokens for the three transformers.  SDXL's 2-level UNet halves the
32x32 latent once, so SDXL image sides must be multiples of 4 as well; 64x64 is valid everywhere.

Each family builds its own (``stages/families/<family>/tiny.py``: ``TINY_DIMS`` names its variants,
``build_components(variant, seed)`` makes them, with the real config values it keeps); this module
finds a variant's family through the registry, and saves the pipeline.  Shared parts (CLIP, the KL
VAE, widths, seeding) are in :mod:`.parts`, tokenizers in :mod:`.tokenizers`.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "VARIANTS",
    "PIPELINE_CLASS_NAMES",
    "TINY_DIMS",
    "build_tiny_components",
    "build_tiny_pipeline",
]


def _family_tiny(variant: str) -> ModuleType:
    from stages.families import family_part, tiny_variants

    variants = tiny_variants()
    if variant not in variants:
        raise ValueError(f"unknown variant {variant!r}; expected one of {tuple(variants)}")
    return family_part(variants[variant], "tiny")


def __getattr__(name: str) -> Any:
    """VARIANTS, PIPELINE_CLASS_NAMES and TINY_DIMS, gathered from the families on first use. Any other
    name (the import system's `__path__` probe among them) is refused before a family module loads."""
    if name not in ("VARIANTS", "PIPELINE_CLASS_NAMES", "TINY_DIMS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from stages.families import family_part, tiny_variants

    variants = tiny_variants()
    tiny = {v: family_part(f, "tiny") for v, f in variants.items()}
    tables = {"VARIANTS": tuple(variants), "PIPELINE_CLASS_NAMES": {v: m.PIPELINE_CLASS for v, m in tiny.items()},
              "TINY_DIMS": {v: m.TINY_DIMS[v] for v, m in tiny.items()}}
    return tables[name]


def build_tiny_components(variant: str, seed: int = 0) -> dict[str, Any]:
    """The keyword arguments of the variant's pipeline class: tiny random models (eval mode,
    float32, CPU), tokenizers and scheduler.  ``getattr(diffusers, PIPELINE_CLASS_NAMES[variant])
    (**build_tiny_components(variant))`` is a working in-memory pipeline.  Each model is built
    under ``torch.manual_seed(seed)`` in a forked RNG (the caller's RNG state is untouched)."""
    return _family_tiny(variant).build_components(variant, seed)


def build_tiny_pipeline(variant: str, folder: str | Path, seed: int = 0) -> Path:
    """Build the tiny ``variant`` pipeline and ``save_pretrained`` it into ``folder`` (created if
    missing; files of an earlier save there are overwritten).  Returns the folder as a ``Path``.

    Load it back with the real class, offline:
    ``getattr(diffusers, PIPELINE_CLASS_NAMES[variant]).from_pretrained(folder)``.
    """
    import diffusers

    tiny = _family_tiny(variant)
    folder = Path(folder)
    pipe = getattr(diffusers, tiny.PIPELINE_CLASS)(**tiny.build_components(variant, seed), **tiny.PIPELINE_EXTRA)
    folder.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder
