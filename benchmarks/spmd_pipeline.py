"""The SPMD pipeline (one program, layer scan over a stage axis) vs the per-stage runtime.

CPU part (8 simulated devices): a GPT whose layers are an `nn.scan`, planned and built
through `autopar.parallelize` with `PipeshardParallel(lowering="spmd")`, against the same
GPT with unrolled layers under the per-stage runtime (the only way that runtime can cut
it) and the `nn.scan` GPT under the per-stage runtime (the scan is one layer there), all
with 2 stages and the same micro-batches: planning time, compile time (all programs),
measured step time (interleaved rounds) and programs per step.

Cluster part: Alpa's GPT suite with `nn.scan` layers planned by `autopar.make_plan(...,
lowering="spmd")` for the suite's A100 cluster: predicted step time and TFLOP/s per device,
against the per-stage runtime's prediction for the unrolled model (the newest
`benchmarks/results/pipeline_*.json` row, or re-planned with --per-stage fresh).

Run: .venv/bin/python benchmarks/spmd_pipeline.py [--skip-cpu] [--skip-suite] [--only GPT-1.3B,...]
     [--per-stage recorded|fresh]
Prints JSON rows and a table; writes benchmarks/results/spmd_pipeline_<time>.json.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, ".."))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax                                                              # noqa: E402
import optax                                                            # noqa: E402

import autopar                                                          # noqa: E402
from autopar import model_zoo as mz                                     # noqa: E402

PER_HOST = 8


def cpu_case(rounds: int = 5) -> dict:
    cfg = mz.GPTConfig(vocab=256, seq=64, hidden=128, heads=4, layers=8, batch=16)
    rows = {}
    steps = {}
    for name, scan, lowering in (("spmd", True, "spmd"), ("per-stage", False, "per-stage"),
                                 ("per-stage on the scan", True, "per-stage")):
        step, state, batch = mz.gpt_setup(replace(cfg, scan=scan), optax.sgd(0.1))
        method = autopar.PipeshardParallel(num_micro_batches=4, num_stages=2, lowering=lowering)
        t0 = time.perf_counter()
        plan = autopar.make_plan(step, state, batch, cluster=autopar.Cluster.from_devices(jax.devices()),
                                 method=method)
        plan_s = time.perf_counter() - t0
        pstep = autopar.parallelize(step, method=method)
        t0 = time.perf_counter()
        compiled = pstep.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        programs = sum(len(p) for p in compiled.programs)
        out = pstep(state, batch)
        jax.block_until_ready(out)
        steps[name] = (pstep, state, batch)
        rows[name] = {"lowering": name, "layers": "nn.scan" if scan else "unrolled", "plan_s": plan_s,
                      "compile_s": compile_s, "programs": programs, "predicted_step_s": plan.predicted_time_s,
                      "stages": plan.spmd_pipeline.num_stages if plan.spmd_pipeline else len(plan.stages),
                      "times": []}
    for _ in range(rounds):                 # interleaved: both see the same machine load
        for name, (pstep, state, batch) in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(pstep(state, batch))
            rows[name]["times"].append(time.perf_counter() - t0)
    for r in rows.values():
        r["step_s"] = statistics.median(r.pop("times"))
    return {"model": f"GPT L={cfg.layers} h={cfg.hidden} seq={cfg.seq} batch={cfg.batch}", "devices": 8,
            "micro_batches": 4, "rows": list(rows.values())}


def recorded_per_stage() -> dict[str, dict]:
    """The newest per-stage prediction of each GPT suite model from benchmarks/pipeline.py."""
    best: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(HERE, "results", "pipeline_*.json"))):
        for r in json.load(open(path)):
            if r["model"].startswith("GPT") and r.get("micro_batches_asked", "auto") == "auto":
                best[r["model"]] = {**r, "source": os.path.basename(path)}
    return best


def suite_case(case, per_stage: str, recorded: dict[str, dict]) -> dict:
    cfg, N = replace(case.model, scan=True), case.devices
    cluster = autopar.Cluster.preset("a100-80g", max(1, N // PER_HOST), min(PER_HOST, N))
    step, state, batch = mz.gpt_abstract_setup(cfg)
    t0 = time.perf_counter()
    plan = autopar.make_plan(step, state, batch, cluster=cluster,
                             method=autopar.PipeshardParallel(num_micro_batches="auto", lowering="spmd"))
    plan_s = time.perf_counter() - t0
    sp = plan.spmd_pipeline
    row = {"model": case.name, "devices": N, "spmd": {
        "stages": sp.num_stages, "data_parallel": sp.data_parallel, "micro_batches": sp.num_micro_batches,
        "predicted_step_s": sp.predicted_step_s, "tflops_per_device": cfg.train_flops / sp.predicted_step_s / N / 1e12,
        "memory_gib": plan.stages[0].memory_bytes / 2**30, "plan_s": plan_s}}
    if per_stage == "fresh":
        ustep, ustate, ubatch = mz.gpt_abstract_setup(case.model)
        t0 = time.perf_counter()
        p = autopar.make_plan(ustep, ustate, ubatch, cluster=cluster,
                              method=autopar.PipeshardParallel(num_micro_batches="auto", lowering="per-stage"))
        row["per_stage"] = {"predicted_step_s": p.predicted_time_s, "stages": len(p.stages),
                            "micro_batches": p.num_micro_batches, "plan_s": time.perf_counter() - t0,
                            "source": "planned now"}
    elif case.name in recorded:
        r = recorded[case.name]
        row["per_stage"] = {"predicted_step_s": r["predicted_step_s"], "stages": len(r["plan"]["stages"]),
                            "micro_batches": r["plan"]["num_micro_batches"], "plan_s": r["planning_s"],
                            "source": r["source"]}
    if "per_stage" in row:
        ps = row["per_stage"]
        ps["tflops_per_device"] = cfg.train_flops / ps["predicted_step_s"] / N / 1e12
        row["spmd_over_per_stage"] = ps["predicted_step_s"] / sp.predicted_step_s
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--skip-suite", action="store_true")
    ap.add_argument("--only", default=None, help="suite models by name, comma-separated")
    ap.add_argument("--per-stage", default="recorded", choices=["recorded", "fresh"])
    args = ap.parse_args(argv)
    out = {"cpu": None, "suite": []}
    path = os.path.join(HERE, "results", f"spmd_pipeline_{int(time.time())}.json")

    def save():
        with open(path + ".tmp", "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    if not args.skip_cpu:
        out["cpu"] = cpu_case()
        save()
        print(json.dumps(out["cpu"], indent=1))
    if not args.skip_suite:
        only = {n.strip().lower() for n in args.only.split(",")} if args.only else None
        recorded = recorded_per_stage()
        for case in mz.GPT_SUITE:
            if (only and case.name.lower() not in only) or case.devices < 2:   # a pipeline needs 2 devices
                continue
            out["suite"].append(suite_case(case, args.per_stage, recorded))
            save()
            print(json.dumps(out["suite"][-1]), flush=True)
    print(f"wrote {path}")
    if out["cpu"]:
        print("\n| lowering | layers | stages | plan s | compile s | programs | step s (measured) |")
        print("|---|---|---|---|---|---|---|")
        for r in out["cpu"]["rows"]:
            print(f"| {r['lowering']} | {r['layers']} | {r['stages']} | {r['plan_s']:.1f} | {r['compile_s']:.1f} | "
                  f"{r['programs']} | {r['step_s']:.4f} |")
    if out["suite"]:
        print("\n| model | devices | SPMD (S x D, M) | SPMD TFLOP/s/dev | per-stage TFLOP/s/dev | per-stage/SPMD time | "
              "SPMD plan s |")
        print("|---|---|---|---|---|---|---|")
        for r in out["suite"]:
            s, p = r["spmd"], r.get("per_stage")
            print(f"| {r['model']} | {r['devices']} | {s['stages']}x{s['data_parallel']}, {s['micro_batches']} | "
                  f"{s['tflops_per_device']:.1f} | {p['tflops_per_device']:.1f} | {r['spmd_over_per_stage']:.2f} | "
                  f"{s['plan_s']:.1f} |" if p else f"| {r['model']} | {r['devices']} | ... | "
                  f"{s['tflops_per_device']:.1f} | - | - | {s['plan_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
