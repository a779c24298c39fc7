"""Search policies compared at a small trial budget over several seeds: random search,
evolutionary search + cost model from a cold start ("evo"), and the same with the cost model
pre-trained on a tuning DB that holds records of the *other* workloads ("evo+transfer": the
situation of a user whose DB already has other operators; the model ranks within each task).

    .venv/bin/python benchmarks/policies.py [--trials 64] [--seeds 0,1,2] [--workloads W1,W2,W3,W4,W5]

Per seed: every workload is tuned cold by "evo" into one DB and by "random" into another; then
each workload is tuned by "evo+transfer" on a copy of the cold evo DB, so its model learns from
the other workloads' cold evo records of that seed (`trials` each) and never from its own.
Prints a table (median over seeds of the best latency after `--trials`, and wins against random
with the same seed) and writes benchmarks/results/policies.json after every run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernels import WORKLOADS, tuning_run  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "policies.json")
POLICIES = {"evo+transfer": ("evolutionary", True), "evo": ("evolutionary", False), "random": ("random", False)}


def summarize(runs: dict) -> dict:
    """Per workload and policy: median best latency over seeds; wins of each evo variant over random."""
    out = {}
    for w, per_policy in runs.items():
        row = {}
        for name, per_seed in per_policy.items():
            row[name] = statistics.median(r["best_s"] for r in per_seed.values())
        for name in ("evo+transfer", "evo"):
            seeds = set(per_policy.get(name, {})) & set(per_policy.get("random", {}))
            if not seeds:
                continue
            row[f"{name} wins"] = f"{sum(per_policy[name][s]['best_s'] < per_policy['random'][s]['best_s'] for s in seeds)}/{len(seeds)}"
        out[w] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--workloads", default="W1,W2,W3,W4,W5")
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args()
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    runs: dict = {}
    result = {"command": " ".join(sys.argv), "trials": args.trials,
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "runs": runs}
    names = args.policies.split(",")
    workloads = args.workloads.split(",")
    for seed in (int(s) for s in args.seeds.split(",")):
        dbdir = tempfile.mkdtemp(prefix=f"policies_s{seed}_")
        cold_db = os.path.join(dbdir, "evo.sqlite")

        def run(w: str, name: str, db: str) -> None:
            policy, transfer = POLICIES[name]
            r = tuning_run(WORKLOADS[w][1], policy, args.trials, db, checkpoints=(), seed=seed, transfer=transfer)
            runs.setdefault(w, {}).setdefault(name, {})[str(seed)] = r
            result["summary"] = summarize(runs)
            with open(OUT, "w") as f:
                json.dump(result, f, indent=1)
            print(w, name, seed, f"{r['best_s'] * 1e3:.3f} ms", f"{r['tuning_time_s']:.0f} s", flush=True)

        for w in workloads:
            for name in ("evo", "random"):
                if name in names:
                    run(w, name, cold_db if name == "evo" else os.path.join(dbdir, "random.sqlite"))
        if "evo+transfer" in names:
            for w in workloads:
                db = os.path.join(dbdir, f"transfer_{w}.sqlite")
                shutil.copyfile(cold_db, db)
                run(w, "evo+transfer", db)
    print_table(result)


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    summary = result["summary"]
    names = [n for n in POLICIES if any(n in row for row in summary.values())]
    t = Table(title=f"best latency after {result['trials']} trials, median over seeds (ms)")
    t.add_column("W")
    for n in names:
        t.add_column(n, justify="right")
    t.add_column("evo+transfer wins", justify="right")
    t.add_column("evo wins", justify="right")
    for w, row in summary.items():
        t.add_row(w, *[f"{row[n] * 1e3:.3f}" if n in row else "-" for n in names],
                  row.get("evo+transfer wins", "-"), row.get("evo wins", "-"))
    Console().print(t)


if __name__ == "__main__":
    main()
