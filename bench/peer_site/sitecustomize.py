"""Put on PYTHONPATH of a peer training script by bench/peers.py: measures it from inside (and, asked, turns cuDNN SDPA off).

After every optimizer step (torch's global step post-hook, so any optimizer, wrapped by accelerate or
not) it appends one JSON line to $LORAPIPE_PEER_STEPS: the step's end time (after a CUDA synchronize)
and the peak CUDA memory since the previous step's end (max_memory_allocated/reserved, then reset), so a
step's peak covers exactly its own forward, backward and update. At exit it writes the peak of the
whole process. With LORAPIPE_PEER_TV_STANDIN=1 (CPU machines whose torchvision wheel was built for
CUDA and cannot load its C ops) it skips torchvision's fake-op registrations so `transforms` imports.
With LORAPIPE_PEER_CV2_STANDIN=1 (no OpenCV) `import cv2` gives a stand-in whose every attribute is missing:
musubi-tuner imports cv2 at start for resizing images, which its training from cache files never does.
With LORAPIPE_PEER_NO_CUDNN_SDPA=1 it turns cuDNN's SDPA backend off, as the product's train stage
does: on torch 2.11 + CUDA 13 the Kontext script's first backward died in it (illegal memory access).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
import types

_PATH = os.environ.get("LORAPIPE_PEER_STEPS", "")
if os.environ.get("LORAPIPE_PEER_TV_STANDIN") == "1":
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))


class _Cv2StandIn(types.ModuleType):
    """`cv2` where OpenCV is not installed: importable, every attribute missing with a line that says why."""

    def __getattr__(self, name: str):  # noqa: ANN204
        raise AttributeError(f"cv2.{name}: OpenCV is not installed for this peer (a stand-in module from "
                             f"bench/peer_site, LORAPIPE_PEER_CV2_STANDIN); install opencv-python-headless to use it")


if os.environ.get("LORAPIPE_PEER_CV2_STANDIN") == "1":
    sys.modules.setdefault("cv2", _Cv2StandIn("cv2"))


def _install() -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    cuda = torch.cuda.is_available()
    state = {"n": 0, "peak_alloc": 0.0, "peak_reserved": 0.0, "t0": time.time()}

    def write(row: dict) -> None:
        with open(_PATH, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def interval_peak() -> tuple[float, float]:
        if not cuda:
            return 0.0, 0.0
        a, r = torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
        torch.cuda.reset_peak_memory_stats()
        state["peak_alloc"], state["peak_reserved"] = max(state["peak_alloc"], a), max(state["peak_reserved"], r)
        return round(a, 3), round(r, 3)

    def hook(optimizer, args, kwargs) -> None:  # noqa: ANN001 - torch's hook signature
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        a, r = interval_peak()
        state["n"] += 1
        write({"event": "step", "step": state["n"], "t": t, "wall": time.time(), "peak_alloc_gb": a, "peak_reserved_gb": r})

    register_optimizer_step_post_hook(hook)
    if os.environ.get("LORAPIPE_PEER_NO_CUDNN_SDPA") == "1":
        torch.backends.cuda.enable_cudnn_sdp(False)

    @atexit.register
    def _exit() -> None:
        interval_peak()
        write({"event": "exit", "wall": time.time(), "steps": state["n"], "process_peak_alloc_gb": round(state["peak_alloc"], 3),
               "process_peak_reserved_gb": round(state["peak_reserved"], 3), "started": state["t0"]})


def _chain() -> None:
    """Run the sitecustomize this file shadows (one later on sys.path, e.g. the image's own), if any."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
if _PATH:
    try:
        _install()
    except Exception as e:  # noqa: BLE001 - a broken probe must not break the measured script
        print(f"[peers sitecustomize] not measuring: {type(e).__name__}: {e}", file=sys.stderr)
