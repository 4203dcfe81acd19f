"""The skeleton both cache stages share: which rows are still to encode, and encoding them over the
ranks of a torchrun job (seed, shard, write, barrier) with progress counted in global items."""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Hashable, Iterable, Iterator, Sequence, TypeVar

from stages.core import distributed
from stages.core.rowstore import RowStore

T = TypeVar("T")
Finish = Callable[[], None]  # the host part of a unit's encode: its row copied off the device and written
PROGRESS_EVERY_S = 1.0  # events.jsonl gets a progress event at most this often (100k images: not 100k lines)


def rows_to_encode(store: RowStore | None, ids: Sequence[str], grow: bool) -> list[str]:
    """Those of `ids` without an intact row in `store` (all of them without a store): new ids, rows
    a killed run left unflagged, and damaged rows (a shard file missing or too short, or
    unflagged by a reader whose checksum failed), in the order of their rows. `grow` (the writer,
    rank 0, before any other rank writes) packs the rows killed writers left in their journals and
    appends rows for new ids."""
    if store is None:
        return list(ids)
    if grow:
        store.recover()
    row_of = store.row_of()
    new = [i for i in ids if i not in row_of]
    if new and grow:
        store.append_rows(new)
        row_of = store.row_of()
    intact = store.intact_mask()
    todo = [i for i in ids if i not in row_of or not intact[row_of[i]]]
    return sorted(todo, key=lambda i: row_of.get(i, len(row_of)))  # a shard's rows together: each shard packed once


