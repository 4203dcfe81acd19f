"""Every failure a user can cause or fix, as one hierarchy.

`pipeline.py` prints a `UserError` as one line (`error: <message>`) and exits 2, without a
traceback (`LORAPIPE_DEBUG=1` shows it). Everything else is a bug and keeps its traceback.
Subclasses say which kind of input was wrong; each message names the file, item or key and what
to do about it.
"""

from __future__ import annotations


class UserError(RuntimeError):
    """A problem the user can fix; the message names the file, item or key and the fix."""

    item: str | None = None


class ConfigError(UserError, ValueError):
    """A config file or override is wrong; the message names the file and key."""


class DatasetError(UserError, ValueError):
    """The dataset folder, a caption or an image is unusable; the message names the file."""


class ArtifactError(UserError):
    """An artifact is missing, stale, damaged or made for something else; names the stage to rerun."""


class ModelError(UserError):
    """A model path, hub id or component cannot be loaded as asked."""


class StageLocked(UserError):
    """Another process already runs this stage of this run."""


class ResourceError(UserError):
    """The machine cannot do what was asked: no CUDA for nf4/fp8, out of GPU memory, a read-only folder."""


class TrainingDiverged(UserError, FloatingPointError):
    """The training loss stopped being a finite number; names the step and what to change."""


def listing(names: list[str], most: int = 8) -> str:
    """'a, b, c' or 'a, ..., h and 4 more': a warning names files without growing without bound."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
