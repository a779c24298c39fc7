"""Kernel-search benchmark: W1-W5 tuned with evolutionary search + XGBoost model and with random
search, next to XLA on CPU (jax.jit), numpy, and this machine's peak FLOP/s and bandwidth.

    .venv/bin/python benchmarks/kernels.py [--trials 256] [--random-trials 256] [--workloads W1,W2]

Latencies are the fastest of several runs, for our kernels, XLA and numpy alike (the machine is
shared; slower runs mostly measure other jobs). Prints a rich table and writes benchmarks/results/kernels.json (rewritten after every run, so
a run cut short keeps what it measured). Tuning records go to a fresh DB under results/.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from search import Task, build, tune  # noqa: E402
from search.buffers import aligned_copy, aligned_empty  # noqa: E402
from search.database import TuningDB  # noqa: E402
from search.measure import MeasureOptions, best_run_s  # noqa: E402

WORKLOADS = {
    "W1": ("matmul 512x512x512", Task.matmul(512, 512, 512)),
    "W2": ("dense 1024x1024 @ 1024x4096 + bias + gelu", Task.dense(1024, 4096, 1024, "gelu")),
    "W3": ("batch matmul 32 x (128x64 @ 64x128)", Task.batch_matmul(32, 128, 128, 64)),
    "W4": ("softmax 4096x1024", Task.softmax(4096, 1024)),
    "W5": ("layernorm 4096x1024", Task.layernorm(4096, 1024)),
}
OUT = os.path.join(ROOT, "benchmarks", "results", "kernels.json")


def _time(fn, min_runs: int = 5, min_time_s: float = 0.3) -> float:
    """Fastest call in seconds after one warm-up call (the same statistic the search ranks by)."""
    fn()
    ts: list[float] = []
    while len(ts) < min_runs or sum(ts) < min_time_s:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if len(ts) >= 100:
            break
    return float(np.min(ts))


def baselines(task: Task) -> dict[str, float]:
    """XLA (jax.jit on CPU) and numpy latencies of the same operator, fp32."""
    xla, np_fn = _reference_fns(task)
    return {"xla_s": _time(xla), "numpy_s": _time(np_fn, min_runs=3)}


def jax_op(task: Task):
    """The operator as plain jnp code (XLA's version of it, once jitted); the activations are
    jax.nn's (gelu: the tanh approximation, as ours)."""
    import jax

    p = dict(task.params)
    act = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, None: lambda x: x}[p.get("epilogue")]
    if task.op in ("matmul", "batch_matmul"):
        return lambda a, b: act(a @ b)
    if task.op == "dense":
        return lambda a, b, c: act(a @ b + c)
    if task.op == "softmax":
        return lambda x: jax.nn.softmax(x, axis=1)
    if task.op == "layernorm":
        eps = p.get("eps", 1e-5)

        def layernorm(x, g, b):
            m = x.mean(1, keepdims=True)
            v = ((x - m) ** 2).mean(1, keepdims=True)
            return (x - m) * jax.lax.rsqrt(v + eps) * g + b
        return layernorm
    raise ValueError(f"no jnp version of {task.op}")


def _reference_fns(task: Task):
    """No-argument calls of the operator under jax.jit and in numpy, on the task's seeded inputs."""
    import jax
    import jax.numpy as jnp

    ins = task.random_inputs(0)
    p = dict(task.params)
    args = [aligned_copy(ins[n]) for n, _ in task.input_shapes]
    jf = jax_op(task)
    if task.op in ("matmul", "batch_matmul"):
        nf = lambda a, b: a @ b  # noqa: E731
    elif task.op == "dense":
        nf = lambda a, b, c: (lambda x: 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3))))(a @ b + c)  # noqa: E731
    elif task.op == "softmax":
        nf = lambda x: (lambda e: e / e.sum(1, keepdims=True))(np.exp(x - x.max(1, keepdims=True)))  # noqa: E731
    elif task.op == "layernorm":
        eps = p.get("eps", 1e-5)

        def nf(x, g, b):
            m = x.mean(1, keepdims=True)
            v = ((x - m) ** 2).mean(1, keepdims=True)
            return (x - m) / np.sqrt(v + eps) * g + b
    else:
        raise ValueError(task.op)
    jitted = jax.jit(jf)
    dargs = [jnp.asarray(a) for a in args]
    return (lambda: jitted(*dargs).block_until_ready()), (lambda: nf(*args))


