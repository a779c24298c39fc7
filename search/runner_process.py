"""Runner process (`python -m search.runner_process REQUEST_FD REPLY_FD`): holds one task's
inputs and numpy reference, then for each kernel it is sent loads it, checks its output and
times it.

Protocol, one JSON object per line on two private pipes (never stdin/stdout, which the
kernels being measured share and can print to): first {"task": ..., "options": ...}, answered
{"id": 0, "ready": true}; then {"id": n, "path": ...}, answered {"id": n, "latencies_s": [...],
"error": ...}. The parent drops a runner whose reply does not carry the id it asked for."""
from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import sys
import time

import numpy as np

from .backend import CBackend, call_kernel
from .buffers import aligned_copy, aligned_empty
from .task import Task

_PR_SET_PDEATHSIG = 1
PROBES = 16  # output elements checked after every timed call


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
    """Check the first call; time the next ones, checking each: before every timed call a few
    output elements spread over the array (PROBES) are set to NaN, after it they must hold the
    reference values, and the last timed call's whole output is checked. Poisoning the whole
    output instead would evict the inputs from cache and change what is timed (a memory-bound
    softmax measured 2.5x slower that way)."""
    out.fill(np.nan)
    call_kernel(fn, arrays + [out])
    err = check_output(out, ref, o["rtol"])
    if err:
        return [], err
    for _ in range(o["warmup"] - 1):
        call_kernel(fn, arrays + [out])
    # plain Python on a memoryview: numpy calls between timed calls made 4 us kernels 0.3 us slower
    flat = memoryview(out.reshape(-1))
    probes = np.unique(np.linspace(0, out.size - 1, PROBES).astype(np.int64)).tolist()
    expected = [float(x) for x in ref.reshape(-1)[probes]]
    tolerance = o["rtol"] * max(float(np.abs(ref).max()), 1e-30)
    lat: list[float] = []
    total = 0.0
    while len(lat) < o["repeats"] or total < o["min_time_s"]:
        for i in probes:
            flat[i] = math.nan
        t0 = time.perf_counter()
        call_kernel(fn, arrays + [out])
        dt = time.perf_counter() - t0
        if not all(abs(flat[i] - e) <= tolerance for i, e in zip(probes, expected)):  # NaN fails
            return [], f"wrong result in timed call {len(lat) + 1} (the first call was right)"
        lat.append(dt)
        total += dt
        if total > o["max_time_s"] or len(lat) >= 200:
            break
    err = check_output(out, ref, o["rtol"])
    if err:
        return [], f"{err} after timed call {len(lat)} (the first call was right)"
    return lat, None


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (it runs in its own session, so a
    Ctrl-C in the terminal does not reach it, and a killed parent must not leave it running)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):
        pass


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a run stops
    _die_with_parent()
    requests = os.fdopen(int(argv[1]), "r", encoding="utf-8")
    replies = os.fdopen(int(argv[2]), "w", encoding="utf-8")

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    hello = json.loads(requests.readline())
    task, o = Task.from_dict(hello["task"]), hello["options"]
    ins = task.random_inputs(seed=0)
    ref = task.reference(ins)
    arrays = [aligned_copy(ins[n]) for n, _ in task.input_shapes]
    out = aligned_empty(task.output_shape, task.dtype)
    backend = CBackend(workdir=".")
    reply({"id": 0, "ready": True})
    for line in requests:
        request = json.loads(line)
        try:
            lat, err = measure_one(backend.load(request["path"], len(arrays) + 1), arrays, out, ref, o)
        except Exception as e:  # reported as an error record, never as a result
            lat, err = [], f"run error: {type(e).__name__}: {e}"
        reply({"id": request["id"], "latencies_s": lat, "error": err})


if __name__ == "__main__":
    main(sys.argv)
