"""Reading a file an operator names for settings or credentials: the config file, the auth file, token
files, TLS certificates, keys and CAs, the node list. Every one goes through `read_settings_file`.

Such a path is read whole, so it must be a regular file (after following symlinks) of at most
MAX_SETTINGS_FILE_BYTES. Anything else is refused before it is read: a FIFO would block the reader until
something writes to it (on a server's SIGHUP, its whole event loop), and /dev/zero, or a huge file, would
take memory without bound (`--tls-cert /dev/zero` once took 23 GB).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["MAX_SETTINGS_FILE_BYTES", "SettingsFileError", "read_settings_file"]

MAX_SETTINGS_FILE_BYTES = 16 * 1024 * 1024
"""The largest settings file read. Far above any real one (the whole Mozilla CA bundle is about 0.2 MiB,
an auth file of 100,000 principals with a token each about 14 MiB), and small enough that reading and
parsing one stays bounded: a TOML auth file at this size parses in about 4 s into about 350 MB."""

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class SettingsFileError(OSError):
    """A settings file that is not a regular file, or too large. An OSError, whose `strerror` (and
    str()) is the reason alone, as a caller quotes an OSError's: "cannot read X PATH: <reason>"."""

    def __str__(self) -> str:
        return str(self.strerror)


def _not_regular(mode: int) -> SettingsFileError | None:
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a file")
    return SettingsFileError(errno.EINVAL, f"{kind}, not a regular file")


def _too_large(size: str) -> SettingsFileError:
    limit = f"{MAX_SETTINGS_FILE_BYTES // 2**20} MiB"
    return SettingsFileError(errno.EFBIG, f"{size}: over the {limit} a settings file may have")


def read_settings_file(path: str | Path) -> bytes:
    """The bytes of the regular file at `path` (symlinks followed), at most MAX_SETTINGS_FILE_BYTES.

    OSError as reading raises it (FileNotFoundError, PermissionError...), or SettingsFileError for a path
    that is not a regular file (checked before it is opened: a FIFO is never opened) or is larger."""
    error = _not_regular(os.stat(path).st_mode)
    if error is not None:
        raise error
    # not blocking: were it replaced by a FIFO since, opening it must not wait for a writer
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(descriptor)
        error = _not_regular(info.st_mode)
        if error is not None:
            raise error
        if info.st_size > MAX_SETTINGS_FILE_BYTES:
            raise _too_large(f"{info.st_size:,} bytes")
        chunks: list[bytes] = []
        left = MAX_SETTINGS_FILE_BYTES + 1  # a file that grows while read is still cut at the bound
        while left > 0:
            chunk = os.read(descriptor, min(left, 1024 * 1024))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(descriptor)
    data = b"".join(chunks)
    if len(data) > MAX_SETTINGS_FILE_BYTES:
        raise _too_large("it grew while read")
    return data
