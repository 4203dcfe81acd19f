"""Model-family registry: family name -> "module:Class", imported only when asked for.

Stages never branch on the family; they call the object `get_family(name)` returns, which follows
the protocol in `stages.families.base`. Each family is a folder `stages/families/<family>/`:

    __init__.py   torch-free facts: config checks (`config_errors`), demo hints (DEMO_VARIANT, DEMO_CONFIG,
                  and DEMO_DATA = "edit" for a family that trains on edit pairs; optionally DEMO_MODEL_VARIANT,
                  the demo's own tiny model, and DEMO_EDIT_SIZES, its edit pairs' sizes)
    family.py     the protocol class (the registry line points here), with its kohya layout
    tiny.py       its tiny random-weight pipeline(s) for tests and the demo
    full.py       its full-size architecture for bench/ (configs, text precision, FLOPs)

A family folder imports no other family folder: what two families share lives in `common/` (FLUX.1's
family class for flux and flux-kontext, Qwen-Image's for qwen-image and the edit families, FLUX.2's image
side, the BFL layouts), and a family's module may be a thin subclass or re-export of it
(tests/core/test_import_contract.py holds this). Adding a family is that folder plus one line in FAMILIES.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stages.core.runtime import LibraryNotices
    from stages.families.base import Family

FAMILIES: dict[str, str] = {
    "flux": "stages.families.flux.family:Flux",
    "qwen-image": "stages.families.qwen_image.family:QwenImage",
    "qwen-image-2.1": "stages.families.qwen_image_21.family:QwenImage21",
    "z-image": "stages.families.z_image.family:ZImage",
    "sdxl": "stages.families.sdxl.family:SDXL",
    "flux2-klein": "stages.families.flux2_klein.family:Flux2Klein",
    "flux2": "stages.families.flux2.family:Flux2",
    "krea2": "stages.families.krea2.family:Krea2",
    "flux-kontext": "stages.families.flux_kontext.family:FluxKontext",
    "qwen-image-edit": "stages.families.qwen_image_edit.family:QwenImageEdit",
    "qwen-image-edit-2511": "stages.families.qwen_image_edit_2511.family:QwenImageEdit2511",
    "chroma": "stages.families.chroma.family:Chroma",
    "ernie-image": "stages.families.ernie_image.family:ErnieImage",
    "hidream-i1": "stages.families.hidream_i1.family:HiDreamI1",
    "ideogram4": "stages.families.ideogram4.family:Ideogram4",
    "wan2.2-5b": "stages.families.wan22_5b.family:Wan22_5B",
    "wan2.2-14b": "stages.families.wan22_14b.family:Wan22_14B",
    "ltx2": "stages.families.ltx2.family:LTX2",
}


def get_family(name: str) -> "Family":
    if name not in FAMILIES:
        raise KeyError(f"unknown family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    module, cls = FAMILIES[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def pipeline_class(family: "Family") -> Any:
    """The family's diffusers pipeline class, with the modules its folders may name for a component imported
    first (family.pipeline_modules): use it for `from_pretrained` of a whole pipeline."""
    import diffusers

    for module in family.pipeline_modules:
        importlib.import_module(module)
    return getattr(diffusers, family.pipeline_class)


def check_model_family(cfg: Any) -> None:
    """ModelError when the run's local model folder holds another family's denoiser, naming both and
    the family that trains it (stages.core.model_source.ModelSource.check_family). Only a mismatch imports
    the other families (one of them imports transformers: seconds of every stage's start-up)."""
    import json

    from stages.core.errors import ModelError
    from stages.core.model_source import model_source

    src, family = model_source(cfg), get_family(cfg.family)
    index_file = src.path / "model_index.json"
    if src.is_single_file or not index_file.is_file():
        return
    try:
        src.check_family(family)
        return
    except ModelError:
        pass  # name the families that do train this folder
    index = json.loads(index_file.read_text())
    held = {k: v[1] for k, v in index.items() if isinstance(v, list) and len(v) == 2}
    found = [(get_family(name).pipeline_class != index.get("_class_name"), name) for name in FAMILIES
             if all(held.get(c) == get_family(name).denoiser_class for c in get_family(name).denoiser_components)]
    src.check_family(family, [name for _, name in sorted(found)])


def family_part(name: str, part: str = "") -> ModuleType:
    """A module of the family's folder ("" = the torch-free package itself, "tiny", "full")."""
    package = FAMILIES[name].split(":")[0].rsplit(".", 1)[0]
    return importlib.import_module(f"{package}.{part}" if part else package)


def config_errors(cfg: Any) -> list[str]:
    """The family's checks of a loaded config (token limits, bucket multiples), made before any
    model loads; each message names the key, its value and the valid range. An unknown family
    yields nothing here (the config validator reports it)."""
    if cfg.family not in FAMILIES:
        return []
    errors = family_part(cfg.family).config_errors(cfg)
    if cfg.train.expert and not demo_hint(cfg.family, "EXPERTS", ()):
        errors.append(f"train.expert = '{cfg.train.expert}': family = '{cfg.family}' has one denoiser; remove "
                      f"train.expert (it picks an expert of a two-expert model such as wan2.2-14b)")
    return errors


def demo_variant(name: str) -> str:
    """The tiny pipeline variant the demo and the tests build for this family."""
    return family_part(name).DEMO_VARIANT


def demo_hint(name: str, key: str, default: Any) -> Any:
    """A demo hint the family's folder may declare (DEMO_DATA, DEMO_EDIT_SIZES, ...), else `default`."""
    return getattr(family_part(name), key, default)


def demo_model_variant(name: str) -> str:
    """The tiny pipeline `pipeline.py demo` builds: the family's DEMO_MODEL_VARIANT where it has one
    (the edit families' demos), else the tests' DEMO_VARIANT."""
    return demo_hint(name, "DEMO_MODEL_VARIANT", demo_variant(name))


def library_notices() -> "LibraryNotices":
    """The library messages and warnings every family's folder declares no news (LIBRARY_NOTICES,
    LIBRARY_WARNINGS in its torch-free `__init__.py`), for the stages to quiet."""
    from stages.core.runtime import LibraryNotices

    messages: dict[str, tuple[str, ...]] = {}
    warnings: list[tuple[str, str, str]] = []
    for name in FAMILIES:
        part = family_part(name)
        for logger, fragments in getattr(part, "LIBRARY_NOTICES", {}).items():
            messages[logger] = messages.get(logger, ()) + tuple(f for f in fragments if f not in messages.get(logger, ()))
        warnings += [w for w in getattr(part, "LIBRARY_WARNINGS", ()) if w not in warnings]
    return LibraryNotices(messages, tuple(warnings))


def tiny_variants() -> dict[str, str]:
    """Every tiny pipeline variant -> its family, in registry order."""
    return {variant: name for name in FAMILIES for variant in family_part(name, "tiny").TINY_DIMS}
