"""Zarr row stores with an integrity record per row: the shared format of captions.zarr and latents.zarr.

A RowStore is a zarr group of arrays shaped (rows, *item_shape), each cut into blocks of
`rows_per_shard` rows, uncompressed: one file per block per array (a shard of zarr's sharding codec
with one inner chunk per row for large rows, a plain chunk for small ones), plus two bookkeeping
arrays: `checksums` (rows, fields), the crc32c of each field's row bytes, and `written`, a flag per
row. 100k rows make about 8 x 100k / 128 files, not one per row per array.

Writing: a shard file is rewritten whole, so a stage does not write rows into it one by one. `journal_row`
appends the row (every field and its crc32c, one record) to this writer's journal,
`<store>/journal/<host>-<pid>-<n>.log`; a kill mid-append leaves a torn record that fails its crc and
is ignored. When the writer moves on to a row of another shard (and at `flush`), the journal's rows
are packed into their shards: each field's shard, then `checksums`, then `written` are replaced
atomically (temp file + rename), and only then is the journal deleted. A writer killed before that
leaves its journal, which the next writer packs first (`recover`): a row is lost only when its own
record is torn. Two writers must not pack one shard at once (each packs a read-modify-write of the
whole file): the cache stages deal whole shards to ranks (`shard_of`), and packing also holds an
exclusive lock on `<store>/journal/pack.lock`.

Checking a row costs two levels:
- `intact_mask` (cheap, every stage start and `status`): the row is flagged written and each of its
  shard files exists with a size that holds the row (one stat per shard file);
- `read_row` (when a row is read anyway, for training or `inspect`): the crc32c of its bytes.
crc32c, not zlib's crc32: `google-crc32c` is installed with zarr and uses the CPU's crc32c
instruction (1.8 GB/s against zlib.crc32's 0.8 GB/s on 64 MiB here), so verifying on read costs
little next to the read itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import socket
import struct
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from stages.core.artifacts import naming_full_disk, remove_dir
from stages.core.errors import ArtifactError

WRITTEN, CHECKSUMS = "written", "checksums"
_BOOKKEEPING = (WRITTEN, CHECKSUMS)
JOURNAL = "journal"
FORMAT = "sharded-1"  # group attribute of this layout; a store without it is rebuilt by its stage
ROWS_PER_SHARD = 128  # >= 100 rows per file; a 1024 px FLUX shard of 4 variants' means is 256 MiB
SMALL_ROW = 8192  # bytes: a plain chunk of 128 such rows is at most 1 MiB
SHARD_ENV = "LORAPIPE_ROWS_PER_SHARD"  # tests set a few rows, so a tiny dataset spans several shards
# zarr skips writing an inner chunk equal to the fill value (an all-zero flip row, say); every row of
# a shard must be in its file so that a short file always means damage
_EVERY_CHUNK = {"write_empty_chunks": True}
_RECORD = struct.Struct("<4sQIQI")  # magic, row, header bytes, payload bytes, crc32c of header + payload
_MAGIC = b"LPJ1"
_journals = itertools.count()
# the journal folder sits inside the zarr group, which zarr warns about when it lists members; it is ours
warnings.filterwarnings("ignore", message=f"Object at {JOURNAL} is not recognized")


def _blocks(rows: int, shape: tuple[int, ...], itemsize: int) -> dict[str, tuple[int, ...]]:
    """How an array of rows of `shape` is cut: rows of at most SMALL_ROW bytes in plain chunks of `rows`
    rows (read whole: cheap, and one zarr call reads thousands of rows, where one inner chunk per row
    costs zarr a decode each); larger rows as shards of `rows` rows with one inner chunk per row, so
    a read of one row reads that row alone."""
    if int(np.prod(shape)) * itemsize <= SMALL_ROW:
        return {"chunks": (rows, *shape)}
    return {"chunks": (1, *shape), "shards": (rows, *shape)}


def new_rows_per_shard() -> int:
    """Rows per shard of a store created now (an existing store keeps its own, `RowStore.rows_per_shard`)."""
    return int(os.environ.get(SHARD_ENV) or ROWS_PER_SHARD)


class DamagedRows(ArtifactError):
    """Rows whose bytes no longer match their checksum; `rows` lists their indices."""

    def __init__(self, message: str, rows: list[int]):
        super().__init__(message)
        self.rows = rows


class RowStore:
    """Rows packed into shards through a per-writer journal, so a kill leaves every row either flagged
    and complete, or in a journal the next writer packs, or not written (redone by the next run).

    bfloat16 has no zarr dtype: it is stored as its raw uint16 bits with `logical_dtype` set."""

    def __init__(self, group: Any):
        self.group = group
        self._readers: dict[str, Any] = {}  # array handles for reads (zarr re-reads metadata on every group[name])
        self._fields: list[str] | None = None
        self._ids: list[str] | None = None
        self._pending: dict[int, dict[str, np.ndarray]] = {}  # journaled rows not yet packed
        self._journal: int | None = None  # this writer's journal (a file descriptor)
        self._journal_path: Path | None = None

    @classmethod
    def create(cls, path: Path, ids: list[str], fields: dict[str, tuple[tuple[int, ...], str]],
               rows_per_shard: int | None = None) -> "RowStore":
        import zarr

        remove_dir(path)  # atomically gone (manifest too), never half-deleted under a valid manifest
        with naming_full_disk(path, " (creating the store)"):
            group = zarr.open_group(str(path), mode="w")
            n, r = len(ids), rows_per_shard or new_rows_per_shard()
            for name, (shape, dtype) in fields.items():
                store_dtype = "uint16" if dtype == "bfloat16" else dtype
                arr = group.create_array(name, shape=(n, *shape), dtype=store_dtype, fill_value=0, compressors=None,
                                         **_blocks(r, shape, np.dtype(store_dtype).itemsize))
                arr.attrs["logical_dtype"] = dtype
            group.create_array(CHECKSUMS, shape=(n, len(fields)), chunks=(r, len(fields)), dtype="uint32",
                               fill_value=0, compressors=None)
            group.create_array(WRITTEN, shape=(n,), chunks=(r,), dtype="uint8", fill_value=0, compressors=None)
            group.attrs.update({"ids": list(ids), "format": FORMAT, "rows_per_shard": r})
        return cls(group)

    @classmethod
    def open(cls, path: Path, mode: str = "r") -> "RowStore":
        import zarr

        return cls(zarr.open_group(str(path), mode=mode))

    @property
    def root(self) -> Path:
        return Path(str(self.group.store.root))

    @property
    def ids(self) -> list[str]:
        if self._ids is None:
            self._ids = list(self.group.attrs["ids"])
        return self._ids

    def row_of(self) -> dict[str, int]:
        """id -> row index, for lookups by id."""
        return {image_id: r for r, image_id in enumerate(self.ids)}

    @property
    def rows_per_shard(self) -> int:
        return int(self.group.attrs.get("rows_per_shard", 1))

    def shard_of(self, row: int) -> int:
        """The shard that holds `row`: rows of one shard must have one writer at a time."""
        return row // self.rows_per_shard

    @property
    def fields(self) -> list[str]:
        if self._fields is None:  # fixed when the store is created: list the group once
            self._fields = sorted(k for k in self.group.array_keys() if k not in _BOOKKEEPING)
        return self._fields

    def _reader(self, name: str) -> Any:
        """The array `name` for reading, opened once (readers never resize a store)."""
        if name not in self._readers:
            self._readers[name] = self.group[name]
        return self._readers[name]

    @property
    def has_checksums(self) -> bool:
        """False for a store written before rows carried checksums: it cannot be verified, so rebuild it."""
        return CHECKSUMS in set(self.group.array_keys())

    @property
    def is_current(self) -> bool:
        """Written in this layout (sharded, with checksums); a cache stage rebuilds any other store."""
        return self.group.attrs.get("format") == FORMAT and self.has_checksums

    def append_rows(self, new_ids: list[str]) -> None:
        """Grow every array by len(new_ids) rows (new rows unwritten). Only the last shard file of each
        array is rewritten later, when its new rows are packed."""
        ids = self.ids + list(new_ids)
        with naming_full_disk(self.root, f" (adding {len(new_ids)} rows)"):  # a rerun resizes to the same shapes
            for name in list(self.group.array_keys()):
                arr = self.group[name]
                arr.resize((len(ids), *arr.shape[1:]))
            self.group.attrs["ids"] = ids
        self._ids = None
        self._readers.clear()  # their shapes changed

    def written_mask(self) -> np.ndarray:
        self._settle()
        return np.asarray(self.group[WRITTEN][:], dtype=bool)

    def intact_mask(self) -> np.ndarray:
        """Rows flagged written whose every shard or chunk file exists with a size that holds them (stat
        only: a plain chunk holds exactly rows_per_shard rows; a shard an index of 16 bytes per row + 4
        and one inner chunk per row up to the array's end when it was packed)."""
        ok = self.written_mask()
        r = self.rows_per_shard
        for name in self.fields + [CHECKSUMS]:
            arr = self.group[name]
            sharded = arr.shards is not None
            chunk = int(np.prod(arr.chunks)) * arr.dtype.itemsize
            index = 16 * r + 4
            zeros = (0,) * (arr.ndim - 1)
            for s in np.unique(np.flatnonzero(ok) // r):
                start = int(s) * r
                held = np.flatnonzero(ok[start:start + r])
                if not len(held):
                    continue
                size = _file_size(self.root / name / arr.metadata.encode_chunk_key((int(s), *zeros)))
                if size != chunk if not sharded else \
                        size < index + (int(held[-1]) + 1) * chunk or (size - index) % chunk:
                    ok[start:start + r] = False
        return ok

    # ---- writing: journal, then shards ----------------------------------------------------------

    def write_row(self, row: int, values: dict[str, Any]) -> None:
        """Write every given array of a row with their checksums, on disk and seen by every reader when
        this returns (its shards are rewritten now: for a few rows; a stage writing many uses `journal_row`)."""
        self.journal_row(row, values)
        self.flush()

    def journal_row(self, row: int, values: dict[str, Any]) -> None:
        """Journal every given array of a row with their checksums (one record, on disk when this
        returns); the row is packed into its shards when the writer moves to another shard or flushes,
        and only then do other readers see it."""
        from stages.core import faults

        if self._pending and self.shard_of(row) != self.shard_of(next(iter(self._pending))):  # they share one shard
            self.flush()
        stored = {name: _stored(value, self._reader(name)) for name, value in values.items()}
        header = json.dumps([[name, _crc32c(v)] for name, v in stored.items()]).encode()
        payload = b"".join(np.ascontiguousarray(v).tobytes() for v in stored.values())
        import google_crc32c

        crc = google_crc32c.extend(google_crc32c.value(header), payload)
        record = _RECORD.pack(_MAGIC, row, len(header), len(payload), crc) + header + payload
        with naming_full_disk(self.root, f", row {row}"):
            fd = self._journal_fd()
            half = len(record) // 2
            os.write(fd, record[:half])
            faults.hit("mid-row")  # a kill here leaves a torn record, which no reader takes
            os.write(fd, record[half:])
        self._pending.setdefault(row, {}).update(stored)

    def _settle(self) -> None:
        """A writer reading its own store sees the rows it journaled."""
        if self._pending:
            self.flush()

    def flush(self) -> None:
        """Pack every journaled row into its shards, then delete the journal."""
        if self._pending:
            with naming_full_disk(self.root, " (packing rows into shards)"):
                self._pack(self._pending)
            self._pending = {}
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None
            self._journal_path.unlink(missing_ok=True)

    def recover(self) -> int:
        """Pack the rows that killed writers left in their journals (call before checking which rows are
        intact, with no other writer running). Returns how many rows were packed."""
        packed = 0
        for path in sorted((self.root / JOURNAL).glob("*.log")):
            if path == self._journal_path:
                continue
            rows = self._read_journal(path)
            if rows:
                with naming_full_disk(self.root, f" (packing the rows of '{path.name}')"):
                    self._pack(rows)
                packed += len(rows)
            path.unlink(missing_ok=True)
        return packed

    def _journal_fd(self) -> int:
        if self._journal is None:
            folder = self.root / JOURNAL
            folder.mkdir(exist_ok=True)
            self._journal_path = folder / f"{socket.gethostname()}-{os.getpid()}-{next(_journals)}.log"
            self._journal = os.open(self._journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o666)
        return self._journal

    def _read_journal(self, path: Path) -> dict[int, dict[str, np.ndarray]]:
        """The complete records of a journal (a torn or damaged tail ends it), later records of a row over
        earlier ones."""
        import google_crc32c

        data, at, rows = path.read_bytes(), 0, {}
        while at + _RECORD.size <= len(data):
            magic, row, nh, np_, crc = _RECORD.unpack_from(data, at)
            body = data[at + _RECORD.size: at + _RECORD.size + nh + np_]
            if magic != _MAGIC or len(body) != nh + np_ or google_crc32c.value(body) != crc:
                break
            at += _RECORD.size + nh + np_
            offset, values = nh, {}
            for name, _ in json.loads(body[:nh]):
                arr = self._reader(name)
                size = int(np.prod(arr.shape[1:])) * arr.dtype.itemsize
                values[name] = np.frombuffer(body[offset:offset + size], dtype=arr.dtype).reshape(arr.shape[1:])
                offset += size
            rows.setdefault(int(row), {}).update(values)
        return rows

    @contextlib.contextmanager
    def _pack_lock(self) -> Iterator[None]:
        """Exclusive across processes on this host (and on file systems with working flock)."""
        folder = self.root / JOURNAL
        folder.mkdir(exist_ok=True)
        with open(folder / "pack.lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _pack(self, rows: dict[int, dict[str, np.ndarray]]) -> None:
        """Write `rows` into their shards: per shard, each field's file, then checksums, then written."""
        r = self.rows_per_shard
        with self._pack_lock():
            arrays = {name: self.group[name] for name in [*self.fields, CHECKSUMS, WRITTEN]}
            for s in sorted({row // r for row in rows}):
                start = s * r
                end = min(start + r, arrays[WRITTEN].shape[0])
                mine = {row - start: vals for row, vals in rows.items() if start <= row < end}
                self._pack_shard(arrays, start, end, mine)

    def _pack_shard(self, arrays: dict[str, Any], start: int, end: int, rows: dict[int, dict[str, np.ndarray]]) -> None:
        written = _read_block(arrays[WRITTEN], start, end)
        flagged = written is not None and bool(written.any())
        written = np.zeros(end - start, dtype=np.uint8) if written is None else written
        sums = _read_block(arrays[CHECKSUMS], start, end) if flagged else None
        sums = np.zeros((end - start, len(self.fields)), dtype=np.uint32) if sums is None else sums
        for k, name in enumerate(self.fields):
            arr = arrays[name]
            partial = any(name not in vals for vals in rows.values())
            block = _read_block(arr, start, end) if flagged or partial else None
            if block is None:
                if flagged:  # the shard file is unreadable: the rows it held are redone by the next run
                    written[:] = 0
                block = np.zeros((end - start, *arr.shape[1:]), dtype=arr.dtype)
            for i, vals in rows.items():
                if name in vals:
                    block[i] = vals[name].reshape(block.shape[1:])
                    sums[i, k] = _crc32c(vals[name])
            self._write_block(arr, name, start, end, block)
        self._write_block(arrays[CHECKSUMS], CHECKSUMS, start, end, sums)
        written[list(rows)] = 1
        self._write_block(arrays[WRITTEN], WRITTEN, start, end, written)

    def _write_block(self, arr: Any, name: str, start: int, end: int, block: np.ndarray) -> None:
        """Rows start:end of one shard, replacing its file atomically. zarr merges a shard that ends
        with the array into the old file; an old file it cannot decode (damaged) is replaced whole."""
        try:
            arr.with_config(_EVERY_CHUNK)[start:end] = block
        except ValueError:
            zeros = (0,) * (arr.ndim - 1)
            (self.root / name / arr.metadata.encode_chunk_key((self.shard_of(start), *zeros))).unlink(missing_ok=True)
            arr.with_config(_EVERY_CHUNK)[start:end] = block

    # ---- reading ----------------------------------------------------------------------------------

    def read_row(self, row: int, names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Whole rows of the given fields (bfloat16 as float32), each checked against its checksum;
        a mismatch raises DamagedRows naming the row."""
        self._settle()
        expected = dict(zip(self.fields, np.asarray(self._reader(CHECKSUMS)[row]).tolist()))
        out = {}
        for name in names or self.fields:
            arr = self._reader(name)
            try:
                stored = np.asarray(arr[row])
            except (ValueError, OSError) as e:  # a shard file of the wrong size does not decode
                raise DamagedRows(f"row {row} ('{self.ids[row]}') of '{self.root}' cannot be read ({e})", [row]) from e
            if _crc32c(stored) != expected[name]:
                raise DamagedRows(f"row {row} ('{self.ids[row]}') of '{self.root}' does not match its checksum "
                                  f"(field '{name}')", [row])
            out[name] = _logical(stored, arr)
        return out

    def read_rows(self, rows: list[int], names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Arrays for the given rows, in order (bfloat16 rows come back as float32), unverified."""
        return {name: np.stack([self.read(name, r) for r in rows]) for name in names or self.fields}

    def read(self, name: str, index: Any) -> np.ndarray:
        """One zarr selection (e.g. ``(row, variant)``) of a field, bfloat16 returned as float32, unverified."""
        self._settle()
        arr = self._reader(name)
        return _logical(np.asarray(arr[index]), arr)

    def failing_rows(self, rows: list[int]) -> list[int]:
        """Those of `rows` that are not intact or whose bytes fail their checksum (reads them all)."""
        intact = self.intact_mask()
        failing = []
        for row in rows:
            try:
                if not intact[row]:
                    raise DamagedRows("not intact", [row])
                self.read_row(row)
            except (DamagedRows, ValueError, OSError):
                failing.append(row)
        return failing

    def mark_unwritten(self, rows: list[int]) -> None:
        """Clear the `written` flag of damaged rows, so the cache stage re-encodes exactly them."""
        import zarr

        with self._pack_lock():  # a read-modify-write of the flags' shard
            written = zarr.open_group(str(self.root), mode="a")[WRITTEN]
            for row in rows:
                written.with_config(_EVERY_CHUNK)[row] = 0

    def nbytes_stored(self) -> int:
        return sum(int(self.group[n].nbytes) for n in self.group.array_keys())


def _read_block(arr: Any, start: int, end: int) -> np.ndarray | None:
    """Rows start:end of an array as stored, or None when its shard file cannot be read."""
    try:
        return np.array(arr[start:end])
    except (ValueError, OSError):
        return None


def _file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _crc32c(array: np.ndarray) -> int:
    import google_crc32c

    return int(google_crc32c.value(np.ascontiguousarray(array).tobytes()))


def _stored(value: Any, arr: Any) -> np.ndarray:
    """The row exactly as zarr stores it (dtype, bf16 bits, broadcast to the row shape)."""
    bits = _bf16_bits(value) if arr.attrs.get("logical_dtype") == "bfloat16" else _to_numpy(value).astype(arr.dtype)
    return np.array(np.broadcast_to(bits, arr.shape[1:]), order="C")  # a scalar row stays 0-d
def _logical(data: np.ndarray, arr: Any) -> np.ndarray:
    if arr.attrs.get("logical_dtype") == "bfloat16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _bf16_bits(value: Any) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits, as torch does."""
    if hasattr(value, "detach") and str(value.dtype) == "torch.bfloat16":
        import torch

        return value.detach().cpu().view(torch.int16).numpy().view(np.uint16)
    f = np.ascontiguousarray(_to_numpy(value), dtype=np.float32).view(np.uint32)
    rounded = f + 0x7FFF + ((f >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)
