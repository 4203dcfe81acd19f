"""How every command names its run: a run name (positional), or `--config`, plus `--artifacts`.

    lorapipe train my-lora                     # the run's settings, saved as artifacts/my-lora/config.json
    lorapipe train --config configs/x.toml     # a preset (its `run` names the folder)
    lorapipe status my-lora --artifacts /data/runs

With a config, a run name renames the run. What a command may change of the run's settings:

- `--config PRESET`, with the `--set`/`--model` on that line, defines them: a writing command saves
  them as the run's `config.json`, and says what changed (stages/run_settings.py);
- by name, `--set`/`--model` apply to that command only (`lorapipe config RUN --set k=v` saves one);
- command flags (`--vram`, `--verify`, `--format`, `--ema`: `flags`) apply to that command only, always.

Imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ARTIFACTS = "artifacts"
# the key each command flag sets, to name the flag when its value is wrong
FLAG_KEYS = {"gpu.vram_budget_gb": "--vram", "export.verify": "--verify", "export.format": "--format",
             "export.ema": "--ema"}


@dataclass(frozen=True)
class RunSpec:
    name: str | None = None
    config: str | None = None
    artifacts: str | None = None
    model: str | None = None
    sets: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    """KEY=VALUE set by a command flag (--vram, --verify, ...): this command only, never saved."""

    def from_path(self) -> RunSpec:
        """RUN given as a run folder's path (`lorapipe inspect artifacts/my-lora`, `status runs/x/`): its last part
        is the run's name and the rest its artifacts root, unless --artifacts names the root itself."""
        if not self.name or self.artifacts or not any(sep in self.name for sep in ("/", "\\")):
            return self
        path = Path(self.name)
        return dataclasses.replace(self, name=path.name, artifacts=str(path.parent)) if path.name else self

    def with_flags(self, *flags: str) -> RunSpec:
        return dataclasses.replace(self, flags=self.flags + flags)

    def given(self, flags: bool = True) -> dict[str, tuple[str, Any]]:
        """The keys the command line sets: {key: (the flag that set it, value)}, later ones winning."""
        from stages.core.config import parse_override

        out: dict[str, tuple[str, Any]] = {}
        for text in self.sets:
            key, value = parse_override(text)
            out[key] = (f"--set {text}", value)
        if self.model:
            out["model"] = (f"--model {self.model}", self.model)
        for text in self.flags if flags else ():
            key, value = parse_override(text)
            out[key] = (f"{FLAG_KEYS.get(key, '--set')} {value}", value)
        return out

    def _overrides(self, flags: bool = True) -> dict[str, Any]:
        overrides = {key: value for key, (_, value) in self.given(flags).items()}
        if self.artifacts:
            overrides["artifacts"] = self.artifacts
        if self.name:
            overrides["run"] = self.name
        return overrides

    def _labels(self) -> dict[str, str]:
        return {key: label for key, (label, _) in self.given().items()}

    def root(self) -> Path:
        """The artifact root to look in before any config is read."""
        return Path(self.artifacts or self._overrides().get("artifacts") or DEFAULT_ARTIFACTS)

    def saved_config(self) -> Path:
        return self.root() / str(self.name) / "config.json"

    def saved(self) -> dict[str, Any] | None:
        """The run's saved settings (config.json), None when it has none."""
        saved = self.saved_config()
        if not self.name or not saved.is_file():
            return None
        return read_saved(saved)

    def by_name(self) -> bool:
        return not self.config and bool(self.name)

    def settings(self) -> Any:
        """The run's settings as this command defines them: the preset with the line's --set/--model, or
        (by name) the saved ones; without the command flags."""
        return self._load(flags=False, one_off=False)

    def load(self) -> Any:
        """The Config this command runs with: the run's settings, and the command's own overrides."""
        return self._load(flags=True, one_off=True)

    def _load(self, flags: bool, one_off: bool) -> Any:
        from stages.core.config import load_config
        from stages.core.errors import ConfigError

        labels = self._labels()
        if not self.by_name():
            return load_config(self.config, self._overrides(flags), labels=labels)
        data = self.saved()
        if data is None:
            raise ConfigError(f"run '{self.name}' has no {self.saved_config()} (no stage of it has run under "
                              f"'{self.root()}'): pass --config <its preset>, or --artifacts <the folder that holds it>")
        overrides = self._overrides(flags) if one_off else {"run": self.name}
        # found under root(): the run lives there, wherever its saved `artifacts` pointed
        return load_config(None, {**flatten(data), **overrides, "artifacts": str(self.root())},
                           source=str(self.saved_config()), labels=labels)

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
        be "ambiguous: --run-path"). Command flags pass as --once, which the child never saves."""
        args = self.user_args()
        for s in self.flags:
            args += ["--once", s]
        return args

    def user_args(self) -> list[str]:
        """The run as the user named it: RUN, --config, --artifacts, --model and every --set, for a
        command the user can paste (stages.core.config.command)."""
        args = [self.name] if self.name else []
        args += ["--config", self.config] if self.config else []
        args += ["--artifacts", self.artifacts] if self.artifacts else []
        args += ["--model", self.model] if self.model else []
        for s in self.sets:
            args += ["--set", s]
        return args


_INVOKED: list[RunSpec] = []  # how the running command named its run
_WORKING_ON: list[Path] = []  # the run a stage of this process works on


def invoke(spec: RunSpec) -> RunSpec:
    """Remember how this process's command named its run, for the commands its messages suggest."""
    _INVOKED[:] = [spec]
    return spec


