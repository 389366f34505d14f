"""The streams a node serves, and what became of those an operator removed (Admin.AddStream/RemoveStream).

A stream is "serving" (a receiver takes records), "draining" (removed: no intake, the query still reads
what was acked, then it is "removed"), "kept" (removed: the query stops reading it now, its unprocessed
blocks stay in the log, and adding it back resumes where the query stopped) or "removed" (gone; its
blocks released). The query reads serving and draining streams (RateStatus.pipeline_streams).

Once a change was made, DATA_DIR/streams.json holds every stream's state and overrides the command
line's `--stream` list at the next start, as runtime-config.json does for settings: a stream removed at
run time stays removed after a restart even when the command line still names it. A stream the command
line names that the file does not know is served (the operator added a flag).

A stream neither names whose folder in the block log still holds acked records no query released (it
was dropped from the `--stream` flags, say) is found at start (`found`): a WARNING names it, and it is
listed as kept for the run, so `sluice streams list`, the status page and `sluice_streams` show it and its
backlog, and `sluice streams add` brings it back where the query stopped. It is not written to the file:
named by the flags again at the next start, it is served.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from receivers.files import DataDirStateError, present, read_json, replace_json
from receivers.names import check_stream_name, same_but_case

log = logging.getLogger(__name__)

FILE = "streams.json"

SERVING, DRAINING, KEPT, REMOVED = "serving", "draining", "kept", "removed"
STATES = (SERVING, DRAINING, KEPT, REMOVED)


class StreamStateError(ValueError, DataDirStateError):
    """The streams file is unreadable or not one: the start stops, naming it."""


class StreamNameClashError(ValueError):
    """A stream new to the data dir whose name differs from another stream's only in letter case."""


def clash_message(stream: str, other: str, where: str) -> str:
    """Why `stream` is refused beside `other` (`where`: what `other` is, said in parentheses)."""
    return (
        f"stream {stream!r} differs from stream {other!r} ({where}) only in letter case: each stream has "
        "a folder in the data dir, and on a case-insensitive file system (macOS, Windows) the two would "
        "be one; name it otherwise"
    )


class StreamRegistry:
    """Stream -> state, persisted atomically on every change once one was made.

    `folders`: the streams with a folder in the block log. A stream the command line names that is new
    to the data dir (neither the file nor a folder has it) and whose name differs from another's only
    in letter case (`a` and `A`: one folder on a case-insensitive file system) is refused,
    StreamNameClashError naming both; two such streams the data dir holds already (made by an earlier
    version, on a case-sensitive file system) are served as before."""

    def __init__(self, data_dir: Path, command_line: Sequence[str], folders: Iterable[str] = ()) -> None:
        self.path = data_dir / FILE
        self.states: dict[str, str] = dict.fromkeys(command_line, SERVING)
        self.found: set[str] = set()
        """Streams neither the command line nor the file names, with acked records in the log that no
        query released: kept for this run (found), never written to the file."""
        self._saved: list[str] = []
        """The streams the file names (this data dir's before this start, with `folders`)."""
        self.overridden: dict[str, str] = {}
        """Streams the command line names that the file holds in another state than serving (removed
        at run time): stream -> that state. The server says so once at its start (a check of the
        settings reads the file too, and said it as well: every start logged it twice)."""
        self._load(command_line)
        held = sorted({*self._saved, *folders})
        for stream in command_line:
            if stream in held:
                continue  # the data dir's own, whatever else it holds
            other = same_but_case(stream, held)
            if other is not None:
                raise StreamNameClashError(clash_message(stream, other, "in this data dir already"))
            other = same_but_case(stream, command_line)  # both new: `--stream a --stream A`
            if other is not None:
                raise StreamNameClashError(clash_message(stream, other, "also among the streams to serve"))

    def case_clash(self, stream: str, folders: Iterable[str]) -> str | None:
        """For `stream`, if it is new to this data dir (neither listed here nor among `folders`, those
        of the block log): the stream listed or with a folder whose name differs from its only in
        letter case; else None (a stream the data dir holds is its own, whatever else it holds)."""
        folders = list(folders)
        if stream in self.states or stream in folders:
            return None
        return same_but_case(stream, [*self.states, *folders])

    def _load(self, command_line: Sequence[str]) -> None:
        if not present(self.path):  # a symlink to nowhere is a file that cannot be read (read_json)
            return  # (`null` in the file is not "no file": it is refused below)
        data = read_json(
            self.path,
            "the stream states",
            StreamStateError,
            "restore it, or delete it to serve the --stream flags' streams (streams added at run time are "
            "then no longer served)",
        )
        states = data.get("streams") if isinstance(data, dict) else None
        if not isinstance(states, dict) or not all(
            isinstance(k, str) and v in STATES for k, v in states.items()
        ):
            raise StreamStateError(
                f"{self.path}: not a stream states file ({{'streams': {{name: state}}}}); delete it to "
                "serve the --stream flags' streams (streams added at run time are then no longer served)"
            )
        if not states:
            # never written so: the file keeps every stream's state once one changed, removed ones too
            raise StreamStateError(
                f"{self.path}: names no stream, which Sluice never writes (it keeps every stream's "
                "state there once one changed, removed ones too); delete it to serve the --stream flags' "
                "streams (streams added at run time are then no longer served)"
            )
        try:
            loaded = {check_stream_name(k): v for k, v in states.items()}
        except ValueError as exc:
            raise StreamStateError(f"{self.path}: {exc}") from None
        self.overridden = {s: loaded[s] for s in command_line if loaded.get(s, SERVING) != SERVING}
        self._saved = list(loaded)
        self.states = {**dict.fromkeys(command_line, SERVING), **loaded}
        for stream in command_line:
            if stream not in loaded:
                self.states[stream] = SERVING

    def find(self, stream: str) -> None:
        """`stream` holds acked records no query released, and neither the command line nor the file
        names it: kept for this run (listed, its backlog shown; `streams add` serves it again)."""
        self.states[stream] = KEPT
        self.found.add(stream)

    def of(self, state: str) -> list[str]:
        return [s for s, st in self.states.items() if st == state]

    @property
    def serving(self) -> list[str]:
        return self.of(SERVING)

    @property
    def read_by_query(self) -> list[str]:
        """What the query reads now: serving and draining streams."""
        return [s for s, st in self.states.items() if st in (SERVING, DRAINING)]

    def known(self) -> list[str]:
        """Every stream ever served here (a query's offsets may name any of them)."""
        return list(self.states)

    def set(self, changes: Iterable[tuple[str, str]]) -> None:
        """Persist the new states first, then keep them (OSError: nothing changes)."""
        states = dict(self.states)
        found = set(self.found)
        for stream, state in changes:
            assert state in STATES, state
            states[stream] = state
            found.discard(stream)  # changed by an operator: kept from now on like any other
        replace_json(self.path, {"streams": {s: st for s, st in states.items() if s not in found}})
        self.states, self.found = states, found
