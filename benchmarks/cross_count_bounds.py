"""Checks the pipeline planner's bounds across micro-batch counts against the layer ILP on
Alpa's suite models (the same layers the planner prices, traced from abstract values):

- per sample: a layer on micro-batches k times smaller costs at least 1/k of its cost on the
  larger ones (`_Candidates._scaled_bound`, `_layer_bound`);
- shrinking: where every layout of the larger micro-batch is valid on the smaller
  (`layer_cost.shrinks_evenly`), the larger costs at least what the smaller does.

For each model: its first, middle and last layer at `--counts` micro-batch counts spread
evenly over its candidates (from whole micro-batches the devices divide to ones they do
not), every pair of counts where one divides the other, on the logical meshes of submeshes up to
the model's device count, both parameter modes. A violation would let the planner skip a
candidate that could win; the script prints every one.

Run: .venv/bin/python benchmarks/cross_count_bounds.py [--models GPT-6.7B,MoE-2.4B,WResNet-1B] [--counts 6]
Prints a table and writes benchmarks/results/cross_count_bounds_<time>.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from autopar import model_zoo as mz                                      # noqa: E402
from autopar.api import signature_of                                     # noqa: E402
from autopar.interface import PlanRequest                                # noqa: E402
from autopar.pipeline.layer_cost import LayerSolver, shrinks_evenly      # noqa: E402
from autopar.pipeline.method import PipeshardParallel                     # noqa: E402
from autopar.pipeline.submesh import logical_mesh_shapes                  # noqa: E402
from autopar.pipeline.layers import cut_layers                            # noqa: E402
from pipeline import SETUPS, cluster_for                                  # noqa: E402

SUBMESHES = [(1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8)]


def check(case, counts: int) -> dict:
    """Both bounds on every pair of `counts` of the model's micro-batch counts."""
    cfg, N = case.model, case.devices
    step, state, batch = SETUPS[type(cfg)](cfg)
    request = PlanRequest(fun=step, args=(state, batch), kwargs={}, cluster=cluster_for(N),
                          signature=signature_of((state, batch), {}), remat="none")
    planner = PipeshardParallel(num_micro_batches="auto")._planner(request)
    cuts = planner.cut_options()[-1]      # the most layers
    every = []
    for B in planner.micro_batch_candidates():
        try:
            traced = planner.tracer.at(B)
            cut_layers(traced.loss, cuts, traced.diff_mask)
            every.append(B)
        except ValueError:    # a micro-batch smaller than an MoE expert group; a loss with other ops
            pass
    Bs = sorted({every[round(i * (len(every) - 1) / max(counts - 1, 1))] for i in range(counts)})
    layers = {B: planner.layer_graphs(planner.tracer.at(B), cuts) for B in Bs}
    shapes = sorted({s for sub in SUBMESHES if sub[0] * sub[1] <= N for s in logical_mesh_shapes(sub)})
    solver = LayerSolver(solver="highs-lp")
    per_sample = shrinking = 0
    violations = []
    for fewer, more in itertools.combinations(Bs, 2):
        if more % fewer:
            continue
        for l in sorted({0, (len(cuts) - 1) // 2, len(cuts) - 2}):
            big, small = layers[fewer][l], layers[more][l]
            for shape in shapes:
                mesh = planner.logical_mesh(shape)
                even = shrinks_evenly(big, small, shape)
                for params in ("fast", "sharded"):
                    t_big, t_small = solver(big, mesh, params).time_s, solver(small, mesh, params).time_s
                    per_sample += 1
                    if t_small * (1 + 1e-9) < t_big * fewer / more:
                        violations.append({"bound": "per sample", "B": [fewer, more], "layer": l, "mesh": shape,
                                           "params": params, "larger_s": t_big, "smaller_s": t_small})
                    if even:
                        shrinking += 1
                        if t_big * (1 + 1e-9) < t_small:
                            violations.append({"bound": "shrinking", "B": [fewer, more], "layer": l, "mesh": shape,
                                               "params": params, "larger_s": t_big, "smaller_s": t_small})
    return {"model": case.name, "micro_batch_counts": Bs, "meshes": shapes, "per_sample_checked": per_sample,
            "shrinking_checked": shrinking, "ilp_solves": solver.solves, "violations": violations}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="GPT-6.7B,MoE-2.4B,WResNet-1B")
    ap.add_argument("--counts", type=int, default=6, help="this many micro-batch counts of each model, spread over its candidates")
    args = ap.parse_args(argv)
    cases = {c.name.lower(): c for c in (*mz.GPT_SUITE, *mz.MOE_SUITE, *mz.WRESNET_SUITE)}
    out_dir = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"cross_count_bounds_{int(time.time())}.json")
    rows = []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        row = check(cases[name.strip().lower()], args.counts)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        with open(path + ".tmp", "w") as f:
            json.dump(rows, f, indent=1, default=str)
        os.replace(path + ".tmp", path)
        for v in row["violations"]:
            print("VIOLATION", row["model"], v, flush=True)
    print(f"wrote {path}")
    print("\n| model | counts | per-sample pairs | shrinking pairs | violations | s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {'/'.join(map(str, r['micro_batch_counts']))} | {r['per_sample_checked']} | "
              f"{r['shrinking_checked']} | {len(r['violations'])} | {r['seconds']:.0f} |")
    return 1 if any(r["violations"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
