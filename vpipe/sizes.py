"""Byte sizes as users type them, read one way everywhere (``vpipe train``, ``vpipe plan``, the config).

Decimal units are powers of 1000 and binary units powers of 1024, as their names say:
``16e9``, ``16GB`` and ``16G`` are 16 * 10**9 bytes; ``15GiB`` and ``15Gi`` are 15 * 2**30.
Case does not matter (``64mb`` = ``64MB``); a bare number is bytes.
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_bytes", "MAX_BYTES"]

MAX_BYTES = 1 << 62  # far beyond any machine: a larger figure is a typo, not a budget
_UNITS = {"": 1, "b": 1}
for _i, _prefix in enumerate("kmgtp", start=1):
    _UNITS[_prefix] = _UNITS[_prefix + "b"] = 1000 ** _i
    _UNITS[_prefix + "i"] = _UNITS[_prefix + "ib"] = 1024 ** _i
_SIZE = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)$")


def parse_bytes(text: str, *, what: str = "size") -> int:
    """``text`` as a positive whole number of bytes, or ``ValueError`` with one line that says why."""
    raw = str(text).strip()
    if raw.startswith("-"):
        raise ValueError(f"{what} {raw!r} must not be negative")
    match = _SIZE.match(raw)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{what} {raw!r} is not a byte size (examples: 16000000000, 16e9, 16GB, 15GiB, 512M)"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise ValueError(f"{what} {raw!r} is larger than any machine ({MAX_BYTES} bytes at most)")
    if value < 1:
        raise ValueError(f"{what} {raw!r} must be at least 1 byte")
    if match.group(2).lower() in ("", "b") and value != int(value):
        raise ValueError(f"{what} {raw!r} is not a whole number of bytes (a unit such as 1.5GB or 1.5GiB may "
                         "take a fraction)")
    return int(value)
