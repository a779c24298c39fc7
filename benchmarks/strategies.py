"""Benchmark: strategy enumeration and resharding costs for a whole GPT train step.

Target: a 24-layer GPT train step (about 10k ops) enumerates every op's strategies and the
resharding cost of every (producer layout, consumer layout) pair on every edge well inside
the 10 s planning budget.

Run: .venv/bin/python benchmarks/strategies.py [--layers 24] [--mesh 2 4]
Prints a table and writes benchmarks/results/strategies.json.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import warnings

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from autopar.cluster import LogicalMesh  # noqa: E402
from autopar.device_presets import PRESETS  # noqa: E402
from rockmate.graph.trace import trace_graph  # noqa: E402
from autopar.model_zoo import GPTConfig, gpt_abstract_setup  # noqa: E402
from autopar.sharding_costs import ShardingCosts  # noqa: E402

TARGET_S = 10.0


def measure(layers: int, mesh_shape: tuple[int, int]) -> dict:
    mesh = LogicalMesh(mesh_shape, PRESETS["a100-80g"] if "a100-80g" in PRESETS else PRESETS["cpu"],
                       (5e-6, 1e-5), (1 / 200e9, 1 / 25e9))
    step, state, batch = gpt_abstract_setup(GPTConfig(layers=layers, hidden=1024, heads=16, seq=512,
                                                      vocab=32000, batch=8))
    t0 = time.perf_counter()
    graph = trace_graph(step, state, batch)
    trace_s = time.perf_counter() - t0
    costs = ShardingCosts()       # a planning run's memo, fresh
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        per_op = {op.index: costs.strategies(op, graph, mesh) for op in graph.ops}
    enumerate_s = time.perf_counter() - t0
    producer = {v: op.index for op in graph.ops for v in op.outputs}
    pairs = 0
    t0 = time.perf_counter()
    for op in graph.ops:
        for i, v in enumerate(op.inputs):
            if v in graph.literals or v not in producer:
                continue
            srcs = {s.out_specs[graph.ops[producer[v]].outputs.index(v)] for s in per_op[producer[v]]}
            dsts = {s.in_specs[i] for s in per_op[op.index]}
            for a in srcs:
                for b in dsts:
                    costs.reshard(a, b, graph.vars[v], mesh)
                    pairs += 1
    reshard_s = time.perf_counter() - t0
    counts = [len(s) for s in per_op.values()]
    return {"layers": layers, "mesh": f"{mesh_shape[0]}x{mesh_shape[1]}", "ops": len(graph.ops),
            "strategies": sum(counts), "max_per_op": max(counts), "trace_s": trace_s,
            "enumerate_s": enumerate_s, "reshard_pairs": pairs, "reshard_s": reshard_s,
            "unknown_primitives": sorted({str(w.message) for w in caught})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[24])
    parser.add_argument("--mesh", type=int, nargs=2, default=[2, 4])
    args = parser.parse_args()
    rows = [measure(n, tuple(args.mesh)) for n in args.layers]
    table = Table(title=f"strategy enumeration + reshard costs, GPT train step (target < {TARGET_S:.0f} s)")
    cols = ("layers", "mesh", "ops", "strategies", "max_per_op", "trace_s", "enumerate_s", "reshard_pairs", "reshard_s")
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    Console().print(table)
    for r in rows:
        if r["unknown_primitives"]:
            print("warnings:", r["unknown_primitives"])
    met = all(r["enumerate_s"] + r["reshard_s"] < TARGET_S for r in rows)
    out = pathlib.Path(__file__).parent / "results" / "strategies.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"target_s": TARGET_S, "met": met, "rows": rows}, indent=2))
    print(f"target met: {met}; wrote {out}")


if __name__ == "__main__":
    main()
