"""A streaming query's checkpoint folder as Spark leaves it: the ids of its planned and committed batches.

Read without Spark (`sluice config check` runs without it): `offsets/<id>` is written when a batch is
planned, `commits/<id>` when it is done.
"""

from __future__ import annotations

import contextlib
from pathlib import Path


def last_id(folder: Path) -> int:
    """The highest batch id named in `folder` (a checkpoint's offsets or commits), -1 for none."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return max((int(p.name) for p in folder.iterdir() if p.name.isdigit()), default=-1)
    return -1


def last_commit_id(checkpoint: Path) -> int:
    return last_id(checkpoint / "commits")


def last_planned_id(checkpoint: Path) -> int:
    return last_id(checkpoint / "offsets")
