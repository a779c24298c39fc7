"""Token-level pipelining (TeraPipe) under the cluster model, through the real path: each
GPT's train step is traced from abstract values and planned by PipeshardParallel with
token_slices="auto" (TeraPipe's DP over slicings and batch splits), exactly as
`autopar.make_plan` does. For each config: planning wall time (tracing and the slicing
DP included), the predicted step time of the sliced plan, of the same planner's best plan
with whole sequences (micro-batches only), and of the best uniform slicing on the same
stages.

Configurations (TeraPipe, Li et al. ICML'21): GPT-3 1B / 13B / 44B / 175B at sequence
length 2048, fp16, on p3.16xlarge hosts (8 V100-16GB, NVLink inside, 25 Gbps between
hosts); one pipeline stage per host (24, 40, 48 and 48 hosts), the ILP shards each stage
over its 8 GPUs, no data parallelism; global batches 72, 32, 8 and 2 sequences. The
micro-batch planner runs with one sequence per micro-batch (B = batch: what
num_micro_batches="auto" chooses for 1B, 13B and 44B anyway, in 57-102 s), and TeraPipe's
DP then chooses the slicing; the remat option is the planner's ("auto"). Plus
long-sequence variants of the 13B model (8k and 32k tokens) on 8 hosts of 8 H100s.

Run: .venv/bin/python benchmarks/terapipe.py [--only NAME,...] [--cpu] [--check-stages 0,4]
Prints a table and writes benchmarks/results/terapipe_<time>.json. --cpu instead runs the
test GPT on this machine's 8 simulated devices, token pipeline vs micro-batch pipeline,
slices priced by the cost model and by measured slice times (profile=True): each plan's
predicted step, its measured step time and the first stage's peak residual bytes.
--check-stages compiles those stages' programs for the plan's longest slice on simulated
CPU devices and compares XLA's temp memory with the planned working memory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


@dataclass(frozen=True)
class Case:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    hosts: int
    device: str = "v100-16g"


CASES = [
    Case("GPT3-1B", 24, 2048, 16, 2048, 72, 24),
    Case("GPT3-13B", 40, 5120, 40, 2048, 32, 40),
    Case("GPT3-44B", 96, 6144, 48, 2048, 8, 48),
    Case("GPT3-175B", 96, 12288, 96, 2048, 2, 48),
    Case("GPT3-13B-8k", 40, 5120, 40, 8192, 8, 8, "h100"),
    Case("GPT3-13B-32k", 40, 5120, 40, 32768, 2, 8, "h100"),
]


def run_case(case: Case, check_stages: tuple[int, ...] = ()) -> dict:
    import jax.numpy as jnp

    from autopar import model_zoo as mz
    from autopar.api import signature_of
    from autopar.cluster import Cluster
    from autopar.interface import PlanRequest
    from autopar.pipeline.method import PipeshardParallel
    from autopar.pipeline.record import to_plan
    from autopar.pipeline.token_dp import granularity_for
    from autopar.pipeline.token_plan import MAX_UNITS, plan_token_slices, slice_caps, sliced_decision

    cfg = mz.GPTConfig(vocab=51200, seq=case.seq, hidden=case.hidden, heads=case.heads, layers=case.layers,
                       batch=case.batch, dtype=jnp.float16)
    step, state, batch = mz.gpt_abstract_setup(cfg)
    cluster = Cluster.preset(case.device, case.hosts, 8)
    method = PipeshardParallel(num_micro_batches=case.batch, num_stages=case.hosts, submeshes=[(1, 8)] * case.hosts,
                               token_slices="auto")
    request = PlanRequest(fun=step, args=(state, batch), kwargs={}, cluster=cluster,
                          signature=signature_of((state, batch), {}), remat="auto")
    t0 = time.perf_counter()
    planner = method._planner(request)
    decision = planner.plan()
    token = plan_token_slices(planner, decision, "auto")
    decision = sliced_decision(decision, token.slicing)
    plan = to_plan(decision, method_name=method.name, schedule=method.schedule, signature=request.signature,
                   cluster=cluster, memory_budget_bytes=None, device_ids=tuple(range(cluster.num_devices)),
                   planning_s=time.perf_counter() - t0, token=token)
    planning_s = time.perf_counter() - t0
    sl = token.slicing
    # uniform slicings of the planned micro-batches that fit the stages' memory
    T, b0 = case.seq, decision.traced.micro_batch_size
    g = granularity_for(T, MAX_UNITS)
    longest = slice_caps(planner, decision, T, g, [b0])[b0] * g
    uniform = {}
    for k in (1, 2, 4, 8, 16, 32, 64, 128):
        if k <= case.seq and -(-T // k) <= longest:
            uniform[k] = plan_token_slices(planner, decision, k).slicing.predicted_step_s
    best_k = min(uniform, key=uniform.get)
    flops = cfg.train_flops
    whole = sl.unsliced_step_s
    return {
        "model": case.name, "device": case.device, "hosts": case.hosts, "seq": case.seq, "batch": case.batch,
        "planning_s": planning_s,
        "stages": len(plan.stages), "meshes": sorted({tuple(s.mesh_shape) for s in plan.stages}),
        "planned_micro_batches": decision.num_micro_batches,
        "stage_remat": sorted({s.remat.mode for s in plan.stages}),
        "planned_slice_share": planner.slice_share, "longest_slice_fitting": longest,
        "max_stage_memory_gib": max(s.memory_bytes for s in plan.stages) / 2**30,
        "sliced_step_s": sl.predicted_step_s, "unsliced_step_s": whole,
        "uniform_step_s": uniform, "best_uniform_slices": best_k,
        "micro_batch_sizes": list(sl.micro_batch_sizes), "slices": [list(s) for s in sl.slices],
        "speedup_over_unsliced": whole / sl.predicted_step_s if whole is not None else None,
        "speedup_over_best_uniform": uniform[best_k] / sl.predicted_step_s,
        "tflops_per_device_sliced": flops / sl.predicted_step_s / cluster.num_devices / 1e12,
        "dp_bounds_tried": sl.bounds_tried,
        **({"slice_memory_check": check_memory(step, state, batch, plan, check_stages)} if check_stages else {}),
    }


def check_memory(step, state, batch, plan, stages: tuple[int, ...]) -> list[dict]:
    """The plan's working memory on its longest slice against XLA's temp memory for the
    slice's programs, compiled from abstract inputs on simulated CPU devices."""
    from dataclasses import asdict

    from autopar.check import build_plan, check_slice_working

    exe, _ = build_plan(step, state, batch, plan=plan)
    return [{**asdict(c), "ratio": c.ratio} for c in check_slice_working(exe, stages)]


