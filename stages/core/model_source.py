"""Where a model comes from: a local diffusers pipeline folder or a hub id (+ revision).

Each stage loads only its own components (`subfolder=`), through the same `from_pretrained` call a
user's real model takes. `identity()` is cheap (no weights read) and feeds the stage fingerprints.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelError(RuntimeError):
    """The model path or id cannot be used; the message says what to do."""


@dataclass(frozen=True)
class ModelSource:
    ref: str
    revision: str = ""

    @property
    def is_local(self) -> bool:
        return Path(self.ref).exists() or self.ref.startswith((".", "/", "~"))

    @property
    def path(self) -> Path:
        return Path(self.ref).expanduser()

    def check(self, components: tuple[str, ...]) -> None:
        """Fail early, naming the folder, when a local model lacks a component a stage needs."""
        if not self.is_local:
            return
        if not self.path.is_dir():
            raise ModelError(
                f"model '{self.ref}' does not exist. Set 'model' to a diffusers pipeline folder "
                f"(with model_index.json) or a hub id such as black-forest-labs/FLUX.1-dev"
            )
        if not (self.path / "model_index.json").is_file():
            raise ModelError(
                f"model folder '{self.ref}' is not a diffusers pipeline (no model_index.json). "
                f"Point 'model' at the folder that holds model_index.json and the component subfolders"
            )
        for comp in components:
            if not (self.path / comp).is_dir():
                raise ModelError(f"model folder '{self.ref}' has no '{comp}' subfolder, which this stage needs")

    def load(self, cls: Any, subfolder: str, **kwargs: Any) -> Any:
        """`cls.from_pretrained(ref, subfolder=...)`; a hub id that is not cached gives a clear error."""
        if self.revision:
            kwargs["revision"] = self.revision
        try:
            return cls.from_pretrained(str(self.path) if self.is_local else self.ref, subfolder=subfolder, **kwargs)
        except OSError as e:
            if self.is_local:
                raise ModelError(f"cannot load '{subfolder}' from '{self.ref}': {e}") from e
            offline = os.environ.get("HF_HUB_OFFLINE") == "1"
            hint = (
                "HF_HUB_OFFLINE=1 is set and no cached copy exists: run `huggingface-cli download "
                f"{self.ref}` on a machine with network, or point 'model' at a local folder"
                if offline
                else f"check the id, your network and `huggingface-cli login` (gated models need access)"
            )
            raise ModelError(f"cannot load '{subfolder}' of '{self.ref}': {hint}. ({e})") from e

    def component_config(self, subfolder: str, name: str = "config.json") -> dict[str, Any]:
        """A component's JSON config without loading weights (local folders or the hub cache)."""
        if self.is_local:
            path = self.path / subfolder / name
        else:
            from huggingface_hub import hf_hub_download

            try:
                path = Path(hf_hub_download(self.ref, f"{subfolder}/{name}", revision=self.revision or None))
            except Exception as e:  # noqa: BLE001 - hub errors come in many types
                raise ModelError(f"cannot read {subfolder}/{name} of '{self.ref}': {e}") from e
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelError(f"model '{self.ref}' has no {subfolder}/{name}") from None

    def identity(self, components: tuple[str, ...]) -> str:
        """Content identity of the named components (configs, weight sizes and edges; not the path)."""
        if not self.is_local:
            return f"hub:{self.ref}@{self.revision or 'main'}"
        h = hashlib.sha256()
        for comp in sorted(components):
            folder = self.path / comp
            if not folder.is_dir():
                h.update(f"{comp}:missing".encode())
                continue
            for f in sorted(folder.iterdir()):
                h.update(f.name.encode())
                if f.is_dir():
                    continue
                if f.suffix == ".json":
                    h.update(f.read_bytes())
                else:  # weights: size plus the first and last MiB tell two checkpoints apart cheaply
                    size = f.stat().st_size
                    h.update(str(size).encode())
                    with f.open("rb") as fh:
                        h.update(fh.read(1 << 20))
                        fh.seek(max(0, size - (1 << 20)))
                        h.update(fh.read(1 << 20))
        return f"local:{h.hexdigest()[:16]}"
