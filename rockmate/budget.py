"""Memory budgets given as bytes or as strings like "200MB" / "1.5GiB"."""
from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(budget: int | float | str) -> int:
    """Bytes from an int/float or a string with a unit (KB/MB/GB decimal, KiB/MiB/GiB binary)."""
    if isinstance(budget, bool):
        raise TypeError("memory budget must be a number of bytes or a string like '200MB', not a bool")
    if isinstance(budget, (int, float)):
        if budget <= 0:
            raise ValueError(f"memory budget must be positive, got {budget!r}")
        return int(budget)
    if not isinstance(budget, str):
        raise TypeError(f"memory budget must be bytes (int) or a string like '200MB', got {type(budget).__name__}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory budget {budget!r}; write e.g. '200MB', '1.5GiB' or 123456")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"memory budget must be positive, got {budget!r}")
    return int(value)
