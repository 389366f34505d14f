"""Stream names: what may name a stream (a stream's name becomes a folder name in the block store)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

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


def same_but_case(name: str, others: Iterable[str]) -> str | None:
    """The first of `others` that differs from `name` in letter case alone ("a" and "A"), or None. Each
    stream has a folder in the data dir, and a case-insensitive file system (macOS's and Windows' by
    default) makes the two names one folder: two streams' records in one log."""
    folded = name.casefold()
    return next((other for other in others if other != name and other.casefold() == folded), None)


def stream_folders(root: Path) -> list[str]:
    """The streams with a folder under `root` (a block store's), spelt as the folders are, sorted;
    entries that are not folders, or whose name is not a stream's, are left out."""
    names = []
    try:
        entries = [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    for entry in entries:
        if _STREAM_NAME.match(entry.name):
            names.append(entry.name)
    return sorted(names)
