"""Sizes in bytes, as people write them (``"24GiB"``) and as messages show them.

One parser for every place a size is given (`RunConfig.memory_budget`, the CLI's memory limit),
so the same spelling means the same bytes everywhere. Plain functions, no torch.
"""

from __future__ import annotations

import math
import re

from roundpipe.errors import ConfigError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"kB": 10**3, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = re.compile(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(value: int | str, what: str = "memory budget") -> int:
    """``"24GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1.5e9"``, ``"1000"`` or an int -> bytes (> 0).

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of
    1000; the unit is case-sensitive so that ``Gb`` (gigabits) is never read as gigabytes.
    """
    hint = "use e.g. '24GiB', '512MiB' or a number of bytes"
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{what} {value!r} is not understood; {hint}")
    if isinstance(value, int):
        number: float = value
    else:
        match = _SIZE.fullmatch(value)
        if match is None or match.group(2) not in _UNITS:
            raise ConfigError(f"{what} {value!r} is not understood; {hint}")
        number = float(match.group(1)) * _UNITS[match.group(2)]
    if not math.isfinite(number) or number < 1:
        raise ConfigError(f"{what} {value!r} must be at least one byte; {hint}")
    return int(number)


def format_bytes(n: int | float) -> str:
    """``25769803776`` -> ``"24.00 GiB"``; below 1 KiB the plain count (``"17 B"``)."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
