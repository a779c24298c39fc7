"""Is a tuning record usable by this autopar? Pure checks that return the problem as text (or
None), shared by the tuning database's writes, imports and reads."""
from __future__ import annotations

import math
from typing import Any

from .record import TuningRecord
from .schedule import schedule_problem

_FIELD_TYPES: dict[str, Any] = {
    "task": dict, "target_key": str, "target": dict, "schedule": (list, tuple),
    "latencies_s": (list, tuple), "error": (str, type(None)), "library_version": str, "extra": dict,
}


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def field_type_problem(record: Any) -> str | None:
    """Which field of `record` has the wrong type (the record cannot be stored as it is), or None."""
    if not isinstance(record, TuningRecord):
        return f"expected a TuningRecord, got {type(record).__name__}"
    name = record.workload_key
    if not isinstance(name, str) or not name:
        return f"workload_key must be a non-empty string, got {name!r}"
    for field, kind in _FIELD_TYPES.items():
        value = getattr(record, field)
        if not isinstance(value, kind):
            return f"record {name!r}: {field} has type {type(value).__name__}"
    for field in ("timestamp", "tuning_time_s"):
        value = getattr(record, field)
        if not _is_number(value) or not math.isfinite(value):
            return f"record {name!r}: {field} must be a finite number, got {value!r}"
    return None


def content_problem(record: TuningRecord) -> str | None:
    """Why a well-typed record would mislead or crash a reader (a schedule step this version
    does not know or that is malformed, latencies that are not positive finite seconds), or None."""
    problem = schedule_problem(list(record.schedule))
    if problem:
        return problem
    for x in record.latencies_s:
        if not _is_number(x) or not math.isfinite(x) or x <= 0:
            return (f"latencies_s must be positive finite seconds, got {x!r}; a failed measurement "
                    "has error=... and no latencies")
    return None


def record_problem(record: Any) -> str | None:
    """Why `record` is not a usable tuning record, or None."""
    return field_type_problem(record) or content_problem(record)
