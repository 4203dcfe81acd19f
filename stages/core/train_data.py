"""Training data from the two caches, joined by item ids: bucketed, resumable batch order.

Every item pairs an image id (a row of latents.zarr/<bucket>) with a caption id (a row of
captions.zarr). A batch is drawn from one bucket, so its latents stack into one tensor and go
through one denoiser forward. The order is a pure function of (seed, epoch), so a sampler position
(epoch, index) is all a checkpoint needs to continue the same data order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stages.core import dataset
from stages.core.artifacts import ArtifactError
from stages.families.base import BatchMeta


@dataclass(frozen=True)
class Pair:
    key: str
    image_id: str
    caption_id: str
    bucket: str
    latent_row: int
    caption_row: int


class BucketSampler:
    """Shuffles items within each bucket, cuts batches, shuffles the batch order; per epoch."""

    def __init__(self, buckets: dict[str, list[int]], batch_size: int, seed: int):
        self.buckets, self.batch_size, self.seed = buckets, batch_size, seed
        self.epoch, self.index = 0, 0
        self._order: list[tuple[str, list[int]]] | None = None

    def epoch_batches(self, epoch: int) -> list[tuple[str, list[int]]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        batches = []
        for name in sorted(self.buckets):
            members = self.buckets[name]
            perm = [members[i] for i in torch.randperm(len(members), generator=g).tolist()]
            batches += [(name, perm[i:i + self.batch_size]) for i in range(0, len(perm), self.batch_size)]
        return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]

    def next(self) -> tuple[str, list[int]]:
        if self._order is None:
            self._order = self.epoch_batches(self.epoch)
        if self.index >= len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self.epoch_batches(self.epoch)
        batch = self._order[self.index]
        self.index += 1
        return batch

    def fill_warning(self, bucket_merge: bool) -> str | None:
        """A warning with the numbers when some bucket holds fewer items than a batch: its batches are
        always smaller than batch_size (not only an epoch's last one), which a user would not notice."""
        sizes = {name: len(members) for name, members in sorted(self.buckets.items())}
        size, short = self.batch_size, [name for name, n in sizes.items() if n < self.batch_size]
        if not short:
            return None
        total, batches = sum(sizes.values()), sum(-(-n // size) for n in sizes.values())
        held = ", ".join(f"{name}: {n}" for name, n in sizes.items())
        if total < size:
            fix = f"The dataset has only {total} trainable images: lower train.batch_size to {total} or add images"
        elif bucket_merge:
            fix = ("data.bucket_merge fills buckets to train.batch_size images, and a batch over several "
                   "processes is larger: add images, or train on fewer processes")
        else:
            fix = (f"Set data.bucket_merge = true (cache-latents then reruns) to move images into the nearest "
                   f"bucket holding at least {size}, or lower train.batch_size")
        return (f"batches of {size} cannot be filled: a batch comes from one aspect bucket, and {len(short)} of the "
                f"{len(sizes)} buckets hold fewer than {size} images ({held}); a step trains {total / batches:.2f} "
                f"images on average. {fix}")

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index, self._order = state["epoch"], state["index"], None


def join_items(items: list[dataset.Item], cap_manifest: dict[str, Any], lat_manifest: dict[str, Any],
               run: str) -> list[Pair]:
    """Pair every dataset item with its cached caption and latent rows, by id. Missing rows mean a
    cache is stale: refuse, naming the item and the stage to rerun."""
    cap_rows, lat_index = cap_manifest["rows"], lat_manifest["index"]
    skipped = {s["item"] for s in lat_manifest.get("skipped", [])}
    pairs = []
    for it in items:
        if it.key in skipped:
            continue
        if it.caption_id not in cap_rows:
            raise ArtifactError(f"caption of '{it.key}' is not in captions.zarr (it changed or is new): "
                                f"run `python pipeline.py encode-captions` for run '{run}'")
        if it.image_id not in lat_index:
            raise ArtifactError(f"image '{it.key}' is not in latents.zarr (it changed or is new): "
                                f"run `python pipeline.py cache-latents` for run '{run}'")
        loc = lat_index[it.image_id]
        pairs.append(Pair(it.key, it.image_id, it.caption_id, loc["bucket"], loc["row"], cap_rows[it.caption_id]))
    if not pairs:
        raise ArtifactError("no trainable items: every image was skipped or the caches are empty")
    return pairs


@dataclass
class Batch:
    keys: list[str]
    mean: torch.Tensor  # (B, C, h, w) posterior mean of the chosen variants
    logvar: torch.Tensor
    cond: dict[str, torch.Tensor]
    meta: BatchMeta
    caption_ids: list[str]


class TrainData:
    def __init__(self, pairs: list[Pair], caption_store: Any, latent_stores: dict[str, Any], variants: int):
        self.pairs, self.captions, self.latents, self.variants = pairs, caption_store, latent_stores, variants
        self.caption_fields = caption_store.fields

    def buckets(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, p in enumerate(self.pairs):
            out.setdefault(p.bucket, []).append(i)
        return out

    def load(self, indices: list[int], variant_choice: list[int]) -> Batch:
        """Read the chosen variant of each item's latents and its caption rows -> stacked tensors."""
        ps = [self.pairs[i] for i in indices]
        store = self.latents[ps[0].bucket]
        assert all(p.bucket == ps[0].bucket for p in ps), "a batch must come from one bucket"
        mean = np.stack([store.read("mean", (p.latent_row, v)) for p, v in zip(ps, variant_choice)])
        logvar = np.stack([store.read("logvar", (p.latent_row, v)) for p, v in zip(ps, variant_choice)])
        crops = np.stack([store.read("crop_top_left", (p.latent_row, v)) for p, v in zip(ps, variant_choice)])
        sizes = np.stack([store.read("original_size", p.latent_row) for p in ps])
        bw, bh = (int(x) for x in ps[0].bucket.split("x"))
        meta = BatchMeta(torch.from_numpy(sizes).long(), torch.from_numpy(crops).long(),
                         torch.tensor([[bh, bw]] * len(ps)))
        cond = {name: torch.from_numpy(np.stack([self.captions.read(name, p.caption_row) for p in ps]))
                for name in self.caption_fields}
        return Batch([p.key for p in ps], torch.from_numpy(mean.astype(np.float32)),
                     torch.from_numpy(logvar.astype(np.float32)), cond, meta, [p.caption_id for p in ps])


def sample_posterior(mean: torch.Tensor, logvar: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """A fresh latent sample, as DiagonalGaussianDistribution.sample: mean + exp(logvar / 2) * eps."""
    return mean + torch.exp(0.5 * logvar) * eps
