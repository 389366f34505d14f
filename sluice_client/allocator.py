"""glibc malloc settings for a process that moves large messages (the SDK's and the server's).

A Batch of a few thousand records is a few hundred KiB. glibc serves allocations that large with a fresh
mmap and returns them with munmap, so every such buffer (protobuf serializing or parsing a message, gRPC
handing it over) costs a page fault per 4 KiB: serializing a 400 KiB message took 330 us this way and
11 us from the heap, and that was most of a producer's CPU per record. tune_malloc() keeps buffers up to
32 MiB on the heap and lets up to 64 MiB of free heap stay mapped, so they are reused.

The SDK's Producer and the server call it at start. Set SLUICE_MALLOC_TUNING=0 to leave malloc alone (the
process then pays those page faults); other C libraries (musl) are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024
"""The largest value glibc takes on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)."""
TRIM_THRESHOLD = 64 * 1024 * 1024

_tuned: bool | None = None


def tune_malloc() -> bool:
    """Apply the settings once per process; True if glibc took them."""
    global _tuned  # noqa: PLW0603 - once per process, like the allocator it sets
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get("SLUICE_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt in this C library
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
    return _tuned
