"""`tune`: search kernels for one task and store every measurement; `build`: compile a
schedule into a callable on numpy arrays."""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .backend import CBackend, call_kernel
from .buffers import aligned_empty
from .evolution import EvolutionarySearch, RandomSearch, SearchPolicy
from .database import SkippedRecordsWarning
from .measure import MeasureOptions, ProgramMeasurer, best_run_s, check_fits_in_memory
from .mutation import checked_program
from .record import TuningRecord
from .schedule import Step, replay
from .space import SPACES
from .task import Task

TARGETS = ("cpu", "pallas")
POLICIES = ("evolutionary", "random")


@dataclass(frozen=True)
class TuneResult:
    """Outcome of one tuning run: the best schedule found (None if every trial failed) and its
    latency, the fastest timed run of its record (see `measure.best_run_s`). When nothing was
    timed (Pallas in interpret mode) it is the first schedule checked correct, at +inf."""

    task: Task
    best_schedule: list[Step] | None
    best_latency_s: float
    records: list[TuningRecord]
    tuning_time_s: float
    history: list[tuple[int, float, float]] = field(default_factory=list)  # (trials, best_s, elapsed_s)

    @property
    def trials(self) -> int:
        return len(self.records)

    @property
    def best_gflops(self) -> float:
        return self.task.flops / self.best_latency_s / 1e9 if self.best_latency_s < float("inf") else 0.0

    def best_after(self, trials: int) -> float:
        """Best latency among the first `trials` measurements."""
        lat = [best_run_s(r) for r in self.records[:trials]]
        return min(lat, default=float("inf"))


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C during `tune`; every record measured so far is in the tuning DB, and `result`
    holds them."""

    def __init__(self, result: TuneResult):
        super().__init__(f"tuning interrupted; {len(result.records)} records kept")
        self.result = result


def measure_into(database: Any, measurer: ProgramMeasurer, batch: list[list[Step]],
                 done: list[TuningRecord]) -> list[TuningRecord]:
    """Measure `batch`, committing each record to `database` and appending it to `done` as soon
    as it is measured, so an interrupted run keeps every measurement; returns the batch's."""
    recs = []
    for r in measurer.measure_iter(batch):
        try:
            database.add(r)
        except KeyboardInterrupt:  # the interrupted add was rolled back: store it, then stop
            database.add(r)
            done.append(r)
            raise
        recs.append(r)
        done.append(r)
    return recs


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target {target!r} is not supported; use 'cpu' (C/OpenMP kernels compiled and "
                         f"timed on this machine) or 'pallas' (Pallas kernels: timed on this process's GPU, "
                         f"only checked for correctness in interpret mode without one)")


def make_measurer(task: Task, target: str, opts: MeasureOptions | None = None) -> Any:
    """The builder and runner of `target`: ProgramMeasurer (C) or PallasMeasurer."""
    if target == "pallas":
        from .measure_pallas import PallasMeasurer
        return PallasMeasurer(task, opts=opts)
    return ProgramMeasurer(task, opts=opts)


def target_key_of(target: str) -> str:
    """This machine's key for `target` (what its records are stored under)."""
    if target == "pallas":
        from .backend_pallas import PallasBackend
        return PallasBackend().target_key()
    return CBackend().target_key()


def chosen_record(records: list[TuningRecord]) -> TuningRecord | None:
    """The record with the fastest timed run; when none was timed, the first one checked correct
    but not timed (an unmeasured record never competes on latency)."""
    fastest = min((r for r in records if r.ok), key=best_run_s, default=None)
    return fastest or next((r for r in records if r.unmeasured), None)


def open_db(db: Any):
    """A TuningDB from None (default location), a path, or an open TuningDB (returned as is)."""
    from .database import TuningDB

    if db is None or isinstance(db, (str, os.PathLike)):
        return TuningDB(db), True
    return db, False


def replayable(task: Task, records: list[TuningRecord]) -> list[TuningRecord]:
    """`records` of `task` without the successful ones whose schedule does not lower on it (a
    hand-edited file, another version's records): as search elites they would crash it."""
    usable = [r for r in records if not r.ok or checked_program(task.dag, r.schedule) is not None]
    if len(usable) < len(records):
        warnings.warn(SkippedRecordsWarning(
            f"left out {len(records) - len(usable)} stored records of {task} whose schedule does "
            "not apply to it; `autopar db remove KEY` deletes a workload's records"), stacklevel=3)
    return usable


def make_policy(name: str, task: Task, seed: int = 0, target: str = "cpu", **kw) -> SearchPolicy:
    if name == "evolutionary":
        return EvolutionarySearch(task, seed=seed, space=SPACES[target], **kw)
    if name == "random":
        return RandomSearch(task, seed=seed, space=SPACES[target])
    raise ValueError(f"unknown search policy {name!r}; use one of {POLICIES}")