def head_to_head(task: Task, schedules: dict[str, list], rounds: int = 5) -> dict[str, float]:
    """XLA and each named kernel (each policy's best, and its best after 64 trials) timed in
    turn, `rounds` times, fastest call of each. Tuning runs and the XLA baseline are minutes
    apart and the machine's speed drifts (XLA's W2 took 25-70 ms on different runs of the same
    day), so the "vs XLA" ratio and the policies' 64-trial comparison come from here."""
    ins = task.random_inputs(0)
    args = [aligned_copy(ins[n]) for n, _ in task.input_shapes]  # as the tuner's runner times them
    fns = {"xla": _reference_fns(task)[0]}
    for name, sched in schedules.items():
        if sched is not None:
            k = build(task, sched)
            out = aligned_empty(task.output_shape, task.dtype)
            fns[name] = (lambda k=k, out=out: k(*args, out=out))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], _time(fn, min_runs=3, min_time_s=0.1))
    return {f"{n}_s": v for n, v in best.items()}


_PEAK_C = r"""
#include <immintrin.h>
#include <omp.h>
double peak_flops(long iters) {
  double t0 = omp_get_wtime(); float sink = 0;
  #pragma omp parallel reduction(+:sink)
  {
    __m512 a[12]; __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.001f);
    for (int k = 0; k < 12; ++k) a[k] = _mm512_set1_ps((float)k);
    for (long i = 0; i < iters; ++i)
      for (int k = 0; k < 12; ++k) a[k] = _mm512_fmadd_ps(a[k], b, c);
    for (int k = 0; k < 12; ++k) sink += _mm512_reduce_add_ps(a[k]);
  }
  double dt = omp_get_wtime() - t0;
  return (sink == 12345.f ? 0 : 1) * (double)iters * 12 * 16 * 2 * omp_get_max_threads() / dt;
}
double triad_bytes_per_s(float* a, const float* b, const float* c, long n) {
  double best = 0;
  for (int r = 0; r < 5; ++r) {
    double t0 = omp_get_wtime();
    #pragma omp parallel for
    for (long i = 0; i < n; ++i) a[i] = b[i] + 3.0f * c[i];
    double bw = 3.0 * 4 * n / (omp_get_wtime() - t0);
    if (bw > best) best = bw;
  }
  return best;
}
"""


def machine_peaks() -> dict[str, float]:
    """FMA throughput (AVX-512, all cores) and STREAM-triad bandwidth, measured here."""
    d = tempfile.mkdtemp()
    src, so = os.path.join(d, "peak.c"), os.path.join(d, "peak.so")
    with open(src, "w") as f:
        f.write(_PEAK_C)
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", so, src], check=True)
    lib = ctypes.CDLL(so)
    lib.peak_flops.restype = ctypes.c_double
    lib.peak_flops.argtypes = [ctypes.c_long]
    lib.triad_bytes_per_s.restype = ctypes.c_double
    lib.triad_bytes_per_s.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long]
    # many short runs, best one: a long run on a shared machine measures the other jobs too
    flops = max(lib.peak_flops(200_000) for _ in range(50))
    n = 32 * 1024 * 1024
    a, b, c = (np.ones(n, np.float32) for _ in range(3))
    bw = lib.triad_bytes_per_s(a.ctypes.data, b.ctypes.data, c.ctypes.data, n)
    return {"peak_flops_per_s": flops, "triad_bytes_per_s": bw}


def min_bytes(task: Task) -> int:
    """Compulsory traffic: every input read once and the output written once (fp32)."""
    n = sum(int(np.prod(s)) for _, s in task.input_shapes) + int(np.prod(task.output_shape))
    return 4 * n


