"""Tuned kernels inside planned train steps: `parallelize(step, kernels="tuned")` vs XLA's
own code, on 1 CPU device and on 8 simulated devices.

    .venv/bin/python benchmarks/kernels_in_plan.py [--trials 64] [--models gpt,mlp] [--devices 1,8]

The models are a GPT block stack and an MLP, both over batch x seq = 2048 tokens at
hidden 1024, trained with sgd (the matmuls are most of such a step). Every case runs the
path a user runs: trace the step, plan it, tune each local matmul of the plan with
`--trials` trials per task into a fresh tuning DB, time each kernel head to head against
XLA's code for the same local op and keep the faster one. The whole step is then timed
against the same step on XLA's code (1 device: `jax.jit`; 8 devices: the same plan with
`kernels="xla"`) in interleaved rounds in this process (best round reported). Per op: the
local shape, XLA's time, the tuned kernel's time, and which serves it.

Prints a table per case and writes benchmarks/results/kernels_in_plan_<time>.json
(rewritten after every case, so a run cut short keeps what it measured).

`--ceiling` (no tuning) asks what any matmul kernel could give here: it measures this
machine's float32 FMA peak (a C loop of independent vector FMAs built with the kernels'
compiler and flags, on every core), the planned step under XLA, and XLA's time for each
local matmul of the plan; the step could get no faster than if every one of them ran at
that peak, with the rest of the step as XLA has it. Writes kernels_in_plan_ceiling_<time>.json.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from typing import Callable

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import autopar  # noqa: E402
from autopar.kernel_choice import interleaved_best_s  # noqa: E402
from autopar.model_zoo.gpt import GPTConfig, gpt_setup  # noqa: E402
from autopar.model_zoo.train_step import concrete_setup, cross_entropy  # noqa: E402

TOKENS, HIDDEN = 2048, 1024


class MLP(nn.Module):
    hidden: int
    layers: int
    classes: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = jax.nn.gelu(nn.Dense(4 * self.hidden, name=f"up{i}")(x))
            x = nn.Dense(self.hidden, name=f"down{i}")(x)
        return nn.Dense(self.classes, name="head")(x)


def mlp_setup(layers: int = 2):
    """(step, state, batch): an MLP of `layers` (hidden -> 4 hidden -> hidden) blocks on
    TOKENS rows of HIDDEN features, classifying into 1024 classes."""
    model = MLP(HIDDEN, layers, 1024)

    def loss(params, batch):
        x, y = batch
        return cross_entropy(model.apply({"params": params}, x), y)

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    batch = (jax.random.normal(k1, (TOKENS, HIDDEN)), jax.random.randint(k2, (TOKENS,), 0, 1024))
    return concrete_setup(model, loss, optax.sgd(1e-3), batch, k3)


def gpt_setup_bench(layers: int = 2):
    """(step, state, batch): a GPT of `layers` blocks, hidden 1024, 16 heads, 4 x 512 tokens."""
    cfg = GPTConfig(vocab=1024, seq=512, hidden=HIDDEN, heads=16, layers=layers, batch=TOKENS // 512)
    return gpt_setup(cfg, optax.sgd(1e-3))


MODELS = {"gpt": gpt_setup_bench, "mlp": mlp_setup}


def _ready(x):
    return jax.block_until_ready(x)


def interleaved(fns: dict, state, batch, rounds: int) -> dict[str, float]:
    """Best step time of each function, timed in alternating rounds (each on its own state)."""
    states = {k: state for k in fns}
    for k, f in fns.items():                 # compile and warm up
        states[k] = _ready(f(states[k], batch))[0]
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            states[k] = _ready(f(states[k], batch))[0]
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def run_case(model: str, n_devices: int, trials: int, rounds: int, db: str, kernels: str = "tuned") -> dict:
    step, state, batch = MODELS[model]()
    devices = jax.devices()[:n_devices]
    t0 = time.perf_counter()
    tuned = autopar.parallelize(step, devices=devices, kernels=kernels, tuning_trials=trials, tuning_db=db)
    _ready(tuned(state, batch))              # plans, tunes, chooses and compiles
    tune_s = time.perf_counter() - t0
    plan = tuned.plan
    if n_devices == 1:
        xla, xla_name = jax.jit(step), "jax.jit"
    else:
        xla, xla_name = autopar.parallelize(step, devices=devices, kernels="xla", plan=plan), "same plan, XLA code"
    times = interleaved({"tuned": tuned, "xla": xla}, state, batch, rounds)
    hlo = tuned.lower(state, batch).compile().as_text()
    ops = []
    for use in plan.stages[0].kernels:
        ops.append({"op": use.op, "workload": use.workload_key, "used": use.used, "reason": use.reason,
                    "tuned_s": use.tuned_s, "xla_s": use.xla_s})
    return {
        "model": model, "devices": n_devices, "mesh": list(plan.stages[0].mesh_shape), "trials_per_task": trials,
        "tasks": len({o["workload"] for o in ops}), "sites": len(ops), "sites_on_kernels": sum(o["used"] for o in ops),
        "custom_calls_in_hlo": hlo.count('custom_call_target="autopar_kernel"'),
        "plan_and_tune_s": tune_s, "step_tuned_s": times["tuned"], "step_xla_s": times["xla"], "xla_baseline": xla_name,
        "speedup": times["xla"] / times["tuned"], "ops": ops,
    }


_PEAK_C = r"""
#include <omp.h>
typedef float v16 __attribute__((vector_size(64)));
/* float32 FLOP/s of `iters` rounds of 12 independent vector FMAs per thread, all threads */
double fma_rate(long iters) {
  int threads = 1;
  float sink = 0;
  double t0 = omp_get_wtime();
  #pragma omp parallel reduction(+:sink)
  {
    v16 a[12], b, c;
    for (int l = 0; l < 16; ++l) { b[l] = 1.0000001f; c[l] = 1e-7f; }
    for (int i = 0; i < 12; ++i) for (int l = 0; l < 16; ++l) a[i][l] = (float)(i + l);
    for (long it = 0; it < iters; ++it) {
      #pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = a[i] * b + c;
    }
    for (int i = 0; i < 12; ++i) for (int l = 0; l < 16; ++l) sink += a[i][l];
    #pragma omp master
    threads = omp_get_num_threads();
  }
  double s = omp_get_wtime() - t0;
  return sink == 0.5f ? 0.0 : (double)threads * iters * 12 * 16 * 2 / s;
}
"""


def fma_peak_flops(iters: int = 20_000_000, repeats: int = 3) -> float:
    """This machine's float32 FMA peak in FLOP/s (best of `repeats`), built by the search's
    C backend: the compiler and flags the tuned kernels are built with."""
    from search.backend import CBackend

    backend = CBackend()
    try:
        built = backend.build([_PEAK_C])[0]
        if built.path is None:
            raise RuntimeError(f"building the FMA peak loop failed: {built.error}")
        fn = ctypes.CDLL(built.path).fma_rate
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long]
        return max(fn(iters) for _ in range(repeats))
    finally:
        backend.close()


def ceiling_case(model: str, n_devices: int, rounds: int, peak: float) -> dict:
    """The planned step under XLA, XLA's time for each distinct local matmul of its plan (the
    canonical [B,] M x K @ K x N product, jitted alone), and the step time if all of them ran
    at the FMA `peak` instead."""
    from autopar.kernel_sites import search_task

    step, state, batch = MODELS[model]()
    devices = jax.devices()[:n_devices]
    planned = autopar.parallelize(step, devices=devices, kernels="xla")
    _ready(planned(state, batch))
    plan = planned.plan
    xla = jax.jit(step) if n_devices == 1 else planned
    step_s = interleaved({"xla": xla}, state, batch, rounds)["xla"]
    tasks = []
    for kt in plan.stages[0].kernel_tasks:
        task = search_task(kt)
        ins = task.random_inputs()
        a, b = jnp.asarray(ins["A"]), jnp.asarray(ins["B"])
        op = jax.jit(jnp.matmul)
        best = interleaved_best_s([lambda: op(a, b)], rounds)[0]
        tasks.append({"workload": kt.workload_key, "ops": kt.ops, "flops": task.flops, "xla_s": best,
                      "xla_flops_per_s": task.flops / best, "at_peak_s": task.flops / peak})
    xla_mm = sum(t["xla_s"] * t["ops"] for t in tasks)
    peak_mm = sum(t["at_peak_s"] * t["ops"] for t in tasks)
    return {"model": model, "devices": n_devices, "mesh": list(plan.stages[0].mesh_shape), "peak_flops_per_s": peak,
            "step_xla_s": step_s, "matmuls_xla_s": xla_mm, "matmuls_at_peak_s": peak_mm,
            "rest_of_step_s": step_s - xla_mm, "step_bound_s": step_s - xla_mm + peak_mm,
            "max_speedup": step_s / (step_s - xla_mm + peak_mm), "tasks": tasks}


def print_ceiling(console: Console, c: dict) -> None:
    table = Table(title=f"{c['model']} on {c['devices']} device(s), mesh {c['mesh']}: step {c['step_xla_s'] * 1e3:.0f} ms "
                        f"(XLA), local matmuls {c['matmuls_xla_s'] * 1e3:.0f} ms of it; all at the FMA peak "
                        f"({c['peak_flops_per_s'] / 1e9:.0f} GFLOP/s): {c['matmuls_at_peak_s'] * 1e3:.0f} ms, "
                        f"step >= {c['step_bound_s'] * 1e3:.0f} ms = at most {c['max_speedup']:.2f}x")
    for col in ("local task", "ops", "XLA ms", "XLA GFLOP/s", "% of peak", "at peak ms"):
        table.add_column(col)
    for t in c["tasks"]:
        table.add_row(t["workload"], str(t["ops"]), f"{t['xla_s'] * 1e3:.2f}", f"{t['xla_flops_per_s'] / 1e9:.0f}",
                      f"{100 * t['xla_flops_per_s'] / c['peak_flops_per_s']:.0f}", f"{t['at_peak_s'] * 1e3:.2f}")
    console.print(table)


def print_case(console: Console, case: dict) -> None:
    table = Table(title=f"{case['model']} on {case['devices']} device(s), mesh {case['mesh']}: "
                        f"step {case['step_tuned_s'] * 1e3:.1f} ms tuned vs {case['step_xla_s'] * 1e3:.1f} ms "
                        f"({case['xla_baseline']}) = {case['speedup']:.2f}x")
    for col in ("op", "local task", "XLA ms", "tuned ms", "speedup", "serves"):
        table.add_column(col)
    for o in case["ops"]:
        ratio = (o["xla_s"] / o["tuned_s"]) if o["tuned_s"] else None
        table.add_row(str(o["op"]), o["workload"], _ms(o["xla_s"]), _ms(o["tuned_s"]),
                      f"{ratio:.2f}x" if ratio else "-", "kernel" if o["used"] else f"XLA ({o['reason']})")
    console.print(table)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=64, help="tuning trials per task (default 64)")
    ap.add_argument("--models", default="gpt,mlp")
    ap.add_argument("--devices", default="1,8")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default 7)")
    ap.add_argument("--db", default=None, help="tuning DB (default: a fresh one under a temporary directory)")
    ap.add_argument("--ceiling", action="store_true",
                    help="no tuning: the FMA peak, XLA's time per local matmul and the best step they allow")
    ap.add_argument("--kernels", choices=["tuned", "cached"], default="tuned",
                    help="cached: use --db's kernels and comparisons as they are (re-time the step only)")
    args = ap.parse_args()
    console = Console(width=140)
    machine = {"cpu_count": os.cpu_count(), "jax": jax.__version__}
    env = {"omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "glibc_tunables": os.environ.get("GLIBC_TUNABLES")}
    if args.ceiling:
        peak = fma_peak_flops()
        return run_all(args, console, "kernels_in_plan_ceiling",
                       {"machine": machine, **env, "peak_flops_per_s": peak, "cases": []},
                       lambda model, n: ceiling_case(model, n, args.rounds, peak), print_ceiling,
                       ("model", "devices", "step_xla_s", "matmuls_xla_s", "step_bound_s", "max_speedup"))
    db = args.db or os.path.join(tempfile.mkdtemp(prefix="autopar-kernels-"), "tuning.db")
    return run_all(args, console, "kernels_in_plan",
                   {"machine": machine, "trials_per_task": args.trials, "kernels": args.kernels, "tuning_db": db,
                    **env, "cases": []},
                   lambda model, n: run_case(model, n, args.trials, args.rounds, db, args.kernels), print_case,
                   ("model", "devices", "step_tuned_s", "step_xla_s", "speedup", "sites_on_kernels", "sites",
                    "plan_and_tune_s"))


def run_all(args, console: Console, name: str, result: dict, run: Callable[[str, int], dict],
            show: Callable[[Console, dict], None], summary: tuple[str, ...]) -> int:
    """`run` every (model, device count) of `args`, each case printed by `show` and added to
    `result`, written to benchmarks/results/<name>_<time>.json after every case."""
    out = os.path.join(ROOT, "benchmarks", "results", f"{name}_{int(time.time())}.json")
    for model in args.models.split(","):
        for n in (int(d) for d in args.devices.split(",")):
            case = run(model, n)
            result["cases"].append(case)
            show(console, case)
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
    print(json.dumps([{k: c[k] for k in summary} for c in result["cases"]], indent=1))
    console.print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
