"""How well the analytic prior (search.prior) alone ranks measured schedules, per workload of
one or more tuning DBs (e.g. those benchmarks/kernels.py leaves in benchmarks/results/).

    .venv/bin/python benchmarks/prior_accuracy.py benchmarks/results/kernels_db_*_random.sqlite

For each DB and task: pairwise accuracy of -estimate against the measured latencies (0.5 is
chance), and how far the best measured latency among the estimate's top 16 and top 64 is from
the best of all the task's records. Prints a table and one JSON object.
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
from search import Task  # noqa: E402
from search.database import TuningDB  # noqa: E402
from search.lower import lower  # noqa: E402
from search.measure import best_run_s  # noqa: E402
from search.prior import estimate_s  # noqa: E402
from search.schedule import replay  # noqa: E402


def evaluate(path: str) -> dict[str, dict]:
    """Per workload key of the DB at `path`: records, accuracy, top-16 / top-64 ratios."""
    db = TuningDB(path)
    try:
        by_task: dict[str, list] = {}
        for r in db.records():
            if r.ok:
                by_task.setdefault(r.workload_key, []).append(r)
    finally:
        db.close()
    out = {}
    for key, recs in by_task.items():
        dag = Task.from_dict(recs[0].task).dag
        est = np.array([estimate_s(lower(replay(dag, r.schedule))) for r in recs])
        lat = np.array([best_run_s(r) for r in recs])
        order = np.argsort(est)
        out[key] = {"records": len(recs), "pairwise_accuracy": pairwise_accuracy(-est, lat),
                    "top16_vs_best": float(lat[order[:16]].min() / lat.min()),
                    "top64_vs_best": float(lat[order[:64]].min() / lat.min())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dbs", nargs="+")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    result = {p: evaluate(p) for p in args.dbs}
    t = Table(title="analytic prior alone against measurements")
    for c in ("DB", "task", "records", "pairwise accuracy", "best of top 16 / best", "best of top 64 / best"):
        t.add_column(c)
    for p, rows in result.items():
        for key, r in rows.items():
            t.add_row(os.path.basename(p), key, str(r["records"]), f"{r['pairwise_accuracy']:.3f}",
                      f"{r['top16_vs_best']:.2f}x", f"{r['top64_vs_best']:.2f}x")
    Console(width=160).print(t)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
