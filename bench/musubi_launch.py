"""Runs musubi-tuner's Wan trainer (`musubi_tuner.wan_train_network`, carried in .carry-peers/musubi-tuner/src) as
bench/peers_video.py's peer process, unchanged apart from two things set before it starts:

    python bench/musubi_launch.py --dims DIMS.json -- --task t2v-A14B --dit ... (musubi's own arguments)

- the task's model dimensions (its `WAN_CONFIGS[--task]` entry, and WanModel's text width, which musubi fixes at
  4096) are the model folder's (bench/wan_musubi.py musubi_dims): for the full-size build they equal t2v-A14B's own
  (checked: a difference is refused), for the tiny CPU model they are the tiny ones;
- without CUDA (the CPU plumbing run only): musubi's umT5 wrapper evaluates `torch.cuda.current_device()` as a
  default argument when wan/modules/t5.py is imported (`class T5EncoderModel`, its `device=` default), which raises
  on a CPU-only torch; it reads "cpu" here. Training never builds that encoder (the text features are cached).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def prepare(dims: dict[str, Any], task: str) -> Any:
    """musubi's Wan model module with `task`'s config set to `dims` (bench/wan_musubi.py musubi_dims, plus "full": the
    released size, which musubi's own config must already match) and WanModel's text width set to dims' text_dim."""
    import torch

    dims = dict(dims)
    cuda_device = torch.cuda.current_device
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # see the module docstring
    try:
        from musubi_tuner.wan import configs
        from musubi_tuner.wan.modules import model as wan_model
    finally:
        torch.cuda.current_device = cuda_device
    cfg = configs.WAN_CONFIGS[task]
    full = dims.pop("full", False)
    text_dim = dims.pop("text_dim")
    if full:
        diff = {k: (cfg.get(k), v) for k, v in dims.items() if cfg.get(k) != v}
        if diff or text_dim != 4096:
            raise SystemExit(f"the model folder's transformer is not musubi's {task}: {diff} text_dim {text_dim}")
    cfg.update(dims)
    base = getattr(wan_model.WanModel, "musubi_base", wan_model.WanModel)

    class SizedWanModel(base):  # WanModel's text width is not in musubi's config (default 4096)
        musubi_base = base

        def __init__(self, *a: Any, **k: Any) -> None:
            k.setdefault("text_dim", text_dim)
            super().__init__(*a, **k)

    wan_model.WanModel = SizedWanModel  # load_wan_model builds the name it finds in its module
    return wan_model


def main() -> None:
    argv = sys.argv[1:]
    if len(argv) < 3 or argv[0] != "--dims" or argv[2] != "--":
        raise SystemExit("usage: python bench/musubi_launch.py --dims DIMS.json -- <musubi wan_train_network arguments>")
    dims, rest = json.loads(Path(argv[1]).read_text()), argv[3:]
    prepare(dims, rest[rest.index("--task") + 1] if "--task" in rest else "t2v-14B")
    from musubi_tuner import wan_train_network

    sys.argv = ["wan_train_network.py", *rest]
    wan_train_network.main()


if __name__ == "__main__":
    main()
