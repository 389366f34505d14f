"""Stream names: what may name a stream (a stream's name becomes a folder name in the block store)."""

from __future__ import annotations

import re

_STREAM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class InvalidStreamNameError(ValueError):
    """A stream name that cannot name a stream (it becomes a folder name)."""


def check_stream_name(name: str) -> str:
    """Return `name` if it is a valid stream name, else raise InvalidStreamNameError."""
    if not _STREAM_NAME.match(name):
        raise InvalidStreamNameError(
            f"invalid stream name {name!r}: 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name
