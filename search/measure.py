"""Measurement: build candidates in parallel, run each in a separate runner process that checks
the output against a float64 numpy reference and times it. Failures become error records."""
from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .backend import CBackend
from .record import TuningRecord
from .schedule import ScheduleError, Step, replay
from .task import Task

VERSION = "0.1.0"


@dataclass(frozen=True)
class MeasureOptions:
    """Tolerance: max |out - ref| <= rtol * max |ref| (fp32 with -ffast-math; 1e-4 is ~1000 ulp)."""

    rtol: float = 1e-4
    warmup: int = 1
    repeats: int = 5
    min_time_s: float = 0.05          # keep repeating small kernels up to this much time
    max_time_s: float = 1.0           # stop repeating slow kernels after this much
    build_timeout_s: float = 15.0
    run_timeout_s: float = 20.0
    num_threads: int | None = None    # OpenMP threads of the runner; None = all cores


def measuring_bytes(task: Task) -> int:
    """Bytes the runner holds to measure `task`: each input twice in the task's dtype (as made,
    then page-aligned) and once in float64 for the reference, and the output in the task's
    dtype and as the float64 reference (a lower bound: numpy's temporaries come on top)."""
    item = np.dtype(task.dtype).itemsize
    n_in = sum(math.prod(shape) for _, shape in task.input_shapes)
    return n_in * (2 * item + 8) + math.prod(task.output_shape) * (item + 8)


def available_memory_bytes() -> int:
    """Memory the kernel says can be used without swapping (MemAvailable), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits_in_memory(task: Task, available_bytes: int | None = None) -> None:
    """ValueError, with the bytes, when measuring `task` cannot fit in this machine's memory."""
    need = measuring_bytes(task)
    have = available_memory_bytes() if available_bytes is None else available_bytes
    if need > have:
        raise ValueError(
            f"{task} is too large to measure here: its buffers need at least {_gib(need)} "
            f"({task.dtype} inputs and output, plus float64 copies for checking results), and "
            f"{_gib(have)} of memory is available. Tune a smaller shape (e.g. one device's shard)."
        )


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:,.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:,.1f} MiB"


def best_run_s(record: TuningRecord) -> float:
    """Fastest of a record's timed runs (+inf if it failed). The search ranks by this rather than
    the median: on a shared machine OpenMP kernels lose whole scheduler ticks in some runs, so the
    median of a few runs mostly measures the other jobs."""
    return min(record.latencies_s) if record.ok else float("inf")


