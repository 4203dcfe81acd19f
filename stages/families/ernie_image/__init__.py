"""ERNIE-Image (baidu/ERNIE-Image, and its step-distilled ERNIE-Image-Turbo). The protocol class is in
`family.py`; this file holds what is known without torch: the config checks run before any model
loads, and the demo's hints.

No token limit is checked: ErnieImagePipeline cuts captions only at its tokenizer's model_max_length
(the Ministral 3 tokenizer's, far above any caption); captions.max_sequence_length sets where this
product cuts them, with a warning naming the captions it cut."""

from __future__ import annotations

from typing import Any

from stages.families import checks

DEMO_VARIANT = "ernie-image"  # the tiny pipeline (stages/families/ernie_image/tiny.py) the demo and tests build
DEMO_CONFIG = "demo-ernie-image.toml"


def config_errors(cfg: Any) -> list[str]:
    static = []
    if cfg.train.dynamic_shift:
        static = ["'train.dynamic_shift' = true, but ERNIE-Image's scheduler shifts every resolution by the same "
                  "static shift (4.0 in its scheduler_config.json); set it to false and give 'train.shift'"]
    return static + checks.bucket_step_multiple(cfg, 2, "the pipeline patchifies latents 2x2")
