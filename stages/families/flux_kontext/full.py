"""FLUX.1 Kontext [dev] at full size for bench/: FLUX.1-dev's released architecture; a step's image
sequence is the target's tokens plus as many control tokens (the control has the target's size)."""

from __future__ import annotations

from typing import Any

from stages.families.common import flux1_full as flux_full

PRESET = "configs/flux-kontext.toml"
TEXT_PRECISION = flux_full.TEXT_PRECISION
BUILD_SECONDS = flux_full.BUILD_SECONDS
TRAIN_SECONDS = 90  # a compiled 512 px b1 item (FLUX.1's took 65-94 s), its sequence twice FLUX.1's image tokens
TEXT_IN_SEQUENCE = True
IMAGES_IN_SEQUENCE = 2  # target + one control (the bench data's), for the 4·P·T rule
TRANSFORMER = flux_full.TRANSFORMER
COMPONENTS = flux_full.COMPONENTS


def attention_flops(cfg: Any, batch: int, img: int, txt: int) -> float:
    return flux_full.attention_flops(cfg, batch, 2 * img, txt)  # target + control tokens


def meta_forward(model: Any, b: int, h: int, w: int, txt: int, empty: Any) -> Any:
    return flux_full.meta_forward(model, b, 2 * h, w, txt, empty)  # the control doubles the image tokens