def prefetched(units: Iterable[T], prepare: Callable[[T], Any], workers: int) -> Iterator[tuple[T, Any]]:
    """(unit, prepare(unit)) in `units`' order, each prepared on a thread pool while the caller works on
    the ones before it (at most 2 x `workers` ahead, so memory stays bounded). An exception `prepare`
    raises is raised here, at its unit."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prepare") as pool:
        ahead: deque[tuple[T, Future]] = deque()
        it = iter(units)
        for unit in it:
            ahead.append((unit, pool.submit(prepare, unit)))
            if len(ahead) >= 2 * workers:
                break
        end = object()
        while ahead:
            unit, future = ahead.popleft()
            nxt = next(it, end)
            if nxt is not end:
                ahead.append((nxt, pool.submit(prepare, nxt)))  # type: ignore[arg-type]
            yield unit, future.result()


def prepare_workers() -> int:
    """Threads that decode ahead of the encoder: the machine's cores, at most 8 (decoding and resizing
    release the GIL for most of their time)."""
    return max(1, min(8, os.cpu_count() or 1))


def encode_units(ctx: Any, label: str, unit_name: str, units: Sequence[T], encode: Callable[..., Finish | None], *,
                 size: Callable[[T], int], needs_store: Callable[[T], bool], reopen: Callable[[], None],
                 done_before: int, total: int, prepare: Callable[[T], Any] | None = None,
                 shard_of: Callable[[T], Hashable] | None = None, flush: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Encode `units` over the ranks of ctx.dist, then wait until every rank's rows are on disk.

    Under torchrun rank 0 first encodes alone each unit whose store does not exist yet (a store's
    shapes come from the model's first output), everyone `reopen`s the stores, then each rank
    encodes its round-robin share of the rest. Progress and `preparing` events (at most one a second) count
    global items: rank 0's own count times the world size (ranks keep about the same pace), capped at the total.
    With `prepare` (the host's part: reading and decoding), `encode(unit, prepare(unit))` runs while
    threads prepare the next units, so the encoder does not wait on the disk. `encode` may return a finish
    (the unit's row copied to the host and written), called once the next unit's encode is queued, so the
    GPU works on that one meanwhile (a one-deep pipeline; units are counted when finished); an error or a
    stop finishes the unit in flight before it is raised, and seeding finishes each unit at once. Units with
    the same `shard_of` (the store shard their rows go to) go to one rank, which alone packs that shard; `flush`
    packs what this rank journaled (after rank 0's seeding and before the final barrier). Returns this rank's
    {"units", "seconds", "encode_seconds"}: how busy the encoder was (encodes and finishes)."""
    dist = ctx.dist
    todo = sum(size(u) for u in units)
    counted = {"here": 0, "shown": 0, "logged": 0.0}
    stats = {"units": 0.0, "seconds": 0.0, "encode_seconds": 0.0}
    in_flight: deque[tuple[T, Finish]] = deque()  # at most one: encoded, its row not yet written
    start = time.perf_counter()
    with distributed.progress(dist, label, todo, unit_name) as bar:
        def timed(work: Callable[..., Any], *args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return work(*args)
            finally:
                stats["encode_seconds"] += time.perf_counter() - t0

        def done(unit: T) -> None:
            stats["units"] += 1
            counted["here"] += size(unit)
            estimate = min(todo, counted["here"] * dist.world_size)
            bar.advance(estimate - counted["shown"])
            counted["shown"] = estimate
            now = time.perf_counter()
            if now - counted["logged"] >= PROGRESS_EVERY_S or estimate == todo:
                counted["logged"] = now
                ctx.log.emit("preparing", done=done_before + estimate, total=total, encoded=estimate)

        def finish_all(queue: deque[tuple[T, Finish]]) -> None:
            while queue:
                unit, finish = queue.popleft()
                timed(finish)
                done(unit)

        def finish_in_flight() -> None:
            finish_all(in_flight)

        def encode_one(unit: T, *prepared: Any) -> None:
            finish = timed(encode, unit, *prepared)
            before = deque(in_flight)  # the previous unit: its row is written now that this one is queued
            in_flight.clear()
            if finish is not None:
                in_flight.append((unit, finish))  # an error finishing `before` still writes this one
            finish_all(before)
            if finish is None:
                done(unit)

        def run(some: Iterable[T]) -> None:
            if prepare is None:
                for unit in some:
                    encode_one(unit)
            else:
                for unit, prepared in prefetched(some, prepare, prepare_workers()):
                    encode_one(unit, prepared)
            finish_in_flight()

        seeded: list[int] = []
        with distributed.main_first(dist):
            if dist.is_main and dist.is_distributed:
                for k, unit in enumerate(units):
                    if needs_store(unit):  # the first unit of each new store makes it: the rest need it no more
                        seeded.append(k)
                        encode_one(unit, *([prepare(unit)] if prepare is not None else []))
                        finish_in_flight()
                flush()  # the seeded rows are in their shards before another rank packs them
        seeded = distributed.broadcast(seeded, dist)
        if seeded:
            reopen()
        skip = set(seeded)
        rest = [u for k, u in enumerate(units) if k not in skip]
        try:
            run(_deal(rest, dist, len(seeded), shard_of))
        except BaseException:
            with contextlib.suppress(Exception):  # the unit encoded before the failure keeps its row
                finish_in_flight()
            with contextlib.suppress(Exception):  # what stays journaled is packed by the next run
                flush()
            raise
        flush()
    distributed.barrier(dist)  # every rank's rows are on disk: rank 0 writes the manifest
    stats["seconds"] = time.perf_counter() - start
    return stats


def _deal(units: list[T], dist: Any, first: int, shard_of: Callable[[T], Hashable] | None) -> list[T]:
    """This rank's units: dealt one by one, or in whole shards (each shard's units on one rank, in order)."""
    if shard_of is None:
        return distributed.shard(units, dist, first=first)
    groups: dict[Hashable, list[T]] = {}
    for unit in units:
        groups.setdefault(shard_of(unit), []).append(unit)
    return [u for group in distributed.shard(list(groups.values()), dist, first=first) for u in group]


def damage_report(store: RowStore | None, referenced: dict[str, int], keys: dict[str, list[str]], where: str,
                  command: str) -> list[str]:
    """For `status`: the rows the manifest uses (id -> row) that are not intact, named by their
    dataset items, and `command` (a whole command line) that re-encodes exactly them; empty when all are intact."""
    intact = store.intact_mask() if store is not None else None
    bad = sorted(i for i, row in referenced.items() if intact is None or row >= len(intact) or not intact[row])
    if not bad:
        return []
    named = [k for i in bad for k in keys.get(i, [i])]
    return [f"damaged: {len(bad)} row(s) of {where} ({', '.join(named[:8])}{' ...' if len(named) > 8 else ''}) have "
            f"a shard file missing or too short, or failed their checksum when read; "
            f"`{command}` re-encodes exactly those"]


def keys_by_id(items: dict[str, str]) -> dict[str, list[str]]:
    """A manifest's `items` (dataset key -> id) inverted: id -> its keys."""
    out: dict[str, list[str]] = {}
    for key, i in sorted(items.items()):
        out.setdefault(i, []).append(key)
    return out