CPU_VARIANTS = {"whole sequences": {"token_slices": 1},
                "4 slices, modelled": {"token_slices": 4},
                "4 slices, profiled": {"token_slices": 4, "profile": True},
                "auto, modelled": {"token_slices": "auto"},
                "auto, profiled": {"token_slices": "auto", "profile": True}}


def run_cpu() -> dict:
    """The test GPT on 8 simulated CPU devices: 2 stages, 2 micro-batches, 1F1B; whole
    sequences, 4 token slices and the auto slicing, priced by the cost model and by slice
    times measured here (profile=True); each plan's predicted step against its measured
    step, timed in interleaved rounds in one process."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import jax
    import optax

    import autopar
    from pipeline_gpt import init_state, make_batch, make_step

    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(1), 8)
    step = make_step(opt, closure=True, markers=True, attention=autopar.causal_attention)
    steps, planning = {}, {}
    for name, kw in CPU_VARIANTS.items():
        steps[name] = autopar.parallelize(step, method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, **kw))
        t0 = time.perf_counter()
        jax.block_until_ready(steps[name](state, batch))
        planning[name] = time.perf_counter() - t0
    times = {k: [] for k in steps}
    for _ in range(10):
        for k, f in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(state, batch))
            times[k].append(time.perf_counter() - t0)
    out = {}
    for k, f in steps.items():
        run = f._executable((state, batch), {}).last_run
        sl = f.plan.pipeline.token_slices
        out[k] = {"median_step_s": sorted(times[k])[len(times[k]) // 2],
                  "predicted_step_s": f.plan.predicted_time_s if sl is None else sl.predicted_step_s,
                  "slices": None if sl is None else [list(x) for x in sl.slices],
                  "micro_batch_sizes": None if sl is None else list(sl.micro_batch_sizes),
                  "first_stage_peak_bytes": run.peak_live_bytes[0], "tasks": len(run.order),
                  "plan_and_first_step_s": planning[k]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="configs by name, comma-separated, e.g. GPT3-175B")
    ap.add_argument("--cpu", action="store_true", help="measure the test GPT on 8 simulated CPU devices instead")
    ap.add_argument("--check-stages", default="", help="stages (e.g. 0,4) whose longest-slice programs to compile "
                    "on simulated CPU devices and compare with the planned working memory")
    args = ap.parse_args(argv)
    check_stages = tuple(int(x) for x in args.check_stages.split(",") if x)
    if check_stages:       # one simulated device per planned device, before jax starts
        n = max(c.hosts * 8 for c in CASES if not args.only or c.name.lower() in args.only.lower().split(","))
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"
    from autopar.intra_op import MemoryBudgetError
    out_dir = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    if args.cpu:
        rows = run_cpu()
        print(json.dumps(rows, indent=1))
        print("\n| plan | slices per micro-batch | predicted step s | measured step s | first-stage peak residual bytes "
              "| tasks |\n|---|---|---|---|---|---|")
        for k, r in rows.items():
            sl = "whole" if r["slices"] is None else ", ".join(f"{b}x{x}" for b, x in zip(r["micro_batch_sizes"],
                                                                                         r["slices"]))
            print(f"| {k} | {sl} | {r['predicted_step_s']:.4f} | {r['median_step_s']:.4f} | "
                  f"{r['first_stage_peak_bytes']} | {r['tasks']} |")
        path = os.path.join(out_dir, f"terapipe_cpu_{int(time.time())}.json")
    else:
        only = {n.strip().lower() for n in args.only.split(",")} if args.only else None
        rows = []
        for case in CASES:
            if only and case.name.lower() not in only:
                continue
            try:
                rows.append(run_case(case, check_stages))
            except MemoryBudgetError as e:
                # recorded, not hidden
                rows.append({"model": case.name, "device": case.device, "hosts": case.hosts, "seq": case.seq,
                             "batch": case.batch, "error": str(e), "min_budget_bytes": e.min_bytes})
            print(json.dumps(rows[-1]), flush=True)
        print("\n| model | cluster | seq | batch | sliced s | whole seqs s | best uniform (k) s | x whole | "
              "x uniform | split, slices | planning s |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['model']} | {r['hosts']}x8 {r['device']} | {r['seq']} | {r['batch']} | no plan: "
                      f"needs {r['min_budget_bytes'] / 2**30:.0f} GiB per device |")
                continue
            k = r["best_uniform_slices"]
            whole = "does not fit" if r["unsliced_step_s"] is None else f"{r['unsliced_step_s']:.3f}"
            x_whole = "-" if r["speedup_over_unsliced"] is None else f"{r['speedup_over_unsliced']:.2f}"
            print(f"| {r['model']} | {r['hosts']}x8 {r['device']} | {r['seq']} | {r['batch']} | "
                  f"{r['sliced_step_s']:.3f} | {whole} | {r['uniform_step_s'][k]:.3f} ({k}) | "
                  f"{x_whole} | {r['speedup_over_best_uniform']:.3f} | "
                  f"{len(r['micro_batch_sizes'])}x{r['micro_batch_sizes'][0]}, {len(r['slices'][0])} slices | "
                  f"{r['planning_s']:.0f} |")
        path = os.path.join(out_dir, f"terapipe_{int(time.time())}.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
