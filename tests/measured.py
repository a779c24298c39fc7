"""Measured candidates for the cost-model ranking tests: random schedules of a task, timed
single-threaded, with the features of those that ran correctly."""
import random

from search import Task
from search.features import statement_features
from search.lower import lower
from search.measure import MeasureOptions, ProgramMeasurer
from search.schedule import replay
from search.sketch import generate_sketches, sample_schedules


def measured_candidates(task: Task, n: int, seed: int) -> tuple[list, list[float]]:
    """Feature lists and latencies of the successful ones among `n` random schedules of `task`."""
    scheds = sample_schedules(generate_sketches(task.dag), task.dag, n, random.Random(seed))
    m = ProgramMeasurer(task, opts=MeasureOptions(repeats=3, min_time_s=0.002, num_threads=1))
    try:
        recs = m.measure(scheds)
    finally:
        m.close()
    ok = [(s, r.latency_s) for s, r in zip(scheds, recs) if r.ok]
    return [statement_features(lower(replay(task.dag, s))) for s, _ in ok], [x for _, x in ok]
