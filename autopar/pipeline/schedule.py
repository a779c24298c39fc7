"""Pipeline schedules (GPipe, 1F1B) as per-stage task orders, and their timing.

A schedule is, for each stage, the order in which it runs forward (F) and backward (B)
passes of micro-batches. `simulate` turns the orders plus per-stage costs into start and
end times (used for the Gantt chart, and to issue tasks from Python in a valid order).

With token slices (TeraPipe) the work items are (micro-batch, slice) pairs: forwards in
slice order, and a micro-batch's backwards in reverse slice order (a slice's backward
returns the cotangents of the keys and values its earlier slices lent it as context).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Task:
    """Forward ("F") or backward ("B") pass of one micro-batch (or one token slice of it)
    on one stage."""

    stage: int
    kind: str
    micro_batch: int
    slice: int = 0

    @property
    def item(self) -> tuple[int, int]:
        return self.micro_batch, self.slice


@dataclass(frozen=True)
class TimedTask:
    """A task with its predicted start and end time."""

    task: Task
    start_s: float
    end_s: float


def stage_orders(schedule: str, num_stages: int, num_micro_batches: int,
                 slices: Sequence[int] | None = None) -> list[list[Task]]:
    """Per-stage task order: GPipe (all forwards, then all backwards) or 1F1B
    (PipeDream-flush: S-s-1 warm-up forwards, then alternate one forward, one backward).
    `slices`: token slices per micro-batch (default 1 each). Over slices, 1F1B warms up
    with at least a micro-batch's slices but one, so that each backward's forward has run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of {SCHEDULES}")
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError("need at least one stage and one micro-batch")
    slices = [1] * num_micro_batches if slices is None else list(slices)
    if len(slices) != num_micro_batches or min(slices) < 1:
        raise ValueError(f"slices must give a positive count per micro-batch, got {slices}")
    S, N = num_stages, sum(slices)
    orders = []
    for s in range(S):
        F = [Task(s, "F", m, i) for m in range(num_micro_batches) for i in range(slices[m])]
        Bk = [Task(s, "B", m, i) for m in range(num_micro_batches) for i in reversed(range(slices[m]))]
        if schedule == "gpipe":
            orders.append(F + Bk)
            continue
        warm = min(max(S - s - 1, max(slices) - 1), N)
        order = F[:warm]
        for i in range(N - warm):
            order += [F[warm + i], Bk[i]]
        orders.append(order + Bk[N - warm:])
    return orders


def simulate(orders: Sequence[Sequence[Task]], forward_s: Sequence[Any],
             backward_s: Sequence[Any]) -> list[TimedTask]:
    """Start/end times: each stage runs its tasks in order; F(s, m) waits for F(s-1, m),
    B(s, m) waits for B(s+1, m) and F(s, m). forward_s[s] / backward_s[s]: a stage's time
    per task, or a function of the task's (micro-batch, slice)."""
    S = len(orders)
    done: dict[tuple[int, str, int, int], float] = {}
    pos = [0] * S
    free_s = [0.0] * S
    out: list[TimedTask] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(S):
            if pos[s] == len(orders[s]):
                continue
            t = orders[s][pos[s]]
            m, i = t.item
            if t.kind == "F":
                deps = [(s - 1, "F", m, i)] if s > 0 else []
            else:
                deps = [(s, "F", m, i)] + ([(s + 1, "B", m, i)] if s < S - 1 else [])
            if any(d not in done for d in deps):
                continue
            start = max([free_s[s]] + [done[d] for d in deps])
            cost = forward_s[s] if t.kind == "F" else backward_s[s]
            end = start + (cost(m, i) if callable(cost) else cost)
            done[(s, t.kind, m, i)] = end
            free_s[s] = end
            out.append(TimedTask(t, start, end))
            pos[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise ValueError("the pipeline schedule deadlocks: a task waits on one that never runs")
    return out


def issue_order(orders: Sequence[Sequence[Task]]) -> list[Task]:
    """All tasks in an order that respects every dependency (by simulated start time with
    unit costs), for issuing them from one Python thread."""
    S = len(orders)
    timed = simulate(orders, [1.0] * S, [2.0] * S)
    timed.sort(key=lambda t: (t.start_s, t.task.stage))
    return [t.task for t in timed]


def peak_in_flight(order: Sequence[Task]) -> int:
    """Most work items whose forward has run but backward has not, on one stage."""
    live = peak = 0
    for t in order:
        live += 1 if t.kind == "F" else -1
        peak = max(peak, live)
    return peak


def pipeline_latency_s(stage_s: Sequence[float], num_micro_batches: int) -> float:
    """Alpa's pipeline latency: sum of stage times + (B - 1) * slowest stage."""
    return float(sum(stage_s) + (num_micro_batches - 1) * max(stage_s))
