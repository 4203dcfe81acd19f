"""Model-family registry: family name -> "module:Class", imported only when asked for.

Stages never branch on the family; they call the object `get_family(name)` returns, which follows
the protocol in `stages.families.base`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stages.families.base import Family

FAMILIES: dict[str, str] = {
    "flux": "stages.families.flux:Flux",
    "qwen-image": "stages.families.qwen_image:QwenImage",
    "z-image": "stages.families.z_image:ZImage",
    "sdxl": "stages.families.sdxl:SDXL",
}


def get_family(name: str) -> "Family":
    if name not in FAMILIES:
        raise KeyError(f"unknown family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    module, cls = FAMILIES[name].split(":")
    return getattr(importlib.import_module(module), cls)()
