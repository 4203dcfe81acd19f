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
from stages.core.rowstore import DamagedRows, RowStore
from stages.core.schema import Bucket
from stages.families.base import BatchMeta


@dataclass(frozen=True)
class Pair:
    key: str
    image_id: str
    caption_id: str
    bucket: Bucket
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
        pairs.append(Pair(it.key, it.image_id, it.caption_id, Bucket.parse(loc["bucket"]), loc["row"],
                          cap_rows[it.caption_id]))
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
            out.setdefault(str(p.bucket), []).append(i)
        return out

    def load(self, indices: list[int], variant_choice: list[int]) -> Batch:
        """Read each item's latent and caption rows, checked against their checksums, and stack the
        chosen variants. A row that fails is unflagged (so its cache stage re-encodes it) and
        training stops with an ArtifactError naming it and the command that repairs it."""
        ps = [self.pairs[i] for i in indices]
        assert all(p.bucket == ps[0].bucket for p in ps), "a batch must come from one bucket"
        store = self.latents[str(ps[0].bucket)]
        lat = [_verified(store, p.latent_row, p.key, "cache-latents") for p in ps]
        caps = [_verified(self.captions, p.caption_row, p.key, "encode-captions") for p in ps]
        pick = lambda name: np.stack([row[name][v] for row, v in zip(lat, variant_choice)])  # noqa: E731
        bw, bh = ps[0].bucket
        meta = BatchMeta(torch.from_numpy(np.stack([row["original_size"] for row in lat])).long(),
                         torch.from_numpy(pick("crop_top_left")).long(), torch.tensor([[bh, bw]] * len(ps)))
        cond = {name: torch.from_numpy(np.stack([row[name] for row in caps])) for name in self.caption_fields}
        return Batch([p.key for p in ps], torch.from_numpy(pick("mean").astype(np.float32)),
                     torch.from_numpy(pick("logvar").astype(np.float32)), cond, meta, [p.caption_id for p in ps])


def _verified(store: RowStore, row: int, key: str, stage: str) -> dict[str, np.ndarray]:
    try:
        return store.read_row(row)
    except DamagedRows as e:
        store.mark_unwritten(e.rows)
        raise ArtifactError(f"{e}, item '{key}': the cache is damaged; run `python pipeline.py {stage} --config "
                            f"<your config>` (it re-encodes exactly the damaged rows), then train again") from None


def sample_posterior(mean: torch.Tensor, logvar: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """A fresh latent sample, as DiagonalGaussianDistribution.sample: mean + exp(logvar / 2) * eps."""
    return mean + torch.exp(0.5 * logvar) * eps
