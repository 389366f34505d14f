"""`sluice push`'s input: lines of a file or stdin, read in chunks, as buffers and offsets.

Each chunk's lines go to the Producer as one buffer (send_packed), never as an object per line: the
newlines are found and taken out in C (numpy, bytes.replace), so a push costs the same per byte
whatever its lines' length, and a line longer than a chunk is joined once, when its end is read.
A line is everything up to a newline (b"\\n"), which is not part of it; a carriage return before it is;
a last line without a newline is a record too. With a key separator (`sluice push --key-separator`) a
line is cut at the separator's first occurrence into key and value, again for the whole chunk at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, slots=True)
class Lines:
    """Lines of the input in send_packed's layout: line i is data[offsets[i]:offsets[i + 1]], without
    its newline. No Python object per line: the push costs the same per byte whatever the line length."""

    data: bytes
    offsets: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def after(self, k: int) -> Lines:
        return Lines(self.data, self.offsets[k:])

    @classmethod
    def cut(cls, text: bytes) -> tuple[Lines, bytes]:
        """The complete lines of `text` (each ended by a newline), and the rest after the last newline."""
        ends = np.flatnonzero(np.frombuffer(text, np.uint8) == _NEWLINE)
        if not len(ends):
            return _NO_LINES, text
        offsets = np.zeros(len(ends) + 1, np.int64)
        # the newlines taken out: line i ends before newline i, less the i newlines before it
        offsets[1:] = ends - np.arange(len(ends))
        end = int(ends[-1]) + 1  # the rest after it is left out: it stays in the carry
        body = text if end == len(text) else text[:end]
        return cls(body.replace(b"\n", b""), offsets), text[end:]

    def keyed(self, separator: bytes) -> KeyedLines:
        """Each line cut at the first `separator` in it: the key before, the value after (either may be
        empty); a line without one is all value, without a key."""
        data = np.frombuffer(self.data, np.uint8)
        starts, ends = self.offsets[:-1], self.offsets[1:]
        width = len(separator)
        hits = np.ones(max(len(data) - width + 1, 0), dtype=bool)  # where the separator starts
        for j, byte in enumerate(separator):
            hits &= data[j : len(data) - width + 1 + j] == byte
        found = np.flatnonzero(hits)
        # each line's first hit at or after its start; one that runs past the line's end belongs to no
        # line (lines are back to back), and no later hit could lie within that line either
        at = np.searchsorted(found, starts)
        first = np.append(found, len(data))[at]
        has_key = first + width <= ends
        key_ends = np.where(has_key, first, starts)
        value_starts = np.where(has_key, first + width, starts)
        return KeyedLines(
            _gather(data, value_starts, ends),
            _offsets(ends - value_starts),
            _gather(data, starts, key_ends),
            _offsets(key_ends - starts),
            has_key,
        )


@dataclass(frozen=True, slots=True)
class KeyedLines:
    """Lines cut into keys and values, in send_packed's layout (key_validity False: no key)."""

    values: bytes
    value_offsets: npt.NDArray[np.int64]
    keys: bytes
    key_offsets: npt.NDArray[np.int64]
    key_validity: npt.NDArray[np.bool_]


def _gather(data: npt.NDArray[np.uint8], starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]) -> bytes:
    """The bytes of data[starts[i]:ends[i]] for every i, back to back (the ranges are in order, apart).
    Indexed by the positions of whichever is smaller, the bytes kept or the gaps between them (keys are
    short, values long): numpy's cost is per index, so this keeps both near a copy. Where both are long
    (a line joined from many chunks), a slice per range costs less, and no index array is built."""
    lengths = ends - starts
    kept = int(lengths.sum())
    gaps = len(data) - kept if len(starts) > 1 else len(data)  # (one range has no gaps to index)
    if len(starts) * _SLICE_BYTES <= min(kept, gaps):
        view = memoryview(data.data)  # ndarray.data: the buffer itself
        return b"".join([view[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)])
    if kept <= gaps:
        return data[_positions(starts, lengths, kept)].tobytes()
    low, high = int(starts[0]), int(ends[-1])
    gap_lengths = starts[1:] - ends[:-1]
    keep = np.ones(high - low, np.bool_)
    keep[_positions(ends[:-1] - low, gap_lengths, len(keep) - kept)] = False
    return data[low:high][keep].tobytes()


_SLICE_BYTES = 128
"""Bytes an index per byte costs about as much as one slice (a Python object) does."""


def _positions(
    starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], total: int
) -> npt.NDArray[np.int64]:
    """Every position within the ranges (starts[i], lengths[i]), in order: each byte's range start,
    shifted by the bytes of the ranges before it, plus its place in the whole."""
    shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return shift + np.arange(total, dtype=np.int64)


