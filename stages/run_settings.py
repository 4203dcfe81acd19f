"""A run's settings (`<run>/config.json`): they change only when the user asks, and say what they change.

    lorapipe config my-lora                                # the run's settings that differ from the defaults
    lorapipe config my-lora --set train.steps=2000         # change one: the diff, and the stages it makes stale
    lorapipe config my-lora --config configs/my-lora.toml  # take the (edited) preset

`config.json` holds the settings the run's artifacts are made with. It is written when a command first
names the run with `--config`, when a later command passes `--config` again (a preset, with the `--set`
and `--model` of that line, is the user's explicit choice; the change is printed as a diff with the
stages it makes stale), and by `lorapipe config`. Nothing else writes it: by name, `--set`/`--model`
apply to that command only, and command flags (`--vram`, `--verify`, ...) always do. A run remembers
its preset (`preset.json`): when that file changes later, every command by name says so, and keeps
the run's settings until the user takes the preset with `--config`.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from stages.core.artifacts import atomic_write_json, read_json
from stages.core.config import load_config
from stages.core.errors import ConfigError, UserError
from stages.core.runspec import RunSpec, flatten, read_saved
from stages import registry

PRESET = "preset.json"
WHERE = ("run", "artifacts")  # where the run lives, not how its artifacts are made


def comparable(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in flatten(settings).items() if k not in WHERE}


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key: old -> new' for every setting that differs (where the run lives left out)."""
    a, b = comparable(old), comparable(new)
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _parts(stage: Any, cfg: Any) -> dict[str, Any]:
    """The stage's fingerprint parts under `cfg`, by expert ("" for a stage with one artifact): a stage that
    trains or exports each expert of train.expert = "both" keeps each one's as a run of that expert alone."""
    try:
        return {unit.train.expert if len(units) > 1 else "": stage.fingerprint_parts(unit)
                for units in [stage.units(cfg)] for unit in units}
    except (UserError, OSError) as e:  # a setting the stage cannot read yet counts as a change
        return {"": f"{type(e).__name__}: {e}"}


def _built(stage: Any, cfg: Any) -> bool:
    from stages.core.caches import lora_dir

    return any(stage.artifact_dir(u).exists() or (stage.name == "train" and lora_dir(u).exists()) for u in stage.units(cfg))


def made_stale(old: Any, new: Any) -> list[str]:
    """The stages with artifacts that going from settings `old` to `new` makes stale: what they read of the
    settings changed (for each adapter `new` trains: switching train.expert from "both" to "low" keeps low's),
    or a stage they read from changes. One that only lacks what `new` asks (an export's format) is stale, while
    what it holds, and so the stages that read it, stays."""
    stale: list[str] = []
    changing: set[str] = set()  # the stages whose artifacts' contents change
    for stage in registry.ALL:
        before, after = _parts(stage, old), _parts(stage, new)
        if len(before) > 1 and len(after) == 1:  # "both" -> one expert: that expert's adapter as it was
            before = {"": before.get(new.train.expert)}
        elif len(after) > 1 and len(before) == 1:  # one expert -> "both": the other's is new
            before = {old.train.expert: before[""]}
        if not _built(stage, old):
            continue
        changes = any(u in changing for u in stage.reads) or before != after
        if changes or _asks_more(stage, old, new):
            stale.append(stage.name)
        if changes:
            changing.add(stage.name)
    return stale


def _asks_more(stage: Any, old: Any, new: Any) -> bool:
    """Whether `new` asks a built artifact for what it lacks and `old` did not ask (export-lora: a format)."""
    from stages.core.artifacts import read_manifest

    olds = {unit.train.expert: unit for unit in stage.units(old)}
    for unit in stage.units(new):
        manifest = read_manifest(stage.artifact_dir(unit))
        was = olds.get(unit.train.expert)
        if manifest is not None and set(stage.lacks(unit, manifest)) - set(stage.lacks(was, manifest) if was else []):
            return True
    return False


def describe(old: Any, new: Any) -> list[str]:
    """The diff of two settings and the stages it makes stale, as lines; empty when nothing differs."""
    diff = changes(old.to_dict(), new.to_dict())
    if not diff:
        return []
    stale = made_stale(old, new)
    return [f"  {line}" for line in diff] + [f"  makes stale: {', '.join(stale)}" if stale else "  makes no stage stale"]


