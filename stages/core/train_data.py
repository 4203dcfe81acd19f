"""Training data from the two caches, joined by item ids: bucketed, resumable batch order.

Every item pairs an image id (a row of latents.zarr/<bucket>) with its caption ids (rows of
captions.zarr: its caption variants, and the empty caption when its dataset drops captions). A batch
is drawn from one bucket, so its latents stack into one tensor and go through one denoiser forward.
The order is a pure function of (seed, epoch), repeats and weights included, so a sampler position
(epoch, index) is all a checkpoint needs to continue the same data order. Which variant and caption
an item trains with is drawn from the step's generator (draw_variants, draw_captions).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.core import dataset
from stages.core.artifacts import ArtifactError
from stages.core.batch import BatchMeta
from stages.core.errors import ConfigError
from stages.core.rowstore import DamagedRows, RowStore
from stages.core.runspec import command_for
from stages.core.schema import Bucket, control_count


@dataclass(frozen=True)
class Pair:
    key: str
    image_id: str
    caption_id: str
    bucket: Bucket
    latent_row: int
    caption_row: int
    caption_ids: tuple[str, ...] = ()  # every caption variant (the first is caption_id)
    caption_rows: tuple[int, ...] = ()
    dropout: float = 0.0  # probability of training on the empty caption
    empty: tuple[str, int] | None = None  # its empty caption's (id, row) when dropout > 0 (per control set when
    # the family's text encoder sees the controls)
    variants: int = 0  # latent variants cached for it (0: the store's count)
    dataset: int = 0
    share: float = 1.0  # times per epoch on average (its dataset's repeats or weight)
    regularization: bool = False  # its dataset's role: trained toward the base model's prediction (train.preservation)


FILL_EPOCHS = 16  # epochs fill_warning averages the step size over when weights vary the buckets' draws


class BucketSampler:
    """Shuffles items within each bucket, cuts batches, shuffles the batch order; per epoch."""

    def __init__(self, buckets: dict[str, list[int]], batch_size: int, seed: int,
                 shares: list[tuple[list[int], float]] | None = None):
        """`shares`: (item indices, times per epoch) per dataset; an item in none is drawn once."""
        self.buckets, self.batch_size, self.seed = buckets, batch_size, seed
        self.shares = [(list(ix), float(w)) for ix, w in shares or [] if float(w) != 1.0]
        self.epoch, self.index = 0, 0
        self._order: list[tuple[str, list[int]]] | None = None
        per_epoch = sum(len(ix) for ix in buckets.values()) + sum(
            int(w) * len(ix) + round((w - int(w)) * len(ix)) - len(ix) for ix, w in self.shares)
        if per_epoch < 1:
            held = ", ".join(f"{len(ix)} images at weight {w}" for ix, w in self.shares)
            raise ConfigError(f"the datasets' weights draw no image in an epoch ({held}): raise their weight")

    def copies(self, g: torch.Generator) -> dict[int, int] | None:
        """Times each item is drawn this epoch: floor(share), plus once more for a seeded choice of
        round(frac(share) * n) of its dataset's n items; None when every item is drawn once (no draw)."""
        if not self.shares:
            return None
        out: dict[int, int] = {}
        for indices, w in self.shares:
            base, extra = int(w), round((w - int(w)) * len(indices))
            out.update({i: base for i in indices})
            if extra:
                for k in torch.randperm(len(indices), generator=g)[:extra].tolist():
                    out[indices[k]] += 1
        return out

    def _generator(self, epoch: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)

    def epoch_batches(self, epoch: int) -> list[tuple[str, list[int]]]:
        g = self._generator(epoch)
        copies = self.copies(g)
        batches = []
        for name in sorted(self.buckets):
            members = self.buckets[name]
            if copies is not None:
                members = [i for i in members for _ in range(copies.get(i, 1))]
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

    def peek(self) -> tuple[str, list[int]] | None:
        """The batch `next` gives next, without moving on; None at an epoch's end (the next epoch's
        order is drawn when it starts)."""
        if self._order is None:
            self._order = self.epoch_batches(self.epoch)
        return self._order[self.index] if self.index < len(self._order) else None

    def draws(self, epoch: int) -> dict[str, int]:
        """Images each bucket draws in `epoch`, repeats and weights included: what epoch_batches cuts."""
        copies = self.copies(self._generator(epoch))  # its first draw, as in epoch_batches
        return {name: len(members) if copies is None else sum(copies.get(i, 1) for i in members)
                for name, members in sorted(self.buckets.items())}

    def draw_range(self) -> dict[str, tuple[int, int]]:
        """(fewest, most) images each bucket can draw in an epoch: floor(share) per member, plus between
        none and all of the extra draws of its members' datasets that can land in it."""
        share_of = {i: (k, w) for k, (indices, w) in enumerate(self.shares) for i in indices}
        out = {}
        for name, members in sorted(self.buckets.items()):
            lo = hi = sum(int(share_of[i][1]) if i in share_of else 1 for i in members)
            inside = Counter(share_of[i][0] for i in members if i in share_of)
            for k, m in sorted(inside.items()):
                indices, w = self.shares[k]
                extra = round((w - int(w)) * len(indices))
                lo, hi = lo + max(0, extra - (len(indices) - m)), hi + min(extra, m)
            out[name] = (lo, hi)
        return out

    def fill_warning(self, bucket_merge: bool) -> str | None:
        """A warning with the numbers when some bucket draws fewer items per epoch than a batch (repeats
        and weights included): its batches are always smaller than batch_size (not only an epoch's last
        one), which a user would not notice."""
        size, ranges = self.batch_size, self.draw_range()
        short = [name for name, (_, hi) in ranges.items() if hi < size]
        if not short:
            return None
        # a weight's extra draws move between buckets from epoch to epoch: average over several epochs
        fixed = all(lo == hi for lo, hi in ranges.values())
        epochs = [self.draws(e) for e in range(1 if fixed else FILL_EPOCHS)]
        drawn = sum(sum(d.values()) for d in epochs)
        average = drawn / sum(-(-n // size) for d in epochs for n in d.values())
        total = drawn // len(epochs)  # the same every epoch: floor(share) per item plus a fixed number of extras
        held = ", ".join(f"{name}: {lo}" if lo == hi else f"{name}: {lo}-{hi}" for name, (lo, hi) in ranges.items())
        amount = (f"draw fewer than {size} images per epoch with the datasets' repeats and weights" if self.shares
                  else f"hold fewer than {size} images")
        over = "" if fixed else f" over the first {FILL_EPOCHS} epochs"
        return (f"batches of {size} cannot be filled: a batch comes from one aspect bucket, and {len(short)} of the "
                f"{len(ranges)} buckets {amount} ({held}); a step trains {average:.2f} images on average{over}. "
                f"{self._fill_fix(total, bucket_merge)}")

    def _fill_fix(self, total: int, bucket_merge: bool) -> str:
        """What to do about buckets that cannot fill a batch, given the images an epoch draws."""
        size, images = self.batch_size, sum(len(members) for members in self.buckets.values())
        if total < size and self.shares:
            return (f"An epoch draws only {total} images ({images} image{'s' * (images != 1)} with the datasets' "
                    f"repeats and weights): lower train.batch_size to {total}, raise the repeats or weight, or add images")
        if total < size:
            return f"The dataset has only {total} trainable images: lower train.batch_size to {total} or add images"
        if bucket_merge and any(w < 1 for _, w in self.shares):
            return ("data.bucket_merge fills buckets to train.batch_size images, but a weight below 1 draws only some "
                    "of them per epoch, and a batch over several processes is larger: raise the weight, add images, "
                    "or train on fewer processes")
        if bucket_merge:
            return ("data.bucket_merge fills buckets to train.batch_size images, and a batch over several "
                    "processes is larger: add images, or train on fewer processes")
        return (f"Set data.bucket_merge = true (cache-latents then reruns) to move images into the nearest "
                f"bucket holding at least {size}, or lower train.batch_size")

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index, self._order = state["epoch"], state["index"], None


def join_items(items: list[dataset.Item], cap_manifest: dict[str, Any], lat_manifest: dict[str, Any],
               run: str | Path, datasets: list[Any] | None = None, blank: bool = False) -> list[Pair]:
    """Pair every dataset item with its cached caption and latent rows, by id. Missing rows mean a
    cache is stale: refuse, naming the item and the stage to rerun. `datasets`: the run's
    DataConfigs (repeats, weight, caption_dropout, role of each item's dataset); `blank`: every item
    needs its empty caption's row (train.preservation = "blank_prompt")."""
    cap_rows, lat_index = cap_manifest["rows"], lat_manifest["index"]
    skipped = {s["item"] for s in lat_manifest.get("skipped", [])}
    stale_captions = f"run `{_rerun(run, 'encode-captions')}`"
    pairs, buckets = [], {}  # each bucket name parsed once
    for it in items:
        if it.key in skipped:
            continue
        cids = it.caption_ids  # hashed on each access: once per item here
        if any(cid not in cap_rows for cid in cids):
            raise ArtifactError(f"caption of '{it.key}' is not in captions.zarr (it changed or is new): {stale_captions}")
        if it.latent_key not in lat_index:
            raise ArtifactError(f"image '{it.key}' is not in latents.zarr (it changed or is new): "
                                f"run `{_rerun(run, 'cache-latents')}`")
        data = datasets[it.dataset] if datasets else None
        dropout = data.caption_dropout if data else 0.0
        empty_id = it.empty_caption_id if dropout > 0 or blank else None  # one shared row, or the item's (empty, controls) row
        if empty_id is not None and empty_id not in cap_rows:
            raise ArtifactError(f"the empty caption that caption dropout or train.preservation trains '{it.key}' on "
                                f"is not in captions.zarr: {stale_captions}")
        loc = lat_index[it.latent_key]
        bucket = buckets.get(loc["bucket"]) or buckets.setdefault(loc["bucket"], Bucket.parse(loc["bucket"]))
        pairs.append(Pair(it.key, it.image_id, it.caption_id, bucket, loc["row"],
                          cap_rows[it.caption_id], cids, tuple(cap_rows[c] for c in cids),
                          dropout, (empty_id, cap_rows[empty_id]) if empty_id is not None else None,
                          lat_manifest.get("variants_of", {}).get(it.latent_key, 0), it.dataset,
                          (data.weight or float(data.repeats)) if data else 1.0,
                          bool(data and data.role == "regularization")))
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
    mask: torch.Tensor | None = None  # (B, 1, h, w) loss weights of the chosen variants; None: all ones
    controls: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    """Edit pairs: each control's (mean, logvar) of the chosen variants, (B, C, h, w) each."""
    control_eps: tuple[torch.Tensor, ...] | None = None
    """The step's posterior draws for `controls` (set by the trainer; None: use each posterior's mean)."""
    blank_cond: dict[str, torch.Tensor] | None = None
    """train.preservation = "blank_prompt": each item's empty-caption conditioning (set by the trainer)."""
    regularization: torch.Tensor | None = None
    """(B,) bool: the items of role = "regularization" datasets; None when the batch holds none."""


class TrainData:
    def __init__(self, pairs: list[Pair], caption_store: Any, latent_stores: dict[str, Any], variants: int):
        self.pairs, self.captions, self.latents, self.variants = pairs, caption_store, latent_stores, variants
        self.caption_fields = caption_store.fields
        self.variant_counts = [p.variants or variants for p in pairs]
        self.one_variant_count = len(set(self.variant_counts)) == 1  # every item draws from the same range
        # only a run with a choice of captions draws one, so other runs keep their exact random stream
        self.caption_choice = any(len(p.caption_rows) > 1 or p.dropout > 0 for p in pairs)
        self.held_out: TrainData | None = None  # validation items (stages/core/validation.py), same stores
        self._ahead: dict[tuple[int, int], Future] = {}  # (id of the store, row) -> its read, started early
        self._reader: ThreadPoolExecutor | None = None

    def buckets(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, p in enumerate(self.pairs):
            out.setdefault(str(p.bucket), []).append(i)
        return out

    def shares(self) -> list[tuple[list[int], float]]:
        """(item indices, times per epoch) of each dataset, for BucketSampler."""
        groups: dict[tuple[int, float], list[int]] = {}
        for i, p in enumerate(self.pairs):
            groups.setdefault((p.dataset, p.share), []).append(i)
        return [(ix, share) for (_, share), ix in sorted(groups.items())]

    def draw_variants(self, indices: list[int], g: torch.Generator) -> list[int]:
        """The latent variant of each item: uniform over its cached variants."""
        counts = [self.variant_counts[i] for i in indices]
        if self.one_variant_count:
            return torch.randint(counts[0], (len(indices),), generator=g).tolist()
        u = torch.rand(len(indices), generator=g, dtype=torch.float64)
        return [int(x * n) for x, n in zip(u.tolist(), counts)]

    def draw_captions(self, indices: list[int], g: torch.Generator) -> list[tuple[str, int]] | None:
        """(caption id, row) of each item: the empty caption with its dataset's caption_dropout, else
        one of its variants, uniformly. None, drawing nothing, when no item has a choice."""
        if not self.caption_choice:
            return None
        pick = torch.rand(len(indices), generator=g, dtype=torch.float64).tolist()
        drop = torch.rand(len(indices), generator=g, dtype=torch.float64).tolist()
        out = []
        for i, u, d in zip(indices, pick, drop):
            p = self.pairs[i]
            k = int(u * len(p.caption_rows))
            out.append(p.empty if p.empty is not None and d < p.dropout else (p.caption_ids[k], p.caption_rows[k]))
        return out

    def prefetch(self, indices: list[int]) -> None:
        """Start reading (on a thread) the rows a later `load` of these items needs: their latent rows and
        every caption row they may draw, so the reads overlap the step. Call it after the batch before
        was loaded: at most one batch is held ahead."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rows")
        self._ahead = {}  # reads of the batch before that its draws did not use (other caption variants)
        wanted = []
        for p in (self.pairs[i] for i in indices):
            wanted.append((self.latents[str(p.bucket)], p.latent_row))
            wanted += [(self.captions, row) for row in (*p.caption_rows, *([p.empty[1]] if p.empty else []))]
        for store, row in wanted:
            if (id(store), row) not in self._ahead:
                self._ahead[id(store), row] = self._reader.submit(store.read_row, row)

    def _row(self, store: RowStore, row: int, key: str, stage: str) -> dict[str, np.ndarray]:
        """A row checked against its checksums: the prefetched read where one was started, else read now."""
        future = self._ahead.pop((id(store), row), None)
        if future is None:
            return _verified(store, row, key, stage)
        try:
            return future.result()
        except DamagedRows:
            return _verified(store, row, key, stage)  # read again here: it raises with the item named

    def load(self, indices: list[int], variant_choice: list[int],
             captions: list[tuple[str, int]] | None = None) -> Batch:
        """Read each item's latent and caption rows, checked against their checksums, and stack the
        chosen variants. A row that fails is unflagged (so its cache stage re-encodes it) and
        training stops with an ArtifactError naming it and the command that repairs it."""
        ps = [self.pairs[i] for i in indices]
        assert all(p.bucket == ps[0].bucket for p in ps), "a batch must come from one bucket"
        store = self.latents[str(ps[0].bucket)]
        lat = [self._row(store, p.latent_row, p.key, "cache-latents") for p in ps]
        chosen = captions or [(p.caption_id, p.caption_row) for p in ps]
        caps = [self._row(self.captions, row, p.key, "encode-captions") for p, (_, row) in zip(ps, chosen)]
        pick = lambda name: np.stack([row[name][v] for row, v in zip(lat, variant_choice)])  # noqa: E731
        bw, bh = ps[0].bucket.width, ps[0].bucket.height
        meta = BatchMeta(torch.from_numpy(np.stack([row["original_size"] for row in lat])).long(),
                         torch.from_numpy(pick("crop_top_left")).long(), torch.tensor([[bh, bw]] * len(ps)))
        cond = {name: torch.from_numpy(np.stack([row[name] for row in caps])) for name in self.caption_fields}
        tensor = lambda name: torch.from_numpy(pick(name).astype(np.float32))  # noqa: E731
        controls = tuple((tensor(f"control_{k}_mean"), tensor(f"control_{k}_logvar"))
                         for k in range(control_count(store.fields)))
        reg = [p.regularization for p in ps]
        return Batch([p.key for p in ps], tensor("mean"), tensor("logvar"), cond, meta, [cid for cid, _ in chosen],
                     mask=loss_mask(pick("mask")) if "mask" in lat[0] else None, controls=controls,
                     regularization=torch.tensor(reg) if any(reg) else None)

    def blank_cond(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The empty caption's conditioning of each item (its Pair.empty row), checked as `load` checks rows."""
        caps = [self._row(self.captions, self.pairs[i].empty[1], self.pairs[i].key, "encode-captions") for i in indices]
        return {name: torch.from_numpy(np.stack([row[name] for row in caps])) for name in self.caption_fields}


def loss_mask(masks: np.ndarray) -> torch.Tensor | None:
    """(B, 1, h, w) float32 loss weights, or None when every weight is 1 (no item of the batch has a
    mask): the loss then runs exactly the unmasked path."""
    if bool((masks == 1).all()):
        return None
    return torch.from_numpy(masks.astype(np.float32)).unsqueeze(1)


def _verified(store: RowStore, row: int, key: str, stage: str) -> dict[str, np.ndarray]:
    try:
        return store.read_row(row)
    except DamagedRows as e:
        store.mark_unwritten(e.rows)
        raise ArtifactError(f"{e}, item '{key}': the cache is damaged; run `{command_for(None, stage)}` (it "
                            f"re-encodes exactly the damaged rows), then train again") from None


def _rerun(run: str | Path, stage: str) -> str:
    """The command that rebuilds a stale cache of `run` (a run folder, or a bare run name)."""
    return command_for(run, stage) if isinstance(run, Path) else f"lorapipe {stage} {run}"


def sample_posterior(mean: torch.Tensor, logvar: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """A fresh latent sample, as DiagonalGaussianDistribution.sample: mean + exp(logvar / 2) * eps."""
    return mean + torch.exp(0.5 * logvar) * eps
