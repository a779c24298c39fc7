"""Runner process (`python -m search.runner_process`): holds one task's inputs and numpy
reference, then for each kernel path on stdin loads it, checks its output and times it.
Protocol: first line {"task": ..., "options": ...}; then one path per line; one JSON reply each."""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from .backend import CBackend, call_kernel
from .buffers import aligned_copy, aligned_empty
from .task import Task


def check_output(out: np.ndarray, ref: np.ndarray, rtol: float) -> str | None:
    """None when max |out - ref| <= rtol * max |ref| and everything is finite; else why not."""
    if not np.all(np.isfinite(out)):
        return "wrong result: non-finite output"
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(out - ref).max()) / scale
    if err > rtol:
        return f"wrong result: max error {err:.3g} of max |ref| exceeds rtol {rtol:g}"
    return None


def measure_one(fn, arrays: list[np.ndarray], out: np.ndarray, ref: np.ndarray, o: dict) -> tuple[list[float], str | None]:
    out.fill(np.nan)
    call_kernel(fn, arrays + [out])
    err = check_output(out, ref, o["rtol"])
    if err:
        return [], err
    for _ in range(o["warmup"] - 1):
        call_kernel(fn, arrays + [out])
    lat: list[float] = []
    total = 0.0
    while len(lat) < o["repeats"] or total < o["min_time_s"]:
        t0 = time.perf_counter()
        call_kernel(fn, arrays + [out])
        dt = time.perf_counter() - t0
        lat.append(dt)
        total += dt
        if total > o["max_time_s"] or len(lat) >= 200:
            break
    return lat, None


def main() -> None:
    hello = json.loads(sys.stdin.readline())
    task, o = Task.from_dict(hello["task"]), hello["options"]
    ins = task.random_inputs(seed=0)
    ref = task.reference(ins)
    arrays = [aligned_copy(ins[n]) for n, _ in task.input_shapes]
    out = aligned_empty(task.output_shape, task.dtype)
    backend = CBackend(workdir=".")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        path = line.strip()
        try:
            lat, err = measure_one(backend.load(path, len(arrays) + 1), arrays, out, ref, o)
        except Exception as e:  # reported as an error record, never as a result
            lat, err = [], f"run error: {type(e).__name__}: {e}"
        print(json.dumps({"latencies_s": lat, "error": err}), flush=True)


if __name__ == "__main__":
    main()