def forget() -> None:
    """The command is over: its run is no longer this process's (a test runs many in one process)."""
    _INVOKED.clear()
    _WORKING_ON.clear()


def working_on(run_dir: Path) -> None:
    """A stage starts on the run in `run_dir`: a suggestion that cannot name its run names this one."""
    _WORKING_ON[:] = [run_dir]


def invoked(run_dir: Path) -> RunSpec | None:
    """The spec `invoke` remembered, when it names the run in `run_dir`."""
    from stages.core.errors import UserError

    try:
        return next((s for s in _INVOKED if s.run_dir().absolute() == run_dir.absolute()), None)
    except (UserError, OSError):
        return None


def command_for(run_dir: Path | None, name: str, *flags: str) -> str:
    """A command line the user can paste for the run in `run_dir` (None: the run this process's command
    named): as the command named it (RUN, --config, --artifacts, --model, --set), else by name and root."""
    import shlex

    if run_dir is None and _INVOKED:
        return shlex.join(["lorapipe", name, *_INVOKED[0].user_args(), *flags])
    run_dir = run_dir or (_WORKING_ON[0] if _WORKING_ON else Path(DEFAULT_ARTIFACTS) / "RUN")
    spec = invoked(run_dir)
    if spec is not None:
        return shlex.join(["lorapipe", name, *spec.user_args(), *flags])
    return shlex.join(["lorapipe", name, run_dir.name, "--artifacts", str(run_dir.parent), *flags])


def save_then(run_dir: Path, name: str, *flags: str, sets: tuple[str, ...] = ()) -> str:
    """The pasteable way to run `name` with settings the run keeps: where the command named the run by name with
    --set / --model (which apply to that command only), or `sets` are suggested, `lorapipe config` saves them
    first, so a later plain command (`run`, `status`) agrees with what this one makes; else `command_for`."""
    import shlex

    spec = invoked(run_dir)
    by_name = spec is None or not spec.config
    one_off = (spec.sets if spec is not None and by_name else ()) + sets
    model = spec.model if spec is not None and by_name else None
    if not one_off and not model:
        return f"`{command_for(run_dir, name, *flags)}`"
    bare = dataclasses.replace(spec, sets=(), model=None) if spec is not None else None
    args = bare.user_args() if bare is not None else [run_dir.name, "--artifacts", str(run_dir.parent)]
    save = ["lorapipe", "config", *args, *(["--model", model] if model else []), *(a for s in one_off for a in ("--set", s))]
    return f"`{shlex.join(save)}` (saves them as the run's settings), then `{shlex.join(['lorapipe', name, *args, *flags])}`"


def read_saved(path: Path) -> dict[str, Any]:
    """A run's saved settings (`<run>/config.json`) as a nested dict. One written before [runtime] held how the
    stages run is rewritten once in this version's sections (the same settings), with a line saying so."""
    from stages.core.config import migrate_saved
    from stages.core.errors import ConfigError

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); pass --config <the run's preset>") from None
    moved = migrate_saved(data) if isinstance(data, dict) else []
    if moved:
        from stages.core.artifacts import atomic_write_json

        atomic_write_json(path, data)
        print(f"{path}: {len(moved)} keys of how the stages run moved from [train] to [runtime] "
              f"({', '.join(moved[:3])}{', ...' if len(moved) > 3 else ''}); the run's settings are unchanged",
              file=sys.stderr)
    return data


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"steps": 5}} -> {"train.steps": 5}: a saved config as dotted overrides."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out
