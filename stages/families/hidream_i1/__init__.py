"""HiDream-I1 (Full, Dev, Fast). The protocol class is in `family.py`; this file holds what is known
without torch: the config checks run before any model loads, and the demo's hints."""

from __future__ import annotations

from typing import Any

from stages.families import checks

MAX_TOKENS = 512  # tokenizer_3's (T5's) model_max_length: above it T5 would be cut while Llama reads on
MAX_RESOLUTION = 1024  # the transformer's max_resolution (128 x 128 latent cells) x the VAE's 8
DEMO_VARIANT = "hidream-i1"  # the tiny pipeline (stages/families/hidream_i1/tiny.py) the demo and tests build
DEMO_CONFIG = "demo-hidream-i1.toml"

# What the libraries print that is no news: HiDreamImagePipeline asks Llama for its attention weights, which
# it never reads, and the SDPA attention it runs says it returns none.
LIBRARY_NOTICES = {"transformers.integrations.sdpa_attention":
                   ("`sdpa` attention does not support `output_attentions=True`",)}


def config_errors(cfg: Any) -> list[str]:
    errors = (checks.max_tokens(cfg, MAX_TOKENS, "HiDreamImagePipeline's T5 reads at most 512")
              + checks.bucket_step_multiple(cfg, 2, "latents are patched 2x2"))
    for d in cfg.dataset_configs():
        if d.resolution > MAX_RESOLUTION:
            errors.append(f"'data.resolution' = {d.resolution} is above hidream-i1's {MAX_RESOLUTION} (the transformer "
                          f"pads a non-square image to at most 128 x 128 latent cells); set it to {MAX_RESOLUTION} or less")
            break
    if cfg.train.dynamic_shift:
        errors.append("'train.dynamic_shift' = true does not apply to hidream-i1: HiDreamImagePipeline shifts by its fixed "
                      "largest sequence, not by the image; set it to false and give train.shift (HiDream-I1-Full: 3.0)")
    return errors