class Runner:
    """A persistent runner process for one task, spoken to over two private pipes (see
    `search.runner_process`); restarted after a crash, a timeout or a reply it did not ask for."""

    def __init__(self, task: Task, opts: MeasureOptions):
        self.task, self.opts = task, opts
        self.proc: subprocess.Popen | None = None
        self._requests: int | None = None  # pipe fd: parent -> runner
        self._replies: int | None = None   # pipe fd: runner -> parent
        self._pending = b""                # reply bytes read past the last newline
        self._last_id = 0

    def _start(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if self.opts.num_threads:
            env["OMP_NUM_THREADS"] = str(self.opts.num_threads)
        child_reads, self._requests = os.pipe()
        self._replies, child_writes = os.pipe()
        try:
            # Its own session: a Ctrl-C in the terminal reaches this process only, which then
            # stops the runner; stdout goes nowhere, as kernels may print to it.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "search.runner_process", str(child_reads), str(child_writes)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
                pass_fds=(child_reads, child_writes), start_new_session=True)
        except BaseException:
            self._stop()
            raise
        finally:
            os.close(child_reads)
            os.close(child_writes)
        self._pending, self._last_id = b"", 0
        self._send({"task": self.task.to_dict(), "options": asdict(self.opts)})
        # building inputs and the float64 reference may take a while for big tasks
        hello = self._reply(0, self.opts.run_timeout_s + 300.0)
        if hello is None or not hello.get("ready"):
            self._stop()
            raise RuntimeError(f"runner process for {self.task} did not start")

    def _send(self, message: dict) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(self._requests, data):]

    def _reply(self, request_id: int, timeout_s: float) -> dict | None:
        """The reply to `request_id`; None on a timeout; an error reply when the runner died or
        something else arrived on the channel."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                return None
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                return {"id": request_id, "latencies_s": [], "error": "run error: kernel crashed the runner process"}
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or reply.get("id") != request_id:
            return {"id": request_id, "latencies_s": [], "error": "run error: the runner answered "
                    f"something other than request {request_id}: {line[:200]!r}", "restart": True}
        return reply

    def _stop(self) -> None:
        for fd in (self._requests, self._replies):
            if fd is not None:
                os.close(fd)
        self._requests = self._replies = None
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def run(self, path: str) -> tuple[list[float], str | None]:
        if self.proc is None:
            self._start()
        self._last_id += 1
        try:
            self._send({"id": self._last_id, "path": path})
        except OSError:
            self._stop()
            return [], "run error: runner process died"
        rep = self._reply(self._last_id, self.opts.run_timeout_s)
        if rep is None:
            self._stop()
            return [], f"run timeout after {self.opts.run_timeout_s:.0f} s"
        if rep.get("restart") or (rep["error"] and "crashed" in rep["error"]):
            self._stop()
        return list(rep["latencies_s"]), rep["error"]

    def close(self) -> None:
        """Stop the runner process (it holds no state worth waiting for)."""
        self._stop()


class ProgramMeasurer:
    """Builder + runner for one task: steps in, tuning records out (errors included)."""

    def __init__(self, task: Task, backend: CBackend | None = None, opts: MeasureOptions | None = None):
        self.task = task
        self._owns_backend = backend is None
        self.backend = backend or CBackend()
        self.opts = opts or MeasureOptions()
        self.runner = Runner(task, self.opts)
        self.target = self.backend.target()
        self.target_key = self.backend.target_key()

    def measure(self, schedules: list[list[Step]]) -> list[TuningRecord]:
        """One record per schedule, in order."""
        return list(self.measure_iter(schedules))

    def measure_iter(self, schedules: list[list[Step]]) -> Iterator[TuningRecord]:
        """Build all schedules, then yield each one's record as soon as it is measured (a caller
        that stores them one by one keeps every measurement if the run is interrupted). A
        record's tuning_time_s is its share of the build phase plus its own run."""
        t0 = time.perf_counter()
        sources: list[str | None] = []
        errors: list[str | None] = []
        for steps in schedules:
            try:
                sources.append(self.backend.source(replay(self.task.dag, steps)))
                errors.append(None)
            except (ScheduleError, ValueError, KeyError) as e:
                sources.append(None)
                errors.append(f"invalid schedule: {e}")
        built = iter(self.backend.build([s for s in sources if s is not None], self.opts.build_timeout_s))
        build_share_s = (time.perf_counter() - t0) / max(1, len(schedules))
        for steps, src, err in zip(schedules, sources, errors):
            t1 = time.perf_counter()
            lat: list[float] = []
            extra: dict[str, Any] = {}
            if src is not None:
                b = next(built)
                extra["build_time_s"] = b.build_time_s
                if b.error:
                    err = b.error
                else:
                    lat, err = self.runner.run(b.path)
                    try:
                        os.remove(b.path)
                        os.remove(b.path[:-3] + ".c")
                    except OSError:
                        pass
            yield TuningRecord(
                workload_key=self.task.workload_key, task=self.task.to_dict(), target_key=self.target_key,
                target=self.target, schedule=steps, latencies_s=tuple(lat), error=err, timestamp=time.time(),
                tuning_time_s=build_share_s + time.perf_counter() - t1, library_version=VERSION, extra=extra)

    def close(self) -> None:
        self.runner.close()
        if self._owns_backend:
            self.backend.close()
