"""Benchmark: time to turn a long jaxpr into an OpGraph (target: 10,000 equations < 10 s).

Run: .venv/bin/python benchmarks/graph_trace.py [--layers 2500 5000]
Prints a table and writes benchmarks/results/graph_trace.json.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from autopar.graph import trace_graph  # noqa: E402
from rockmate.graph.trace import graph_from_jaxpr  # noqa: E402

TARGET_S = 10.0  # for 10,000 equations, make_jaxpr included


def chain(x: jax.Array, ws: jax.Array) -> jax.Array:
    """A layer = slice, squeeze, dot_general, tanh: 4 equations."""
    for i in range(ws.shape[0]):
        x = jnp.tanh(x @ ws[i])
    return x


def measure(layers: int) -> dict[str, float]:
    x, ws = jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((layers, 16, 16), jnp.float32)
    start = time.perf_counter()
    closed = jax.make_jaxpr(chain)(x, ws)
    make_jaxpr_s = time.perf_counter() - start
    start = time.perf_counter()
    graph_from_jaxpr(closed)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    graph = trace_graph(chain, x, ws)
    total_s = time.perf_counter() - start
    return {"layers": layers, "equations": len(closed.jaxpr.eqns), "ops": len(graph.ops),
            "make_jaxpr_s": make_jaxpr_s, "graph_build_s": build_s, "trace_graph_s": total_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[250, 2500, 5000])
    rows = [measure(n) for n in parser.parse_args().layers]
    table = Table(title=f"trace_graph on a dot+tanh chain (target: 10k equations < {TARGET_S:.0f} s)")
    for col in ("layers", "equations", "ops", "make_jaxpr_s", "graph_build_s", "trace_graph_s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()))
    Console().print(table)
    ten_k = [r for r in rows if r["equations"] >= 10_000]
    met = all(r["trace_graph_s"] * 10_000 / r["equations"] < TARGET_S for r in ten_k) if ten_k else None
    out = pathlib.Path(__file__).parent / "results" / "graph_trace.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"target_s_per_10k_equations": TARGET_S, "target_met": met, "rows": rows}, indent=2))
    print(f"target met: {met}; wrote {out}")


if __name__ == "__main__":
    main()
