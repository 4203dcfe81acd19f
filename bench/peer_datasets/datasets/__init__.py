"""A stand-in for `datasets.load_dataset(<local imagefolder>)`, put on a peer script's PYTHONPATH by
bench/peers.py only where the real `datasets` is not installed (the H200 image lacks it; its wheel and
pyarrow would not fit the 64 MiB carried to the machine).

It reads what bench/peers.py writes and nothing else: a folder with metadata.jsonl whose rows hold
`file_name` (column `image`), optional `<name>_file_name` columns (column `<name>`, as the real
imagefolder builder names them) and plain text columns. Images open as PIL images, as the real one
returns them. The peer scripts use it only while they build their dataset, before the first step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__version__ = "0-lorapipe-standin"


class _Split:
    def __init__(self, rows: list[dict[str, Any]]):
        self._rows = rows
        self.column_names = list(rows[0]) if rows else []

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, key: int | str) -> Any:
        if isinstance(key, str):
            return [row[key] for row in self._rows]
        return self._rows[key]


def load_dataset(path: str, name: str | None = None, cache_dir: str | None = None, **_: Any) -> dict[str, _Split]:
    from PIL import Image

    folder = Path(path)
    meta = folder / "metadata.jsonl"
    if not meta.is_file():
        raise FileNotFoundError(f"the datasets stand-in reads only a local folder with metadata.jsonl; {meta} is missing")
    rows = []
    for line in meta.read_text().splitlines():
        if not line.strip():
            continue
        rec, row = json.loads(line), {}
        for key, value in rec.items():
            if key == "file_name":
                row["image"] = Image.open(folder / value)
            elif key.endswith("_file_name"):
                row[key[: -len("_file_name")]] = Image.open(folder / value)
            else:
                row[key] = value
        rows.append(row)
    return {"train": _Split(rows)}