def tune(task: Task, target: str = "cpu", trials: int = 64, db: Any = None, policy: str = "evolutionary",
         batch_size: int = 16, seed: int = 0, measure_options: MeasureOptions | None = None,
         callback: Callable[[TuneResult], None] | None = None, warm_start: bool = True,
         transfer: bool = True) -> TuneResult:
    """Measure `trials` schedules chosen by `policy`, adding each record to the tuning DB as
    soon as it is measured. Ctrl-C raises TuneInterrupted (a KeyboardInterrupt) whose result
    holds every record measured, all of them stored. With `warm_start`, records of this task
    already in the DB seed the cost model and the population; with `transfer`, the DB's
    records of other tasks on this target pre-train the cost model. `target="pallas"` searches
    Pallas kernels with the GPU sketch rules; without a GPU each is run in interpret mode and
    checked, not timed (its record is `unmeasured`)."""
    _check_target(target)
    if not isinstance(task, Task):
        raise TypeError(f"tune: expected a search.Task, got {type(task).__name__}; build one with "
                        f"Task.matmul(...) or Task.from_op(...)")
    if trials < 1 or batch_size < 1:
        raise ValueError(f"tune: trials ({trials}) and batch_size ({batch_size}) must be positive")
    check_fits_in_memory(task)
    pol = make_policy(policy, task, seed, target)
    measurer = make_measurer(task, target, measure_options)  # starts nothing yet
    database, owned = open_db(db)
    t0 = time.perf_counter()
    records: list[TuningRecord] = []
    history: list[tuple[int, float, float]] = []

    def result() -> TuneResult:
        chosen = chosen_record(records)
        return TuneResult(task, chosen.schedule if chosen else None,
                          best_run_s(chosen) if chosen else float("inf"), list(records),
                          time.perf_counter() - t0, list(history))

    try:
        if transfer and hasattr(pol, "learn_from"):
            pol.learn_from(database.records(target_key=measurer.target_key))
        if warm_start:
            old = replayable(task, database.records(task.workload_key, measurer.target_key))
            if old:
                pol.update([r.schedule for r in old], old)
        while len(records) < trials:
            batch = pol.next_batch(min(batch_size, trials - len(records)))
            if not batch:
                break
            pol.update(batch, measure_into(database, measurer, batch, records))
            history.append((len(records), result().best_latency_s, time.perf_counter() - t0))
            if callback is not None:
                callback(result())
    except KeyboardInterrupt:
        raise TuneInterrupted(result()) from None
    finally:
        measurer.close()
        if owned:
            database.close()
    return result()


def run_pallas(fn: Callable[..., Any], arrays: list[np.ndarray]) -> None:
    """Call a Pallas program on the inputs and copy its result into the last array (the output)."""
    arrays[-1][...] = np.asarray(fn(*arrays[:-1]))


class Kernel:
    """A compiled schedule: `kernel(*inputs) -> output`, inputs in `task.input_shapes` order.
    `launch(fn, inputs + [out])` runs `fn` (a C function: its pointers; a Pallas program: jax)."""

    def __init__(self, task: Task, schedule: list[Step], source: str, fn: Callable[..., Any],
                 launch: Callable[[Callable[..., Any], list[np.ndarray]], None] = call_kernel):
        self.task, self.schedule, self.source, self._fn, self._launch = task, schedule, source, fn, launch

    def __call__(self, *inputs: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        specs = self.task.input_shapes
        if len(inputs) != len(specs):
            raise TypeError(f"{self.task}: expected {len(specs)} inputs {[n for n, _ in specs]}, got {len(inputs)}")
        arrays = []
        for (name, shape), x in zip(specs, inputs):
            x = np.asarray(x)
            if tuple(x.shape) != tuple(shape):
                raise ValueError(f"{self.task}: input {name!r} has shape {x.shape}, expected {shape}")
            arrays.append(np.ascontiguousarray(x, dtype=self.task.dtype))
        if out is None:
            out = aligned_empty(self.task.output_shape, self.task.dtype)
        elif out.shape != self.task.output_shape or out.dtype != np.dtype(self.task.dtype) \
                or not out.flags.c_contiguous:
            raise ValueError(f"{self.task}: out must be a C-contiguous {self.task.dtype} array of shape "
                             f"{self.task.output_shape}")
        self._launch(self._fn, arrays + [out])
        return out


def build(task: Task, schedule: list[Step] | None, target: str = "cpu") -> Kernel:
    """Compile `schedule` (e.g. `tune(...).best_schedule` or a DB record's) for `target`; for
    "pallas" the kernel runs with Triton on a GPU, in interpret mode without one."""
    _check_target(target)
    if schedule is None:
        raise ValueError(f"build: no schedule for {task} (did every trial fail? see the records' errors)")
    if target == "pallas":
        from .backend_pallas import PallasBackend
        pallas = PallasBackend()
        state = replay(task.dag, schedule)
        return Kernel(task, schedule, pallas.source(state), pallas.function(state), run_pallas)
    backend = CBackend()
    source = backend.source(replay(task.dag, schedule))
    try:
        res = backend.build([source])[0]
        if res.error:
            raise RuntimeError(f"build: compiling the kernel for {task} failed: {res.error}")
        fn = backend.load(res.path, len(task.input_shapes) + 1)
    finally:
        backend.close()  # a loaded library stays mapped; nothing is left on disk
    return Kernel(task, schedule, source, fn)


def best_schedule(task: Task, db: Any = None, target: str = "cpu") -> list[Step] | None:
    """The measured schedule of `task` with the fastest run on this machine in the tuning DB; when
    none of its records for `target` was timed (Pallas without a GPU), the first checked one."""
    _check_target(target)
    database, owned = open_db(db)
    try:
        chosen = chosen_record(replayable(task, database.records(task.workload_key, target_key_of(target))))
    finally:
        if owned:
            database.close()
    return chosen.schedule if chosen else None
