"""Measured candidates for the cost-model ranking tests: random schedules of a task, timed
single-threaded, with the features of those that ran correctly."""
import random
from functools import lru_cache

from search import Task
from search.features import statement_features
from search.lower import lower
from search.measure import MeasureOptions, ProgramMeasurer
from search.schedule import replay
from search.sketch import generate_sketches, sample_schedules


@lru_cache(maxsize=None)
def _measured(task: Task, n: int, seed: int) -> tuple[tuple, tuple]:
    scheds = sample_schedules(generate_sketches(task.dag), task.dag, n, random.Random(seed))
    m = ProgramMeasurer(task, opts=MeasureOptions(repeats=3, min_time_s=0.002, num_threads=1))
    try:
        recs = m.measure(scheds)
    finally:
        m.close()
    ok = [(s, r.latency_s) for s, r in zip(scheds, recs) if r.ok]
    return tuple(s for s, _ in ok), tuple(x for _, x in ok)


def measured_schedules(task: Task, n: int, seed: int) -> tuple[list, list[float]]:
    """The successful ones among `n` random schedules of `task` and their latencies (measured
    once per test session for each argument set)."""
    scheds, lat = _measured(task, n, seed)
    return list(scheds), list(lat)


def measured_candidates(task: Task, n: int, seed: int) -> tuple[list, list[float]]:
    """Feature lists and latencies of the successful ones among `n` random schedules of `task`."""
    scheds, lat = measured_schedules(task, n, seed)
    return [statement_features(lower(replay(task.dag, s))) for s in scheds], lat
