"""Pallas kernels tuned on a GPU against XLA's GPU code: W1-W5 and the local matmuls of a
GPT train step's plan. The one script to run when a GPU is lent (the `device` tool).

    .venv/bin/python benchmarks/gpu_kernels.py [--trials 32] [--budget-s 420]
    .venv/bin/python benchmarks/gpu_kernels.py --smoke      # tiny shapes: checks the script without a GPU

Each task is tuned with `search.tune(task, target="pallas")` (every candidate checked
against float64 numpy, then timed on the GPU) into a fresh tuning DB; its best kernel and
XLA's code for the same op (`jax.jit`) are then timed head to head in interleaved rounds
(fastest call of each). The GPT tasks come from the plan's `kernel_tasks` (hidden 1024,
4 x 512 tokens, one device): the path a user runs. Tasks stop being started once
`--budget-s` is spent, so the run fits one device call. Writes
benchmarks/results/gpu_kernels_<time>.json after every task; prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autopar.kernel_choice import interleaved_best_s  # noqa: E402
from kernels import WORKLOADS as CPU_WORKLOADS, jax_op  # noqa: E402
from search import Task, tune  # noqa: E402
from search.backend_pallas import PallasBackend, gpu_name  # noqa: E402
from search.schedule import replay  # noqa: E402

WORKLOADS = {name: task for name, (_, task) in CPU_WORKLOADS.items()}      # W1-W5, as on CPU
SMOKE = {"W1": Task.matmul(32, 48, 32), "W3": Task.batch_matmul(2, 16, 16, 16), "W4": Task.softmax(8, 32)}


def gpt_plan_tasks(limit: int) -> dict[str, Task]:
    """The largest local matmuls of a GPT train step's plan on one device (its kernel_tasks)."""
    import optax

    import autopar
    from autopar.kernel_sites import search_task
    from autopar.model_zoo.gpt import GPTConfig, gpt_setup

    cfg = GPTConfig(vocab=1024, seq=512, hidden=1024, heads=16, layers=2, batch=4)
    step, state, batch = gpt_setup(cfg, optax.sgd(1e-3))
    plan = autopar.make_plan(step, state, batch, cluster="1x1:a100-80g")
    return {f"gpt:{kt.workload_key}": search_task(kt) for kt in plan.stages[0].kernel_tasks[:limit]}


def run_task(name: str, task: Task, trials: int, db: str, timed: bool) -> dict:
    t0 = time.perf_counter()
    res = tune(task, target="pallas", trials=trials, db=db, policy="evolutionary" if timed else "random",
               batch_size=min(8, trials))
    tune_s = time.perf_counter() - t0
    row = {"name": name, "task": task.workload_key, "trials": res.trials, "tune_s": tune_s,
           "valid": sum(1 for r in res.records if r.ok or r.unmeasured), "timed": timed}
    if res.best_schedule is None:
        row["error"] = next((r.error for r in res.records if r.error), "no valid kernel")
        return row
    ins = task.random_inputs(0)
    args = [jnp.asarray(ins[n]) for n, _ in task.input_shapes]
    pallas = PallasBackend().function(replay(task.dag, res.best_schedule))
    xla = jax.jit(jax_op(task))
    got, want = np.asarray(pallas(*args)), np.asarray(xla(*args))
    row["rel_error_vs_xla"] = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
    t_p, t_x = interleaved_best_s([lambda: pallas(*args), lambda: xla(*args)], rounds=3,
                                  repeats=10 if timed else 2)
    row.update(pallas_s=t_p, xla_s=t_x, speedup=t_x / t_p, gflops=task.flops / t_p / 1e9)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--gpt-tasks", type=int, default=4, help="the plan's largest tasks to include (default 4)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no task after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 trials: check the script (interpret mode)")
    args = ap.parse_args()
    device = gpu_name()
    timed = device is not None
    if not timed and not args.smoke:
        print("gpu_kernels: no GPU in this process (jax.devices('gpu') is empty); Pallas kernels would only be "
              "interpreted. Run it where a GPU is, or pass --smoke to check the script.", file=sys.stderr)
        return 2
    trials = 2 if args.smoke else args.trials
    tasks = dict(SMOKE) if args.smoke else {**WORKLOADS, **gpt_plan_tasks(args.gpt_tasks)}
    db = os.path.join(tempfile.mkdtemp(prefix="autopar-gpu-"), "tuning.db")
    out = os.path.join(ROOT, "benchmarks", "results", f"gpu_kernels_{int(time.time())}.json")
    result = {"device": device or "none (interpret mode)", "jax": jax.__version__, "trials": trials, "rows": []}
    t_start = time.perf_counter()
    for name, task in tasks.items():
        if time.perf_counter() - t_start > args.budget_s:
            result["rows"].append({"name": name, "task": task.workload_key, "skipped": "time budget spent"})
            continue
        result["rows"].append(run_task(name, task, trials, db, timed))
        if not args.smoke:
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
    table = Table(title=f"Pallas vs XLA on {result['device']} ({trials} trials per task)")
    for col in ("workload", "task", "XLA ms", "Pallas ms", "speedup", "GFLOP/s", "valid/trials", "tune s"):
        table.add_column(col)
    for r in result["rows"]:
        if "pallas_s" in r:
            table.add_row(r["name"], r["task"], f"{r['xla_s'] * 1e3:.3f}", f"{r['pallas_s'] * 1e3:.3f}",
                          f"{r['speedup']:.2f}x" if timed else "(interpret)", f"{r['gflops']:.0f}",
                          f"{r['valid']}/{r['trials']}", f"{r['tune_s']:.0f}")
        else:
            table.add_row(r["name"], r["task"], "-", "-", "-", "-", "-", r.get("skipped") or r.get("error", "")[:60])
    Console(width=150).print(table)
    print(json.dumps(result["rows"], indent=1))
    bad = [r for r in result["rows"] if r.get("rel_error_vs_xla", 0) > 1e-3]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
