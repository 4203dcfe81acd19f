"""Held-out validation items: which items they are, and the fixed randomness of their loss.

    [validation]
    path = "data/held-out"     # a folder like data.path (never trained on), or
    split = 0.1                # a fraction of data.path's items, chosen by content id
    every_n_steps = 50

Held-out items are cached with the training items (encode-captions and cache-latents scan both),
so the loss needs no extra stage. A folder's items get keys `validation/<key>`, never mistaken for
training items of the same name. A split holds out an item when the hash of its image id falls
below the fraction: adding images never moves an existing item between the sets.

The loss of an item uses variant 0 and noise, posterior eps and timestep from a generator seeded by
the item's ids alone (not the run's seed or step), so the figure at step 100 of one run compares
with step 100 of another, and computing it draws nothing from the training generator.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from stages.core import dataset

PREFIX = "validation/"


def scan_run(cfg: Any, log: Any = None, ids: bool = True) -> list[dataset.Item]:
    """Every item the caches hold: the run's datasets' (`dataset.scan_run`), then validation.path's
    (keys `validation/...`, cached with the first dataset's settings). `ids` False: see dataset.scan_run."""
    items = dataset.scan_run(cfg, log, ids)
    if cfg.validation.path:
        held = dataclasses.replace(cfg.data, path=cfg.validation.path)
        items += [dataclasses.replace(it, key=PREFIX + it.key)
                  for it in dataset.scan_data(held, log, ids, dataset.index_dir(cfg))]
    return sorted(items, key=lambda it: it.key)


def _unit(text: str) -> float:
    return int(hashlib.sha256(text.encode()).hexdigest()[:13], 16) / 16**13


def partition(cfg: Any, items: list[dataset.Item]) -> tuple[list[dataset.Item], list[dataset.Item]]:
    """(training items, validation items) of `scan_run`'s items; a split picks among all datasets' items."""
    split = cfg.validation.split
    if split > 0 and not cfg.validation.path and any(not it.image_id for it in items):
        raise ValueError("a validation split picks items by image id: scan them with ids=True")
    held = [it.key.startswith(PREFIX) if cfg.validation.path else split > 0 and _unit(it.image_id) < split
            for it in items]
    return [it for it, h in zip(items, held) if not h], [it for it, h in zip(items, held) if h]


def item_seed(image_id: str, caption_id: str) -> int:
    """The seed of one item's validation draws: its ids only."""
    return int(hashlib.sha256(f"{image_id}:{caption_id}".encode()).hexdigest()[:15], 16)