def tuning_run(task: Task, policy: str, trials: int, db: str, checkpoints=(64, 256), seed: int = 0,
               transfer: bool = True) -> dict:
    opts = MeasureOptions(repeats=5, min_time_s=0.05, max_time_s=0.6, run_timeout_s=15.0)
    res = tune(task, trials=trials, db=db, policy=policy, batch_size=16, measure_options=opts, warm_start=False,
               seed=seed, transfer=transfer)
    out = {"trials": res.trials, "tuning_time_s": res.tuning_time_s,
           "errors": sum(1 for r in res.records if not r.ok)}
    for c in checkpoints:
        if c <= res.trials:
            out[f"best_s@{c}"] = res.best_after(c)
            sched = _fastest_schedule(res.records[:c])
            if sched is not None:
                out[f"best_schedule@{c}"] = sched
            out[f"time_s@{c}"] = next((h[2] for h in res.history if h[0] >= c), res.tuning_time_s)
    out["best_s"] = res.best_latency_s
    out["best_schedule"] = res.best_schedule
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=256)
    ap.add_argument("--random-trials", type=int, default=256)
    ap.add_argument("--workloads", default="W1,W2,W3,W4,W5")
    ap.add_argument("--peaks-only", action="store_true", help="re-measure the machine peaks into the existing JSON")
    ap.add_argument("--head-to-head", metavar="DB_PREFIX",
                    help="only re-time XLA against the best kernels in DB_PREFIX_{evolutionary,random}.sqlite "
                         "(a finished or cut-short run's DBs) and add the result to the existing JSON")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    if args.head_to_head:
        from search import best_schedule
        with open(OUT) as f:
            result = json.load(f)
        for w, entry in result["workloads"].items():
            task = WORKLOADS[w][1]
            scheds = {}
            for p in ("evolutionary", "random"):
                path = f"{args.head_to_head}_{p}.sqlite"
                if os.path.exists(path):
                    scheds[p] = best_schedule(task, path)
                    scheds[f"{p}@64"] = best_of_first(path, task, 64)
            entry["head_to_head"] = head_to_head(task, scheds)
            print(w, "head to head", json.dumps(entry["head_to_head"]), flush=True)
            _save(result)
        print_table(result)
        return
    if args.peaks_only:
        with open(OUT) as f:
            result = json.load(f)
        result["machine"] = {**machine_peaks(), "cores": os.cpu_count()}
        _save(result)
        print_table(result)
        return
    db = os.path.join(os.path.dirname(OUT), f"kernels_db_{int(time.time())}.sqlite")
    result: dict = {"machine": {**machine_peaks(), "cores": os.cpu_count()}, "workloads": {},
                    "command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    h2h_schedules: dict[str, dict] = {}
    for w in args.workloads.split(","):
        desc, task = WORKLOADS[w]
        entry = {"desc": desc, "workload_key": task.workload_key, "gflop": task.flops / 1e9,
                 "min_mbytes": min_bytes(task) / 1e6, **baselines(task)}
        result["workloads"][w] = entry
        for policy, trials in (("evolutionary", args.trials), ("random", args.random_trials)):
            if trials > 0:
                # one DB per policy: the evolutionary runs' cost model learns from earlier
                # workloads' records (transfer), and only from those it measured itself
                entry[policy] = tuning_run(task, policy, trials, db.replace(".sqlite", f"_{policy}.sqlite"))
                _save(result)
                shown = {k: v for k, v in entry[policy].items() if not k.startswith("best_schedule")}
                print(w, policy, json.dumps(shown), flush=True)
        scheds = {}
        for p in ("evolutionary", "random"):
            if p in entry:
                scheds[p] = entry[p].get("best_schedule")
                scheds[f"{p}@64"] = entry[p].get("best_schedule@64")
        entry["head_to_head"] = head_to_head(task, scheds)
        h2h_schedules[w] = scheds
        print(w, "head to head", json.dumps(entry["head_to_head"]), flush=True)
        _save(result)
    # a second pass at the end: interference on this shared machine comes in spells of minutes
    # (run 16: all four W5 kernels timed 0.70-0.71 ms in the first pass, 0.605-0.612 fifteen
    # minutes later), so each kernel keeps the faster of its two passes
    for w, scheds in h2h_schedules.items():
        entry = result["workloads"][w]
        second = head_to_head(WORKLOADS[w][1], scheds)
        entry["head_to_head_passes"] = [entry["head_to_head"], second]
        entry["head_to_head"] = fastest_of_passes(entry["head_to_head_passes"])
        print(w, "head to head, second pass", json.dumps(second), flush=True)
        _save(result)
    print_table(result)


def fastest_of_passes(passes: list[dict[str, float]]) -> dict[str, float]:
    """Each timed function's fastest result over several head-to-head passes."""
    return {k: min(p[k] for p in passes if k in p) for k in dict.fromkeys(k for p in passes for k in p)}


def _save(result: dict) -> None:
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)


