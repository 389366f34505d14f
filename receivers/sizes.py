"""Byte counts as people write them: 1048576, 512MiB, 2 GiB, 100MB."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*([0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE | re.ASCII)  # ASCII digits
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_MAX_DIGITS = 100
"""More digits than any size a setting takes (each has a bound far below 10**100)."""


def parse_size(text: str) -> int:
    """A byte count: plain bytes ("1048576") or with a unit: B, KB/MB/GB/TB (powers of 1000) or
    KiB/MiB/GiB/TiB (powers of 1024), case-insensitive ("512MiB", "2 GiB", "100MB"). ValueError if not."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: use bytes or a number with B, KB, MB, GB, TB (x1000) or KiB, MiB, "
            "GiB, TiB (x1024), e.g. 512MiB"
        )
    digits = match.group(1).lstrip("0")
    if len(digits) > _MAX_DIGITS:  # int() refuses past 4,300 digits, telling of sys.set_int_max_str_digits()
        raise ValueError(f"a size of {len(digits):,} digits is out of range")
    return int(match.group(1)) * _UNITS[unit]
