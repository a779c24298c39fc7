"""Intra-op planning benchmark: GPT 125M..2.6B on 8 devices of the a100-80g preset.

For auto (ShardParallel over every 2-D mesh) and the baselines DataParallel, ZeRO3 and
Megatron(tp=2,4,8): planning time, predicted step time, predicted communication bytes per
device, predicted per-device memory, and (with --compile) the communication bytes read from
the compiled HLO on 8 simulated CPU devices. Prints a table and writes
benchmarks/results/intra_op.json.

    python benchmarks/intra_op.py                 # all models, planning only
    python benchmarks/intra_op.py --models 125M --compile
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import autopar  # noqa: E402
from autopar.hlo_collectives import bytes_by_kind  # noqa: E402
from autopar.model_zoo import GPTConfig, gpt_abstract_setup  # noqa: E402

MODELS = {  # GPT-3 paper shapes (seq 1024, vocab 51200)
    "125M": dict(layers=12, hidden=768, heads=12),
    "350M": dict(layers=24, hidden=1024, heads=16),
    "760M": dict(layers=24, hidden=1536, heads=16),
    "1.3B": dict(layers=24, hidden=2048, heads=32),
    "2.6B": dict(layers=32, hidden=2560, heads=32),
}
METHODS = {
    "auto": autopar.ShardParallel(),
    "dp": autopar.DataParallel(),
    "zero3": autopar.ZeRO3(),
    "megatron2": autopar.Megatron(tp=2),
    "megatron4": autopar.Megatron(tp=4),
    "megatron8": autopar.Megatron(tp=8),
}


def run_one(name: str, method_name: str, cluster, batch: int, seq: int, compile_hlo: bool) -> dict:
    cfg = GPTConfig(vocab=51200, seq=seq, batch=batch, **MODELS[name])
    step, state, data = gpt_abstract_setup(cfg)
    method = METHODS[method_name]
    row = dict(model=name, method=method_name, params=cfg.num_params)
    t0 = time.perf_counter()
    try:
        plan = autopar.make_plan(step, state, data, cluster=cluster, method=method,
                                 memory_budget=cluster.device.memory_bytes, batch_argnums=(1,))
    except (autopar.MemoryBudgetError, autopar.MeshDivisibilityError) as e:
        row.update(error=str(e).split(";")[0])
        return row
    st = plan.stages[0]
    row.update(plan_s=time.perf_counter() - t0, mesh=f"{st.mesh_shape[0]}x{st.mesh_shape[1]}",
               step_s=st.predicted_time_s, comm_bytes=st.comm_bytes, memory_bytes=st.memory_bytes,
               args_bytes=st.argument_bytes, solver=st.solver_status,
               tflops_per_device=cfg.train_flops / st.predicted_time_s / 8 / 1e12)
    if compile_hlo:     # the same plan on 8 simulated CPU devices, compiled from abstract inputs
        t1 = time.perf_counter()
        pstep = autopar.parallelize(step, plan=plan, devices=jax.devices()[:8])
        compiled = pstep.lower(state, data).compile()
        row.update(compiled_comm_bytes=sum(bytes_by_kind(compiled.as_text()).values()), compile_s=time.perf_counter() - t1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--compile", action="store_true", help="also compile on 8 CPU devices and read HLO bytes")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "intra_op.json"))
    args = ap.parse_args()
    cluster = autopar.Cluster.preset("a100-80g", 1, 8)
    rows = []
    con = Console(width=170)
    for m in args.models.split(","):
        for meth in args.methods.split(","):
            row = run_one(m, meth, cluster, args.batch, args.seq, args.compile)
            rows.append(row)
            con.print(row)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(rows, indent=1))
    t = Table(title=f"intra-op plans, GPT on 1x8 a100-80g (batch {args.batch}, seq {args.seq})")
    for c in ("model", "method", "mesh", "plan s", "step ms", "TFLOP/s/dev", "comm MiB/dev", "HLO comm MiB", "mem GiB/dev", "solver"):
        t.add_column(c)
    for r in rows:
        if "error" in r:
            t.add_row(r["model"], r["method"], "-", "-", "-", "-", "-", "-", "-", r["error"][:40])
            continue
        t.add_row(r["model"], r["method"], r["mesh"], f"{r['plan_s']:.1f}", f"{r['step_s'] * 1e3:.1f}",
                  f"{r['tflops_per_device']:.1f}", f"{r['comm_bytes'] / 2**20:.1f}",
                  f"{r['compiled_comm_bytes'] / 2**20:.1f}" if "compiled_comm_bytes" in r else "-",
                  f"{r['memory_bytes'] / 2**30:.2f}", r["solver"])
    con.print(t)
    best = {}
    for r in rows:
        if "error" not in r and r["method"] != "auto":
            best[r["model"]] = min(best.get(r["model"], float("inf")), r["step_s"])
    for r in rows:
        if r["method"] == "auto" and "error" not in r:
            con.print(f"{r['model']}: auto {r['step_s'] * 1e3:.2f} ms vs best baseline {best.get(r['model'], float('nan')) * 1e3:.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
