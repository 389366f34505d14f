"""Small state files replaced whole: written aside, made durable, then renamed over the old one, so a
crash leaves the old file or the new one, never half of either."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


class DataDirStateError(Exception):
    """A file (or folder) under the data dir that a start reads cannot be read, or is not what Sluice
    writes there: the start stops, naming it and what to do, and never goes on without it. `sluice serve`
    exits 1 on it (a failure, as a damaged block log: not a usage error, exit 2)."""


def replace_json(path: Path, data: object, *, sync: bool = True) -> None:
    """Replace `path` with `data` as JSON: a temp file beside it, fsynced (when `sync`), renamed over it,
    then the folder fsynced so the rename itself survives a power loss. OSError: the old file stays, and
    the temp file is removed (a full disk left an empty one behind at every refused change)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    try:
        with open(temp, "w") as file:
            json.dump(data, file, indent=1)
            if sync:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # not there (open failed), or a folder in its way
            temp.unlink()
        raise
    if sync:
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def read_json(path: Path, what: str, error: Callable[[str], Exception], remedy: str = "") -> Any:
    """The JSON in `path`, None when there is no such file; `error("PATH: cannot read WHAT: why; REMEDY")`
    raised when it cannot be read or parsed (a start must stop on it and name it, never skip it)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise error(f"{path}: cannot read {what}: {why}{'; ' + remedy if remedy else ''}") from None
