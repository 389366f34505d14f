"""Small state files replaced whole: written aside, made durable, then renamed over the old one, so a
crash leaves the old file or the new one, never half of either."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any


class DataDirStateError(Exception):
    """A file (or folder) under the data dir that a start reads cannot be read, or is not what Sluice
    writes there: the start stops, naming it and what to do, and never goes on without it. `sluice serve`
    exits 1 on it (a failure, as a damaged block log: not a usage error, exit 2)."""


class NotARegularFileError(OSError):
    """A path where the data dir has a file is a FIFO, a socket or a device. Opening a FIFO to read it
    waited for a writer for ever (a start that hung, deaf to SIGTERM), and a device such as /dev/zero
    read without end."""


class BrokenLinkError(OSError):
    """A path where the data dir has a file is a symlink to a path that does not exist. Taken for a
    missing file (FileNotFoundError) it was passed over as one: a log's segment and the acked records in
    it skipped without a word, a released mark or an incarnation taken for none. Not a
    FileNotFoundError, so that no handler of a file that is absent (or released meanwhile) takes it."""


NOT_REGULAR = "not a regular file (a FIFO, a socket or a device)"


def broken_link(path: Path | str) -> BrokenLinkError | None:
    """The error to raise when `path`, not found, is a symlink to nowhere; None when it is not a symlink
    (absent, or a folder on its way absent): it is then truly not there."""
    try:
        target = os.readlink(path)
    except OSError:
        return None
    return BrokenLinkError(errno.ENOENT, f"a symlink to {target}, which does not exist", str(path))


def present(path: Path | str) -> bool:
    """Whether `path` names anything, a symlink to nowhere too (os.path.lexists, but an error other than
    "no such file" raises: a path too long or a folder no one may search is not an absent file)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def check_regular(fd: int, path: Path | str) -> None:
    """Raise IsADirectoryError when `fd` (opened from `path`) is a folder, NotARegularFileError when it
    is anything else but a regular file."""
    mode = os.fstat(fd).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(mode):
        raise NotARegularFileError(errno.EINVAL, NOT_REGULAR, str(path))


def open_regular(path: Path | str) -> int:
    """A read-only descriptor of the regular file at `path` (symlinks followed), opened without waiting
    (O_NONBLOCK: a FIFO's open does not wait for a writer); the errors of check_regular, and
    BrokenLinkError for a symlink to nowhere (FileNotFoundError: no file there at all).

    A symlink is followed, and what it leads to is judged as the file would be: a regular file is read
    (a data dir's file, or the data dir, may be kept on another disk that way), a FIFO or a device is
    refused, and a symlink to a path that does not exist is a file that cannot be read, never one that
    is not there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        dangling = broken_link(path)
        if dangling is None:
            raise
        raise dangling from None
    try:
        check_regular(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path | str) -> bytes:
    """The bytes of the regular file at `path`: as Path.read_bytes, with open_regular's checks."""
    with open(open_regular(path), "rb") as file:
        return file.read()


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


def parse_json(text: str | bytes) -> Any:
    """json.loads, where JSON nested deeper than Python's parser goes (a state file of 100,000 `[`) is a
    ValueError like any other text that is not JSON: json.loads raises RecursionError for it, which no
    reader's handler of a damaged file took, and a start ended in a traceback instead of naming it."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to be read") from None


def read_json(path: Path, what: str, error: Callable[[str], Exception], remedy: str = "") -> Any:
    """The JSON in `path`, None when there is no such file; `error("PATH: cannot read WHAT: why; REMEDY")`
    raised when it cannot be read or parsed (a start must stop on it and name it, never skip it)."""
    try:
        return parse_json(read_regular(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise error(f"{path}: cannot read {what}: {why}{'; ' + remedy if remedy else ''}") from None
