"""How every command names its run: a run name (positional), or `--config`, plus `--artifacts`.

    lorapipe train my-lora                     # the config saved as artifacts/my-lora/config.json
    lorapipe train --config configs/x.toml     # a preset (its `run` names the folder)
    lorapipe status my-lora --artifacts /data/runs

With a config, a run name renames the run. With only a run name, the command reads the resolved
config that the run's last stage saved beside its artifacts. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ARTIFACTS = "artifacts"


@dataclass(frozen=True)
class RunSpec:
    name: str | None = None
    config: str | None = None
    artifacts: str | None = None
    model: str | None = None
    sets: tuple[str, ...] = ()

    def from_path(self) -> RunSpec:
        """RUN given as a run folder's path (`lorapipe inspect artifacts/my-lora`, `status runs/x/`): its last part
        is the run's name and the rest its artifacts root, unless --artifacts names the root itself."""
        if not self.name or self.artifacts or not any(sep in self.name for sep in ("/", "\\")):
            return self
        path = Path(self.name)
        return dataclasses.replace(self, name=path.name, artifacts=str(path.parent)) if path.name else self

    def _overrides(self) -> dict[str, Any]:
        from stages.core.config import parse_override

        overrides = dict(parse_override(s) for s in self.sets)
        if self.model:
            overrides["model"] = self.model
        if self.artifacts:
            overrides["artifacts"] = self.artifacts
        if self.name:
            overrides["run"] = self.name
        return overrides

    def root(self) -> Path:
        """The artifact root to look in before any config is read."""
        return Path(self.artifacts or self._overrides().get("artifacts") or DEFAULT_ARTIFACTS)

    def saved_config(self) -> Path:
        return self.root() / str(self.name) / "config.json"

    def load(self) -> Any:
        """The run's Config: the preset with overrides, or the run's saved config with overrides."""
        from stages.core.config import load_config
        from stages.core.errors import ConfigError

        overrides = self._overrides()
        if self.config or not self.name:
            return load_config(self.config, overrides)
        saved = self.saved_config()
        if not saved.is_file():
            raise ConfigError(f"run '{self.name}' has no {saved} (no stage of it has finished under "
                              f"'{self.root()}'): pass --config <its preset>, or --artifacts <the folder that holds it>")
        try:
            data = json.loads(saved.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{saved} is not valid JSON ({e}); pass --config <the run's preset>") from None
        # found under root(): the run lives there, wherever its saved `artifacts` pointed
        return load_config(None, {**flatten(data), "artifacts": str(self.root()), **overrides})

    def run_dir(self) -> Path:
        """The run's folder, without reading a saved config (for commands that only read files)."""
        if self.config:
            return self.load().run_dir
        if not self.name:
            from stages.core.errors import ConfigError

            raise ConfigError("name the run: a run name (e.g. `status my-lora`) or --config <preset>")
        return self.root() / self.name

    def child_args(self) -> list[str]:
        """The same run for a child `pipeline.py <stage>`: the name first (a positional, which torchrun
        passes on untouched), then long options that no torchrun option starts with (`--run` would
        be "ambiguous: --run-path")."""
        args = [self.name] if self.name else []
        args += ["--config", self.config] if self.config else []
        args += ["--artifacts", self.artifacts] if self.artifacts else []
        args += ["--model", self.model] if self.model else []
        for s in self.sets:
            args += ["--set", s]
        return args


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"steps": 5}} -> {"train.steps": 5}: a saved config as dotted overrides."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out