def saved(run_dir: Path) -> Any | None:
    """The run's saved settings as a Config (None when it has none)."""
    path = run_dir / "config.json"
    if not path.is_file():
        return None
    return load_config(None, {**flatten(read_saved(path)), "artifacts": str(run_dir.parent), "run": run_dir.name},
                       source=str(path))


def save(settings: Any, spec: RunSpec) -> None:
    """Write the run's config.json, and with a preset, what the preset said (to notice a later edit)."""
    atomic_write_json(settings.run_dir / "config.json", settings.to_dict())
    if spec.config:
        atomic_write_json(settings.run_dir / PRESET, {
            "path": os.path.abspath(spec.config), "sets": list(spec.sets), "model": spec.model,
            "settings": comparable(load_config(spec.config).to_dict())})


def settle(spec: RunSpec, write: bool) -> list[str]:
    """Before a command runs: with --config, the preset (and the line's --set/--model) becomes the run's
    settings (saved when `write`); by name, a note when the run's preset was edited since it was taken.
    Returns the lines to show."""
    if spec.by_name():
        return preset_note(spec)
    if not spec.config:  # neither a run nor a preset named: the defaults alone define no run to save
        return []
    new = spec.settings()
    old = saved(new.run_dir)
    lines = describe(old, new) if old is not None else []
    if write:
        save(new, spec)
    if not lines:
        return []
    if not write:
        return [f"{spec.config} differs from the settings of run '{new.run}' (shown as they would be with it; "
                f"`{_cmd('config', spec)}` saves it):", *lines]
    return [f"run '{new.run}' takes the settings of {spec.config} (saved in {new.run_dir / 'config.json'}):", *lines]


def preset_note(spec: RunSpec) -> list[str]:
    """When the preset a run was taken from has changed since: the diff, and how to take it."""
    run_dir = spec.root() / str(spec.name)
    path = run_dir / PRESET
    if not path.is_file() or os.environ.get("LORAPIPE_DIE_WITH_PARENT") == "1":  # `run`'s children: said once
        return []
    record = read_json(path)
    if not Path(record["path"]).is_file():
        return []
    try:
        if comparable(load_config(record["path"]).to_dict()) == record["settings"]:
            return []
        taken = RunSpec(spec.name, record["path"], spec.artifacts, record.get("model"), tuple(record.get("sets", ())))
        lines = describe(spec.settings(), taken.settings())
    except UserError as e:
        return [f"{record['path']} (the preset of run '{spec.name}') was edited since and no longer loads: {e}"]
    if not lines:
        return []
    return [f"{record['path']} was edited since run '{spec.name}' took it; this command keeps the run's settings. "
            f"Taking the preset (`{_cmd('config', taken)}`) would change:", *lines]


def _cmd(name: str, spec: RunSpec) -> str:
    return shlex.join(["lorapipe", name, *spec.user_args()])


def configure(spec: RunSpec, dry_run: bool) -> list[str]:
    """`lorapipe config`: show the run's settings, or change them (--set/--model by name, or a preset)."""
    if not spec.name and not spec.config:
        raise ConfigError("name the run: `lorapipe config my-lora [--set KEY=VALUE]`, or a preset with --config")
    new = spec.settings() if spec.config else spec.load()
    old = saved(new.run_dir)
    if old is None:
        if not dry_run:
            save(new, spec)
        return [f"run '{new.run}': new, settings saved in {new.run_dir / 'config.json'}" + (" (not saved: --dry-run)" if dry_run else "")]
    lines = describe(old, new)
    if spec.config and not dry_run:
        save(new, spec)  # also when nothing changed: the preset is now the one the run follows
    if not lines:
        defaults = comparable(load_config(None, {"model": new.model}).to_dict())
        own = [f"  {k} = {v!r}" for k, v in comparable(new.to_dict()).items() if defaults.get(k) != v or k == "model"]
        return [f"run '{new.run}' ({new.run_dir / 'config.json'}), settings that differ from the defaults:", *own]
    if not dry_run:
        save(new, spec)
    return [f"run '{new.run}': {'would change (--dry-run: nothing saved)' if dry_run else 'settings changed'}:", *lines]
