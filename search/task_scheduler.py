"""Ansor's task scheduler: spread one trial budget over several tasks, giving the next batch
to the task whose tuning is expected to shrink the weighted total latency the most."""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from cost_model import XGBoostCostModel

from .measure import MeasureOptions, best_run_s, check_fits_in_memory
from .record import TuningRecord
from .schedule import Step
from .task import Task
from .tune import TuneResult, _check_target, chosen_record, make_measurer, make_policy, measure_into, open_db


@dataclass(frozen=True)
class TaskProgress:
    """What the scheduler knows about one task: its weight, FLOPs, trials and best-so-far curve."""

    weight: float
    flops: int
    trials: int
    best_history_s: tuple[float, ...]  # best latency after each of its rounds
    op: str


def task_gradient(i: int, tasks: Sequence[TaskProgress], alpha: float = 0.2, beta: float = 2.0,
                  window: int = 3) -> float:
    """d(weighted total latency)/d(trials of task i), Ansor's estimate (negative = worth tuning):
    alpha * recent slope + (1 - alpha) * optimistic slope, where the optimistic slope is the
    smaller of -g/t (more trials keep paying at the average rate) and the gap to beta times
    the best throughput seen on tasks of the same operator."""
    t = tasks[i]
    g = t.best_history_s[-1] if t.best_history_s else math.inf
    if not math.isfinite(g) or t.trials == 0:
        return -math.inf  # untuned tasks first
    hist = t.best_history_s
    if len(hist) > window:
        per_round = t.trials / len(hist)
        backward = (hist[-1] - hist[-1 - window]) / (window * per_round)
    else:
        backward = -g / t.trials
    similar = [s.flops / s.best_history_s[-1] for s in tasks
               if s.op == t.op and s.best_history_s and math.isfinite(s.best_history_s[-1])]
    v_best = max(similar, default=t.flops / g)
    forward = min(-g / t.trials, beta * t.flops / v_best - g)
    return t.weight * (alpha * backward + (1 - alpha) * forward)


def tune_tasks(tasks: Sequence[Task], trials: int, weights: Sequence[float] | None = None, db: Any = None,
               target: str = "cpu", policy: str = "evolutionary", batch_size: int = 16, seed: int = 0,
               eps: float = 0.05, measure_options: MeasureOptions | None = None,
               callback: Callable[[dict[str, TuneResult]], None] | None = None,
               transfer: bool = True) -> dict[str, TuneResult]:
    """Tune several tasks with one budget of `trials`; weights are how often each runs. The
    evolutionary policies share one cost model (one ranking group per task), as in Ansor; with
    `transfer` it is first trained on the DB's records of tasks outside this job."""
    _check_target(target)
    if not tasks:
        raise ValueError("tune_tasks: no tasks given")
    weights = list(weights) if weights is not None else [1.0] * len(tasks)
    if len(weights) != len(tasks):
        raise ValueError(f"tune_tasks: {len(weights)} weights for {len(tasks)} tasks")
    rng = random.Random(seed)
    for t in tasks:
        check_fits_in_memory(t)
    database, owned = open_db(db)
    measurers = [make_measurer(t, target, measure_options) for t in tasks]
    shared = {"cost_model": XGBoostCostModel(seed=seed)} if policy == "evolutionary" else {}
    policies = [make_policy(policy, t, seed, target, **shared) for t in tasks]
    if transfer and shared:
        keys = {t.workload_key for t in tasks}
        others = [r for r in database.records(target_key=measurers[0].target_key) if r.workload_key not in keys]
        policies[0].learn_from(others)
    records: list[list[TuningRecord]] = [[] for _ in tasks]
    best: list[tuple[float, list[Step] | None]] = [(math.inf, None) for _ in tasks]
    curves: list[list[float]] = [[] for _ in tasks]
    hist: list[list[tuple[int, float, float]]] = [[] for _ in tasks]
    t0 = time.perf_counter()
    used = 0

    def results() -> dict[str, TuneResult]:
        def schedule(i: int) -> list[Step] | None:  # an unmeasured one when nothing was timed
            chosen = chosen_record(records[i])
            return best[i][1] if best[i][1] is not None else chosen.schedule if chosen else None

        return {t.workload_key: TuneResult(t, schedule(i), best[i][0], list(records[i]),
                                           time.perf_counter() - t0, list(hist[i])) for i, t in enumerate(tasks)}

    try:
        while used < trials:
            progress = [TaskProgress(w, t.flops, len(r), tuple(c), t.op)
                        for w, t, r, c in zip(weights, tasks, records, curves)]
            if rng.random() < eps:
                i = rng.randrange(len(tasks))
            else:
                grads = [task_gradient(k, progress) for k in range(len(tasks))]
                # ties (untuned tasks, or nothing timed: Pallas in interpret mode) go to the fewest trials
                i = min(range(len(tasks)), key=lambda k: (grads[k], len(records[k])))
            batch = policies[i].next_batch(min(batch_size, trials - used))
            if not batch:
                break
            recs = measure_into(database, measurers[i], batch, records[i])
            policies[i].update(batch, recs)
            used += len(recs)
            for r in recs:
                if best_run_s(r) < best[i][0]:
                    best[i] = (best_run_s(r), r.schedule)
            curves[i].append(best[i][0])
            hist[i].append((len(records[i]), best[i][0], time.perf_counter() - t0))
            if callback is not None:
                callback(results())
    finally:
        for m in measurers:
            m.close()
        if owned:
            database.close()
    return results()
