"""Measurement of Pallas candidates, in this process: compile each (jit of its kernels), check
its output against the task's float64 numpy reference, and time it when the backend runs on a
GPU. In interpret mode a candidate that matches gets a record with no latency and
`extra["measured"] = False` (TuningRecord.unmeasured): checked, never ranked by latency."""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from .backend_pallas import PallasBackend
from .measure import VERSION, MeasureOptions
from .record import TuningRecord
from .runner_process import check_output
from .schedule import ScheduleError, Step, replay
from .task import Task
from .pallas_plan import gpu_problem, plan


def time_runs_s(fn: Any, args: list[Any], opts: MeasureOptions) -> list[float]:
    """Seconds of repeated calls, each waited for (warm-up first), as the C runner repeats them."""
    for _ in range(opts.warmup):
        jax.block_until_ready(fn(*args))
    lat: list[float] = []
    total = 0.0
    while len(lat) < opts.repeats or total < opts.min_time_s:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        dt = time.perf_counter() - t0
        lat.append(dt)
        total += dt
        if total > opts.max_time_s or len(lat) >= 200:
            break
    return lat


class PallasMeasurer:
    """Builder + checker (+ timer on a GPU) for one task: steps in, tuning records out."""

    def __init__(self, task: Task, backend: PallasBackend | None = None, opts: MeasureOptions | None = None):
        self.task = task
        self.backend = backend or PallasBackend()
        self.opts = opts or MeasureOptions()
        self.target = self.backend.target()
        self.target_key = self.backend.target_key()
        ins = task.random_inputs(seed=0)
        self.ref = task.reference(ins)
        self.args = [jax.device_put(ins[n]) for n, _ in task.input_shapes]

    def measure(self, schedules: list[list[Step]]) -> list[TuningRecord]:
        return list(self.measure_iter(schedules))

    def measure_iter(self, schedules: list[list[Step]]) -> Iterator[TuningRecord]:
        """One record per schedule, in order, each yielded as soon as it is measured."""
        for steps in schedules:
            t0 = time.perf_counter()
            lat, err, extra = self._one(steps)
            yield TuningRecord(
                workload_key=self.task.workload_key, task=self.task.to_dict(), target_key=self.target_key,
                target=self.target, schedule=steps, latencies_s=tuple(lat), error=err, timestamp=time.time(),
                tuning_time_s=time.perf_counter() - t0, library_version=VERSION, extra=extra)

    def _one(self, steps: list[Step]) -> tuple[list[float], str | None, dict[str, Any]]:
        extra: dict[str, Any] = {"measured": self.backend.timed}
        try:
            state = replay(self.task.dag, steps)
            prog = plan(state)
        except (ScheduleError, ValueError, KeyError) as e:
            return [], f"invalid schedule: {e}", extra
        problem = gpu_problem(prog) if self.backend.timed else None
        if problem:
            return [], f"invalid schedule: {problem}", extra
        t0 = time.perf_counter()
        try:
            fn = self.backend.function(state)
            compiled = fn.lower(*self.args).compile()
        except Exception as e:  # a lowering or compiler error is the candidate's, not the search's
            return [], f"build error: {type(e).__name__}: {str(e)[-2000:]}", extra
        extra["build_time_s"] = time.perf_counter() - t0
        try:
            out = np.asarray(jax.block_until_ready(compiled(*self.args)))
        except Exception as e:
            return [], f"run error: {type(e).__name__}: {str(e)[-2000:]}", extra
        err = check_output(out, self.ref, self.opts.rtol)
        if err or not self.backend.timed:
            return [], err, extra
        return time_runs_s(compiled, self.args, self.opts), None, extra

    def close(self) -> None:
        """Nothing to stop: candidates run in this process."""
