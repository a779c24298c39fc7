"""Alpa's weak-scaling suite planned through the real path: each model's train step is
traced from abstract values and planned by PipeshardParallel (micro-batches "auto") for
an A100-80GB cluster (8 per host), exactly as `autopar.make_plan` does. For each config:
planning wall time (tracing included), the chosen plan, the predicted TFLOP/s per device,
and the best plan of an exhaustive dp x tp x pp x B grid (Megatron-style: pp stages of
equal layers, each on a (dp, tp) logical mesh with tp inside a host) priced by the same
cost model: its stages' costs come from the same layer ILPs on the grid point's mesh
(best of the parameter and remat options that fit), the same composition and the same
1F1B latency and memory model.

Run: .venv/bin/python benchmarks/pipeline.py [--family gpt|moe|wresnet|all] [--only NAME] [--no-grid]
     [--micro-batches auto|N]
Prints a table and writes benchmarks/results/pipeline_<time>.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np                                                       # noqa: E402

from autopar.api import signature_of                                     # noqa: E402
from autopar.cluster import Cluster                                      # noqa: E402
from autopar.interface import PlanRequest                                # noqa: E402
from autopar import model_zoo as mz                                      # noqa: E402
from autopar.pipeline.method import PipeshardParallel                     # noqa: E402
from autopar.pipeline.best_first import best_first, bound_then_exact     # noqa: E402
from autopar.pipeline.planner import PARAM_MODES, REMAT_OPTIONS, in_flight  # noqa: E402
from autopar.pipeline.record import to_plan                               # noqa: E402
from autopar.pipeline.submesh import logical_mesh_shapes                  # noqa: E402

PER_HOST = 8
SETUPS = {mz.GPTConfig: mz.gpt_abstract_setup, mz.MoEConfig: mz.moe_abstract_setup,
          mz.WResNetConfig: mz.wresnet_abstract_setup}
SUITES = {"gpt": mz.GPT_SUITE, "moe": mz.MOE_SUITE, "wresnet": mz.WRESNET_SUITE}


def cluster_for(devices: int) -> Cluster:
    per_host = min(PER_HOST, devices)
    return Cluster.preset("a100-80g", devices // per_host, per_host)


def submesh_of(devices: int) -> tuple[int, int] | None:
    """The Alpa submesh holding `devices` (1 x 2^k in a host, or whole hosts)."""
    if devices <= PER_HOST:
        return (1, devices) if PER_HOST % devices == 0 else None
    return (devices // PER_HOST, PER_HOST) if devices % PER_HOST == 0 else None


def grid_best(planner, B_values, limit):
    """Best (dp, tp, pp, B) pipeline of equal-layer stages, priced lazily from the same
    candidates the planner uses (a point is priced unless its lower bound is no better
    than the best priced point)."""
    N = planner.cluster.num_devices
    L = len(planner.cut_options()[0]) - 1
    points = []
    for B in B_values:
        for tp in (1, 2, 4, 8):
            for pp in range(1, min(L, N) + 1):
                if N % (tp * pp) or tp > PER_HOST:
                    continue
                dp = N // (tp * pp)
                sub = submesh_of(dp * tp)
                if sub is None or (dp, tp) not in logical_mesh_shapes(sub):
                    continue
                points.append((B, dp, tp, pp, sub))

    def latency(point, exact: bool) -> float:
        B, dp, tp, pp, sub = point
        cand = planner.problem(B, 0, shapes=[sub], num_stages=pp)
        k = cand.logical[0].index((dp, tp))
        bounds = np.linspace(0, L, pp + 1).round().astype(int)
        times, its = [], []
        for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            flight = in_flight(planner.method.schedule, pp - s, B)
            best = None
            for p in range(len(PARAM_MODES)):
                for r in cand.remats:
                    if exact:
                        cand.price(a, b - 1, 0, k, p, r)
                    o = cand.index(k, p, r)
                    mem = cand.weight[a, b - 1, 0, 0, o] + max(cand.act[a, b - 1, 0, 0, o] * flight
                                                              + cand.working[a, b - 1, 0, 0, o],
                                                              cand.update[a, b - 1, 0, 0, o])
                    t = cand.time[a, b - 1, 0, 0, o]
                    if mem <= limit and (best is None or t < best[0]):
                        best = (t, cand.iteration[a, b - 1, 0, 0, o])
            if best is None:
                raise ValueError("a stage fits no option")
            times.append(best[0])
            its.append(best[1])
        return float(sum(times) + sum(its) + (B - 1) * max(times))

    priced = []
    found = best_first(points, bound_then_exact(lambda p: latency(p, False),
                                                lambda p: priced.append(p) or latency(p, True)))
    return found.candidate, found.latency_s, len(points), len(priced)


def run_case(case, grid: bool, micro_batches="auto") -> dict:
    cfg, N = case.model, case.devices
    step, state, batch = SETUPS[type(cfg)](cfg)
    cluster = cluster_for(N)
    method = PipeshardParallel(num_micro_batches=micro_batches)
    request = PlanRequest(fun=step, args=(state, batch), kwargs={}, cluster=cluster,
                          signature=signature_of((state, batch), {}), remat="auto")
    t0 = time.perf_counter()
    planner = method._planner(request)
    decision = planner.plan()
    plan = to_plan(decision, method_name=method.name, schedule=method.schedule, signature=request.signature,
                   cluster=cluster, memory_budget_bytes=None, device_ids=tuple(range(N)),
                   planning_s=time.perf_counter() - t0)
    planning_s = time.perf_counter() - t0
    flops = cfg.train_flops
    row = {
        "model": case.name, "devices": N, "micro_batches_asked": micro_batches, "planning_s": planning_s,
        "predicted_step_s": plan.predicted_time_s,
        "tflops_per_device": flops / plan.predicted_time_s / N / 1e12,
        "plan": {"num_micro_batches": plan.num_micro_batches, "layers": plan.pipeline.num_layers,
                 "stages": [{"layers": list(s.layer_range), "submesh": list(s.submesh), "mesh": list(s.mesh_shape),
                             "param_mode": s.param_mode, "remat": s.remat.mode, "in_flight": s.in_flight,
                             "memory_gib": s.memory_bytes / 2**30} for s in plan.stages]},
        "search": plan.pipeline.search.__dict__,
    }
    if grid:
        t1 = time.perf_counter()
        point, latency, points, priced = grid_best(planner, planner.micro_batch_candidates(),
                                                   cluster.device.memory_bytes)
        B, dp, tp, pp, _ = point
        row["grid"] = {"B": B, "dp": dp, "tp": tp, "pp": pp, "predicted_step_s": latency,
                       "tflops_per_device": flops / latency / N / 1e12, "points": points, "priced": priced,
                       "search_s": time.perf_counter() - t1}
        row["auto_over_grid"] = latency / plan.predicted_time_s
    return row


def describe(row: dict) -> str:
    stages = row["plan"]["stages"]
    meshes = sorted({tuple(s["mesh"]) for s in stages})
    remat = sum(s["remat"] != "none" for s in stages)
    return (f"{len(stages)} stage{'s' if len(stages) > 1 else ''}, B={row['plan']['num_micro_batches']}, "
            f"meshes {','.join(f'{a}x{b}' for a, b in meshes)}" + (f", remat in {remat}" if remat else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="gpt", choices=[*SUITES, "all"])
    ap.add_argument("--only", default=None, help="configs by name, comma-separated, e.g. GPT-350M,GPT-39B")
    ap.add_argument("--no-grid", action="store_true")
    ap.add_argument("--micro-batches", default="auto",
                    help="auto (the planner chooses), or a number fixed as Alpa's users do")
    args = ap.parse_args(argv)
    families = list(SUITES) if args.family == "all" else [args.family]
    only = {n.strip().lower() for n in args.only.split(",")} if args.only else None
    out_dir = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"pipeline_{int(time.time())}.json")
    rows = []
    for fam in families:
        for case in SUITES[fam]:
            if only and case.name.lower() not in only:
                continue
            B = args.micro_batches if args.micro_batches == "auto" else int(args.micro_batches)
            row = run_case(case, grid=not args.no_grid, micro_batches=B)
            rows.append(row)
            with open(path + ".tmp", "w") as f:      # after every config: a killed run keeps what it measured
                json.dump(rows, f, indent=1, default=str)
            os.replace(path + ".tmp", path)
            grid = row.get("grid")
            print(f"{row['model']:>14} {row['devices']:>3} dev  auto {row['tflops_per_device']:6.1f} TFLOP/s/dev"
                  + (f"  grid {grid['tflops_per_device']:6.1f} (dp{grid['dp']} tp{grid['tp']} pp{grid['pp']} "
                     f"B={grid['B']})  auto/grid {row['auto_over_grid']:.3f}" if grid else "")
                  + f"  planned in {row['planning_s']:.1f} s  [{describe(row)}]", flush=True)
    print(f"wrote {path}")
    print("\n| model | devices | auto TFLOP/s/dev | grid TFLOP/s/dev | auto/grid | auto plan | planning s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        g = r.get("grid")
        grid = f"{g['tflops_per_device']:.1f} (dp{g['dp']} tp{g['tp']} pp{g['pp']} B={g['B']}) | {r['auto_over_grid']:.3f}" \
            if g else "- | -"
        print(f"| {r['model']} | {r['devices']} | {r['tflops_per_device']:.1f} | {grid} | {describe(r)} | "
              f"{r['planning_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
