"""Which families' attention would mix output-gradient layouts under one cached cuDNN backward graph (CPU).

torch caches cuDNN's attention backward by query/key/value shapes and strides only, and keeps the strides of
the output gradient it was built with (stages/core/runtime.py `cudnn_safe_sdpa`). This runs one train step
of every family's tiny real model through the train stage, with cuDNN's guard off (the default), and counts
per family the attention cache keys and those that see more than one gradient layout: the ones
`runtime.cudnn_attention = true` would have crashed on (or read wrong gradients) without the guard.

    .venv/bin/python bench/attention_layouts.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import FAMILIES, make_cfg  # noqa: E402  (the tests' tiny models and configs)
from test_runtime_flags import layout_spy  # noqa: E402  (the test's record of attention calls)

from stages import cache_latents, encode_captions, train  # noqa: E402
from stages.tiny.shapes import make_demo_dataset, make_edit_dataset  # noqa: E402

EDIT = ("flux-kontext", "qwen-image-edit")


def main() -> None:
    root = Path(tempfile.mkdtemp())
    data = {False: make_demo_dataset(root / "data", n=4, seed=0), True: make_edit_dataset(root / "edit", n=4, seed=0)}
    plain = F.scaled_dot_product_attention
    for family in FAMILIES:
        layouts: dict[tuple, set] = {}
        cfg = make_cfg(family, root / "assets", data[family in EDIT], root / family,
                       **{"run": "layouts", "train.steps": 1, "runtime.checkpoint_every": 0, "data.cache_variants": 1})
        encode_captions.run(cfg)
        cache_latents.run(cfg)
        F.scaled_dot_product_attention = layout_spy(plain, layouts)  # diffusers looks it up at each call
        try:
            train.run(cfg)
        finally:
            F.scaled_dot_product_attention = plain
        mixed = sum(len(v) > 1 for v in layouts.values())
        print(f"{family:16} {len(layouts)} attention cache key(s), {mixed} with more than one gradient layout", flush=True)


if __name__ == "__main__":
    main()
