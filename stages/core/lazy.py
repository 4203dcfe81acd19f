"""Heavy libraries imported on first use, so that `status`, a no-op `run` and a family's traits need no torch.

    from stages.core.lazy import lazy_module, no_grad
    torch = lazy_module("torch")     # `import torch` happens at the first `torch.<name>`

    @no_grad
    def encode(self, texts): ...     # as @torch.no_grad(), without importing torch to define it

`import torch` takes ~1.2 s (diffusers and transformers several more), while `status` only reads
manifests, the image index and family traits (0.6 s in all for 1k items). The stand-in is not put in sys.modules
(importlib.util.LazyLoader would be, and libraries that probe `sys.modules` for torch would load it), so
`'torch' not in sys.modules` holds until code really uses it (tests/stages/test_image_index.py runs
`status` and a no-op `run` and finds torch, diffusers and transformers not imported).
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class LazyModule:
    """A module's stand-in: any attribute imports the module (once) and reads it from there."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        module = sys.modules.get(self._name) or importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy_module(name: str) -> Any:
    """`name`, imported at its first attribute use (typed Any: write `torch.Tensor` annotations as usual)."""
    return LazyModule(name)


def no_grad(f: F) -> F:
    """`@torch.no_grad()` for a function, with torch imported when the function first runs."""
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            return f(*args, **kwargs)
    return wrapper  # type: ignore[return-value]
