"""Zarr row stores with an integrity record per row: the shared format of captions.zarr and latents.zarr.

A RowStore is a zarr group of arrays shaped (rows, *item_shape), one uncompressed chunk per row, plus
two bookkeeping arrays: `checksums` (rows, fields), the crc32c of each field's chunk bytes, and
`written`, a flag set only after the row's arrays and checksums are on disk.

Checking a row costs two levels:
- `intact_mask` (cheap, every stage start and `status`): the row is flagged written and each of its
  chunk files exists with exactly the size an uncompressed chunk has (one stat per chunk file);
- `read_row` (when a row is read anyway, for training or `inspect`): the crc32c of its bytes.
crc32c, not zlib's crc32: `google-crc32c` is installed with zarr and uses the CPU's crc32c
instruction (1.8 GB/s against zlib.crc32's 0.8 GB/s on 64 MiB here), so verifying on read costs
little next to the read itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from stages.core.artifacts import naming_full_disk, remove_dir
from stages.core.errors import ArtifactError

WRITTEN, CHECKSUMS = "written", "checksums"
_BOOKKEEPING = (WRITTEN, CHECKSUMS)
# zarr skips writing a chunk equal to the fill value (an all-zero flip row, say); every chunk must
# exist on disk so that a missing file always means damage
_EVERY_CHUNK = {"write_empty_chunks": True}


class DamagedRows(ArtifactError):
    """Rows whose bytes no longer match their checksum; `rows` lists their indices."""

    def __init__(self, message: str, rows: list[int]):
        super().__init__(message)
        self.rows = rows


class RowStore:
    """One chunk per row, so concurrent writers of different rows never share a chunk, and a kill
    leaves a row either flagged and complete or unflagged (redone by the next run).

    bfloat16 has no zarr dtype: it is stored as its raw uint16 bits with `logical_dtype` set."""

    def __init__(self, group: Any):
        self.group = group
        self._readers: dict[str, Any] = {}  # array handles for reads (zarr re-reads metadata on every group[name])
        self._fields: list[str] | None = None

    @classmethod
    def create(cls, path: Path, ids: list[str], fields: dict[str, tuple[tuple[int, ...], str]]) -> "RowStore":
        import zarr

        remove_dir(path)  # atomically gone (manifest too), never half-deleted under a valid manifest
        with naming_full_disk(path, " (creating the store)"):
            group = zarr.open_group(str(path), mode="w")
            n = len(ids)
            for name, (shape, dtype) in fields.items():
                store_dtype = "uint16" if dtype == "bfloat16" else dtype
                arr = group.create_array(name, shape=(n, *shape), chunks=(1, *shape), dtype=store_dtype,
                                         fill_value=0, compressors=None)
                arr.attrs["logical_dtype"] = dtype
            group.create_array(CHECKSUMS, shape=(n, len(fields)), chunks=(1, len(fields)), dtype="uint32",
                               fill_value=0, compressors=None)
            group.create_array(WRITTEN, shape=(n,), chunks=(1,), dtype="uint8", fill_value=0, compressors=None)
            group.attrs["ids"] = list(ids)
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
        return list(self.group.attrs["ids"])

    def row_of(self) -> dict[str, int]:
        """id -> row index, for lookups by id."""
        return {image_id: r for r, image_id in enumerate(self.ids)}

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

    def append_rows(self, new_ids: list[str]) -> None:
        """Grow every array by len(new_ids) rows (new rows unwritten)."""
        ids = self.ids + list(new_ids)
        with naming_full_disk(self.root, f" (adding {len(new_ids)} rows)"):  # a rerun resizes to the same shapes
            for name in list(self.group.array_keys()):
                arr = self.group[name]
                arr.resize((len(ids), *arr.shape[1:]))
            self.group.attrs["ids"] = ids
        self._readers.clear()  # their shapes changed

    def written_mask(self) -> np.ndarray:
        return np.asarray(self.group[WRITTEN][:], dtype=bool)

    def intact_mask(self) -> np.ndarray:
        """Rows flagged written whose every chunk file exists with its exact size (stat only)."""
        ok = self.written_mask()
        for name in self.fields + [CHECKSUMS]:
            arr = self.group[name]
            size = int(np.prod(arr.chunks)) * arr.dtype.itemsize
            zeros = (0,) * (arr.ndim - 1)
            for row in np.flatnonzero(ok):
                ok[row] = _file_size(self.root / name / arr.metadata.encode_chunk_key((int(row), *zeros))) == size
        return ok

    def write_row(self, row: int, values: dict[str, Any]) -> None:
        """Write every array of a row and their checksums, then its `written` flag. Each zarr chunk is
        replaced atomically (temp file + rename)."""
        from stages.core import faults

        with naming_full_disk(self.root, f", row {row}"):
            # a partial row keeps the checksums of the fields it does not rewrite
            sums = dict(zip(self.fields, np.asarray(self.group[CHECKSUMS][row]).tolist()))
            for name, value in values.items():
                arr = self.group[name]
                stored = _stored(value, arr)
                arr.with_config(_EVERY_CHUNK)[row] = stored
                sums[name] = _crc32c(stored)
            self.group[CHECKSUMS].with_config(_EVERY_CHUNK)[row] = [sums[name] for name in self.fields]
            faults.hit("mid-row")
            self.group[WRITTEN].with_config(_EVERY_CHUNK)[row] = 1

    def read_row(self, row: int, names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Whole rows of the given fields (bfloat16 as float32), each checked against its checksum;
        a mismatch raises DamagedRows naming the row."""
        expected = dict(zip(self.fields, np.asarray(self._reader(CHECKSUMS)[row]).tolist()))
        out = {}
        for name in names or self.fields:
            arr = self._reader(name)
            try:
                stored = np.asarray(arr[row])
            except (ValueError, OSError) as e:  # a chunk file of the wrong size does not decode
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

        written = zarr.open_group(str(self.root), mode="a")[WRITTEN]
        for row in rows:
            written[row] = 0

    def nbytes_stored(self) -> int:
        return sum(int(self.group[n].nbytes) for n in self.group.array_keys())


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
    return np.ascontiguousarray(np.broadcast_to(bits, arr.shape[1:]))


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
