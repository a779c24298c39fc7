"""Tuning records: one measured (task, schedule) pair, as plain JSON-able data."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TuningRecord:
    """One measurement of one schedule of one task on one target.

    `latencies_s` is empty and `error` is set when the candidate failed to build, crashed,
    timed out or computed a wrong result. `latencies_s` is empty with no `error` and
    `extra["measured"] is False` when the kernel ran and matched the reference but was not
    timed (a Pallas kernel in interpret mode, on a machine without a GPU): `unmeasured`. Such a
    record is not `ok`, so nothing ranks it by latency (the database stores no latency for it).
    `target` describes the machine (CPU model, ISA flags, compiler version; or GPU and
    backend); `target_key` is its stable short key.
    """

    workload_key: str
    task: dict[str, Any]
    target_key: str
    target: dict[str, Any]
    schedule: list[dict[str, Any]]  # replayable transform steps
    latencies_s: tuple[float, ...] = ()
    error: str | None = None
    timestamp: float = 0.0
    tuning_time_s: float = 0.0
    library_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and len(self.latencies_s) > 0

    @property
    def unmeasured(self) -> bool:
        """Checked against the reference but not timed: a correct kernel without a latency."""
        return self.error is None and not self.latencies_s and self.extra.get("measured") is False

    @property
    def latency_s(self) -> float:
        """Median measured latency; +inf for failed records."""
        if not self.ok:
            return float("inf")
        xs = sorted(self.latencies_s)
        return xs[len(xs) // 2]

    def to_json(self) -> str:
        d = asdict(self)
        d["latencies_s"] = list(self.latencies_s)
        return json.dumps(d, sort_keys=True)

    @staticmethod
    def from_json(s: str) -> "TuningRecord":
        d = json.loads(s)
        d["latencies_s"] = tuple(d.get("latencies_s", ()))
        return TuningRecord(**d)