def _fastest_schedule(records: list) -> list | None:
    """The schedule of the fastest successful record among `records` (None if none ran)."""
    ok = [r for r in records if r.ok]
    return min(ok, key=best_run_s).schedule if ok else None


def best_of_first(db_path: str, task: Task, n: int) -> list | None:
    """The schedule of the fastest successful record among the first `n` of `task` in a DB."""
    db = TuningDB(db_path)
    try:
        return _fastest_schedule([r for r in db.records() if r.workload_key == task.workload_key][:n])
    finally:
        db.close()


def _h2h_best(h: dict) -> float:
    """The fastest of the policies' final kernels in a head-to-head result."""
    return min(v for k, v in h.items() if k != "xla_s" and "@" not in k)


def _h2h_cells(h: dict | None, ms) -> list[str]:
    if not h:
        return ["-", "-", "-"]
    best = _h2h_best(h)
    return [ms(h["xla_s"]), ms(best), f"{h['xla_s'] / best:.2f}x"]


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = result["machine"]
    t = Table(title=f"kernel search on {m['cores']} cores: peak {m['peak_flops_per_s'] / 1e9:.0f} GFLOP/s, "
                    f"triad {m['triad_bytes_per_s'] / 1e9:.1f} GB/s (ms; lower is better)")
    for c in ("W", "XLA", "numpy", "evo@64", "evo@256", "evo tune s", "rand@64", "rand@256", "rand tune s",
              "best vs XLA", "h2h XLA", "h2h best", "h2h vs XLA", "h2h evo@64", "h2h rand@64", "roofline ms"):
        t.add_column(c, justify="right")
    ms = lambda x: f"{x * 1e3:.3f}" if x is not None and x < float("inf") else "-"  # noqa: E731
    for w, e in result["workloads"].items():
        ev, rd, h = e.get("evolutionary", {}), e.get("random", {}), e.get("head_to_head") or {}
        best = min(ev.get("best_s", float("inf")), rd.get("best_s", float("inf")))
        roof = max(e["gflop"] * 1e9 / m["peak_flops_per_s"], e["min_mbytes"] * 1e6 / m["triad_bytes_per_s"])
        t.add_row(w, ms(e["xla_s"]), ms(e["numpy_s"]), ms(ev.get("best_s@64")), ms(ev.get("best_s@256")),
                  f"{ev.get('tuning_time_s', 0):.0f}", ms(rd.get("best_s@64")), ms(rd.get("best_s@256")),
                  f"{rd.get('tuning_time_s', 0):.0f}", f"{e['xla_s'] / best:.2f}x" if best < float('inf') else "-",
                  *_h2h_cells(h, ms), ms(h.get("evolutionary@64_s")), ms(h.get("random@64_s")), ms(roof))
    Console(width=200).print(t)
    for line in target_lines(result):
        print(line)


def target_lines(result: dict) -> list[str]:
    """The issue's targets, judged on this run: head-to-head speed against XLA (W1 at least
    0.8x, W2-W5 at least 1x) and evolutionary + model faster than random search at 64 trials."""
    out = []
    for w, e in result["workloads"].items():
        h, ev, rd = e.get("head_to_head"), e.get("evolutionary", {}), e.get("random", {})
        if h:
            need = 0.8 if w == "W1" else 1.0
            ratio = h["xla_s"] / _h2h_best(h)
            out.append(f"{w}: {ratio:.2f}x XLA head to head (target >= {need}x): {'met' if ratio >= need else 'MISSED'}")
        if "best_s@64" in ev and "best_s@64" in rd:
            a, b = ev["best_s@64"], rd["best_s@64"]
            line = f"{w}: at 64 trials evolutionary {a * 1e3:.3f} ms, random {b * 1e3:.3f} ms while tuning"
            if h and "evolutionary@64_s" in h and "random@64_s" in h:
                # the verdict: both kernels timed in turn, not minutes apart
                a, b = h["evolutionary@64_s"], h["random@64_s"]
                line += f"; head to head {a * 1e3:.3f} against {b * 1e3:.3f} ms"
            out.append(f"{line}: {'evolutionary faster' if a < b else 'RANDOM FASTER OR EQUAL'}")
    return out


if __name__ == "__main__":
    main()