def _offsets(lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _seekable(source: IO[bytes]) -> bool:
    try:
        return source.seekable()
    except (OSError, ValueError):
        return False


def _fileno(source: IO[bytes]) -> int | None:
    try:
        return source.fileno()
    except (OSError, ValueError, AttributeError):  # no descriptor (a BytesIO), or closed
        return None


async def _off_loop(read: Callable[[int], bytes], size: int) -> bytes:
    """read(size) on a daemon thread of its own: a read that never returns (a pipe whose writer lives on
    and sends nothing) must not hold up the exit after a SIGTERM or Ctrl-C, as asyncio.to_thread's
    executor thread did (asyncio.run joins it: the push said how far it got, then hung)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bytes] = loop.create_future()

    def settle(chunk: bytes, error: BaseException | None) -> None:
        if done.done():  # cancelled meanwhile
            return
        if error is None:
            done.set_result(chunk)
        else:
            done.set_exception(error)

    def work() -> None:
        chunk, error = b"", None
        try:
            chunk = read(size)
        except BaseException as exc:  # noqa: BLE001 - raised where it is awaited
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: no one waits for it
            loop.call_soon_threadsafe(settle, chunk, error)

    threading.Thread(target=work, name="sluice-push-read", daemon=True).start()
    return await done


def _read_when_ready(fd: int, size: int) -> bytes:
    """Up to `size` bytes of the descriptor `fd` (a pipe's), once there are any, also when it is
    non-blocking; b"" at its end."""
    while True:
        try:
            return os.read(fd, size)
        except BlockingIOError:
            select.select([fd], [], [])


_NEWLINE = ord("\n")
_NO_LINES = Lines(b"", np.zeros(1, np.int64))


class LineTooLongError(ValueError):
    """A line grew past `InputLines.max_line` bytes before its end was read: no record can carry it.
    `size`: its bytes read so far."""

    def __init__(self, size: int) -> None:
        super().__init__(f"a line of over {size:,} bytes")
        self.size = size


class InputLines:
    """The input's lines (records), read in chunks; skip() passes over those an earlier push sent."""

    CHUNK_BYTES = 1 << 20

    def __init__(self, source: IO[bytes]) -> None:
        self.source = source
        # a pipe (`tail -f log | sluice push -`): what has arrived, not a whole chunk, which waited for
        # 1 MiB or the end (nothing sent, nothing acked meanwhile); a file: whole chunks
        read1: Callable[[int], bytes] | None = getattr(source, "read1", None)
        self._read_chunk: Callable[[int], bytes] = source.read
        if read1 is not None and not _seekable(source):
            self._read_chunk = read1
        fd = _fileno(source)
        if fd is not None and not _seekable(source):
            # a pipe's descriptor, read as it is (nothing was read from the buffered file yet): a read
            # blocked there holds no lock of the file's that the exit would wait for, and a stdin left
            # non-blocking is waited for (read1 answered b"" when no data was there yet, taken for the
            # end of the input: the rest never sent, the push "all acked")
            self._read_chunk = functools.partial(_read_when_ready, fd)
        self.done_bytes = 0
        self.records = 0  # handed on by next_lines
        self.skipped = 0
        # a line's start, read without its end (in pieces: a long line is joined once, when it ends);
        # None at the end of the input
        self._carry: list[bytes] | None = []
        self._carry_bytes = 0
        self._pending: Lines | None = None
        self.max_line: int | None = None
        """A line that grows past this many bytes without its end raises LineTooLongError: the
        carry held all of it, and an input without newlines (/dev/zero, a binary file) grew the push
        by gigabytes until it was killed."""

    @property
    def ended(self) -> bool:
        """The whole input was read: `records` is its count once the last lines are handed on."""
        return self._carry is None and self._pending is None

    async def skip(self, n: int) -> bool:
        """Pass over the first `n` records; False when the input has fewer."""
        while self.skipped < n:
            lines = self._pending if self._pending is not None else await self._read()
            self._pending = None
            if lines is None:
                return False
            k = min(n - self.skipped, len(lines))
            self.skipped += k
            if k < len(lines):
                self._pending = lines.after(k)
        return True

    async def next_lines(self) -> Lines | None:
        """The next lines to send (possibly none); None at the end of the input."""
        lines, self._pending = self._pending, None
        if lines is None:
            lines = await self._read()
            if lines is None:
                return None
        self.records += len(lines)
        return lines

    async def _read(self) -> Lines | None:
        if self._carry is None:
            return None
        chunk = await _off_loop(self._read_chunk, self.CHUNK_BYTES)
        self.done_bytes += len(chunk)
        if not chunk:
            last = b"".join(self._carry)
            self._carry = None
            # a last line without a newline is a record too
            return Lines.cut(last + b"\n")[0] if last else _NO_LINES
        if _NEWLINE not in chunk:
            self._carry.append(chunk)
            self._carry_bytes += len(chunk)
            if self.max_line is not None and self._carry_bytes > self.max_line:
                raise LineTooLongError(self._carry_bytes)
            return _NO_LINES
        lines, rest = Lines.cut(b"".join([*self._carry, chunk]) if self._carry else chunk)
        self._carry = [rest] if rest else []
        self._carry_bytes = len(rest)
        return lines
