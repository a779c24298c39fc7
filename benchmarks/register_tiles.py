"""W1 (matmul 512^3) register tiles of every shape R x (16 V) for R in 1..16, V in 1..4 and k
tiles of 16, 64 and 256, measured on all cores, against the analytic prior's estimates.

    .venv/bin/python benchmarks/register_tiles.py [--out benchmarks/results/register_tiles.json]

The schedules differ only in the tile: i = 4 x (128 / R) x R, j = (512 / 16 V) x 16 V, the four
row blocks parallel, loops i.0, i.1, j.1, k.0, i.2, j.2, k.1, i.3, j.3. Prints a table and one
JSON object with each schedule's latency and estimate and the prior's pairwise accuracy, over
all of them and over those within 1.5 ms (the region the search ends up in).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cost_model import pairwise_accuracy  # noqa: E402
from search import Task, build  # noqa: E402
from search.buffers import aligned_copy, aligned_empty  # noqa: E402
from search.lower import lower  # noqa: E402
from search.prior import estimate_s  # noqa: E402
from search.schedule import replay  # noqa: E402

from kernels import _time  # noqa: E402


def schedule(rows: int, vectors: int, k_tile: int) -> list[dict]:
    """W1's multi-level tiling with an R x 16V register tile and a k tile of `k_tile`."""
    return [{"kind": "split", "stage": "C", "iter": "i", "factors": [1, 128 // rows, rows]},
            {"kind": "split", "stage": "C", "iter": "j", "factors": [1, 512 // (16 * vectors), 16 * vectors]},
            {"kind": "split", "stage": "C", "iter": "k", "factors": [k_tile]},
            {"kind": "reorder", "stage": "C",
             "order": ["i.0", "j.0", "i.1", "j.1", "k.0", "i.2", "j.2", "k.1", "i.3", "j.3"]},
            {"kind": "fuse", "stage": "C", "iters": ["i.0", "j.0"]},
            {"kind": "annotate", "stage": "C", "iter": "i.0@j.0", "ann": "parallel"},
            {"kind": "annotate", "stage": "C", "iter": "j.3", "ann": "vectorize"},
            {"kind": "pragma", "stage": "C", "auto_unroll_max_step": 64}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "register_tiles.json"))
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    task = Task.matmul(512, 512, 512)
    inputs = task.random_inputs(0)
    call_args = [aligned_copy(inputs[n]) for n, _ in task.input_shapes]
    out = aligned_empty(task.output_shape, np.float32)
    rows = []
    for r in (1, 2, 4, 8, 16):
        for v in (1, 2, 4):
            for k in (16, 64, 256):
                steps = schedule(r, v, k)
                kernel = build(task, steps)
                ms = _time(lambda: kernel(*call_args, out=out)) * 1e3
                est = estimate_s(lower(replay(task.dag, steps))) * 1e3
                rows.append({"rows": r, "vectors": v, "k_tile": k, "ms": ms, "estimate_ms": est})
    ms = np.array([x["ms"] for x in rows])
    est = np.array([x["estimate_ms"] for x in rows])
    near = ms < 1.5
    result = {"schedules": rows, "pairwise_accuracy": pairwise_accuracy(-est, ms),
              "pairwise_accuracy_within_1.5ms": pairwise_accuracy(-est[near], ms[near]),
              "within_1.5ms": int(near.sum())}
    t = Table(title="W1 register tiles: measured against the prior")
    for c in ("tile (rows x columns)", "k tile", "measured ms", "estimate ms"):
        t.add_column(c)
    for x in rows:
        t.add_row(f"{x['rows']} x {16 * x['vectors']}", str(x["k_tile"]), f"{x['ms']:.3f}", f"{x['estimate_ms']:.3f}")
    Console(width=120).print(t)
    print(f"pairwise accuracy {result['pairwise_accuracy']:.3f}; within 1.5 ms ({result['within_1.5ms']}): "
          f"{result['pairwise_accuracy_within_1.5ms']:.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
