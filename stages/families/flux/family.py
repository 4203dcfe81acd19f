"""FLUX.1 [dev] and [schnell]: the FLUX.1 family of `stages.families.common.flux1` as it is."""

from __future__ import annotations

from stages.families.common.flux1 import Flux1


class Flux(Flux1):
    name = "flux"
    title = "FLUX"
