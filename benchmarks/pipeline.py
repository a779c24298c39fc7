"""Pipeline planning under the cluster model: Alpa's GPT weak-scaling suite.

For each GPT config (350M on 1 A100-80GB ... 39B on 64, 8 per host) compare the
predicted throughput (TFLOP/s per device) of the auto plan (stage DP over submeshes,
logical meshes and micro-batch counts) with the best plan of an exhaustive Megatron-style
grid over dp x tp x pp x micro-batches, both priced by the same roofline stage cost
(`autopar.pipeline.stage_cost.roofline_stage_cost`), and report planning time.

Run: .venv/bin/python benchmarks/pipeline.py [--quick] [--tolerance 0.001]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from autopar.cluster import Cluster                                   # noqa: E402
from autopar.model_zoo.suites import GPT_SUITE                        # noqa: E402
from autopar.pipeline.method import PipeshardParallel                  # noqa: E402
from autopar.pipeline.planner import in_flight, plan_layers            # noqa: E402
from autopar.pipeline.stage_cost import (LayerProfile, device_model_from_cluster,  # noqa: E402
                                         roofline_stage_cost)

SEQ, VOCAB, GLOBAL_BATCH = GPT_SUITE[0].model.seq, GPT_SUITE[0].model.vocab, GPT_SUITE[0].model.batch
# name, layers, hidden, heads, devices (Alpa, OSDI'22, Table 4; autopar/model_zoo/suites.py)
CONFIGS = [(c.name, c.model.layers, c.model.hidden, c.model.heads, c.devices) for c in GPT_SUITE]
BYTES = 2                      # fp16 weights and activations
STATE_PER_PARAM_BYTE = 8.0     # mixed-precision Adam: 16 bytes per parameter / 2


def block_profiles(layers: int, h: int, heads: int, b: float, groups: int) -> list[LayerProfile]:
    """`groups` equal groups of transformer blocks for a micro-batch of b sequences; the
    embedding joins the first group, the LM head (tied copy) and loss the last."""
    s = SEQ
    blk = LayerProfile(flops=b * s * (24 * h * h + 4 * s * h),
                       param_bytes=(12 * h * h + 13 * h) * BYTES,
                       activation_bytes=s * b * h * (34 + 5 * heads * s / h),   # Korthikanti et al.
                       boundary_bytes=b * s * h * BYTES,
                       model_parallel_bytes=4 * b * s * h * BYTES)
    per = layers // groups
    out = []
    for g in range(groups):
        p = LayerProfile(per * blk.flops, per * blk.param_bytes, per * blk.activation_bytes,
                         blk.boundary_bytes, per * blk.model_parallel_bytes)
        if g == 0:
            p = replace(p, flops=p.flops + b * s * h, param_bytes=p.param_bytes + (VOCAB + s) * h * BYTES,
                        activation_bytes=p.activation_bytes + b * s * h * BYTES)
        if g == groups - 1:
            p = replace(p, flops=p.flops + 2 * b * s * h * VOCAB, param_bytes=p.param_bytes + VOCAB * h * BYTES,
                        activation_bytes=p.activation_bytes + b * s * VOCAB * 4)
        out.append(p)
    return out


def model_flops_per_step(layers: int, h: int) -> float:
    """Forward + backward FLOPs of one step (3x forward), embedding lookups excluded."""
    fwd = layers * SEQ * (24 * h * h + 4 * SEQ * h) + 2 * SEQ * h * VOCAB
    return 3.0 * fwd * GLOBAL_BATCH


def cluster_for(devices: int) -> Cluster:
    per_host = min(8, devices)
    return Cluster.preset("a100-80g", devices // per_host, per_host)


def submesh_of(devices: int, per_host: int) -> tuple[int, int]:
    return (1, devices) if devices <= per_host else (devices // per_host, per_host)


def micro_batch_counts() -> list[int]:
    return [2 ** k for k in range(int(math.log2(GLOBAL_BATCH)) + 1)]


def grid_search(layers, h, heads, devices, groups, device):
    """Best Megatron-style plan: dp * tp * pp = devices, tp inside a host, pp | groups,
    equal layers per stage, B micro-batches with whole micro-batches per replica."""
    per_host = device.devices_per_host
    best = None
    for tp in [2 ** k for k in range(int(math.log2(per_host)) + 1)]:
        for pp in [2 ** k for k in range(int(math.log2(devices)) + 1)]:
            if devices % (tp * pp) or groups % pp:
                continue
            dp = devices // (tp * pp)
            sub = submesh_of(dp * tp, per_host)
            for B in micro_batch_counts():
                if (GLOBAL_BATCH // B) % dp:
                    continue
                prof = block_profiles(layers, h, heads, GLOBAL_BATCH / B, groups)
                per = groups // pp
                costs = [roofline_stage_cost(prof, (k * per, (k + 1) * per), sub, (dp, tp), device)
                         for k in range(pp)]
                if any(c.memory_bytes(in_flight("1f1b", pp - k, B)) > device.memory_bytes
                       for k, c in enumerate(costs)):
                    continue
                lat = sum(c.micro_batch_s + c.iteration_s for c in costs) + \
                    (B - 1) * max(c.micro_batch_s for c in costs)
                if best is None or lat < best["latency_s"]:
                    best = {"latency_s": lat, "dp": dp, "tp": tp, "pp": pp, "micro_batches": B}
    return best


def auto_search(layers, h, heads, devices, groups, device, tolerance):
    """Stage DP for every micro-batch count; the best plan."""
    best = None
    for B in micro_batch_counts():
        prof = block_profiles(layers, h, heads, GLOBAL_BATCH / B, groups)
        method = PipeshardParallel(num_micro_batches=B, schedule="1f1b",
                                   imbalance_tolerance=tolerance)
        hosts = devices // device.devices_per_host
        try:
            ranges, subs, lms, costs, lat = plan_layers(prof, method, hosts, device.devices_per_host,
                                                        device, micro_batch_size=GLOBAL_BATCH // B)
        except ValueError:
            continue                      # nothing fits in memory with this B
        if best is None or lat < best["latency_s"]:
            best = {"latency_s": lat, "micro_batches": B, "stages": [
                {"layers": list(r), "submesh": list(s), "logical_mesh": list(l)}
                for r, s, l in zip(ranges, subs, lms)]}
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the three smallest configs")
    ap.add_argument("--tolerance", type=float, default=0.0,
                    help="stage DP imbalance tolerance (Alpa's pruning; 0 = exact)")
    args = ap.parse_args(argv)
    rows = []
    for name, layers, h, heads, devices in (CONFIGS[:3] if args.quick else CONFIGS):
        cluster = cluster_for(devices)
        device = device_model_from_cluster(cluster, "float16", STATE_PER_PARAM_BYTE)
        groups = min(16, layers & -layers)          # largest power of two dividing the depth
        t0 = time.perf_counter()
        auto = auto_search(layers, h, heads, devices, groups, device, args.tolerance)
        plan_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        grid = grid_search(layers, h, heads, devices, groups, device)
        grid_s = time.perf_counter() - t0
        flops = model_flops_per_step(layers, h)
        tput = lambda r: flops / r["latency_s"] / devices / 1e12 if r else float("nan")
        rows.append({"model": name, "devices": devices, "cluster": str(cluster), "layer_groups": groups,
                     "auto_tflops_per_device": tput(auto), "grid_tflops_per_device": tput(grid),
                     "auto_over_grid": (tput(auto) / tput(grid)) if auto and grid else float("nan"),
                     "auto_planning_s": plan_s, "grid_search_s": grid_s, "auto": auto, "grid": grid})
        print(f"{name}: auto {tput(auto):.1f} grid {tput(grid):.1f} TFLOP/s/device, "
              f"planned in {plan_s:.1f} s", flush=True)
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="Pipeline planning, GPT weak scaling (a100-80g, cluster model)")
        for c in ["model", "devices", "auto TFLOP/s/dev", "grid TFLOP/s/dev", "auto/grid",
                  "auto plan", "grid plan", "planning s"]:
            t.add_column(c)
        for r in rows:
            a, g = r["auto"], r["grid"]
            ap_s = (f"{len(a['stages'])} stages, B={a['micro_batches']}, "
                    + " ".join(f"{s['submesh'][0]}x{s['submesh'][1]}" for s in a["stages"])) if a else "-"
            gp_s = f"dp{g['dp']} tp{g['tp']} pp{g['pp']} B={g['micro_batches']}" if g else "-"
            t.add_row(r["model"], str(r["devices"]), f"{r['auto_tflops_per_device']:.1f}",
                      f"{r['grid_tflops_per_device']:.1f}", f"{r['auto_over_grid']:.3f}",
                      ap_s, gp_s, f"{r['auto_planning_s']:.1f}")
        Console(width=170).print(t)
    except ImportError:
        pass
    out = os.path.join(os.path.dirname(__file__), "results", "pipeline.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"tolerance": args.tolerance, "rows": rows,
                   "targets": {"auto_ge_grid_all": all(r["auto_over_grid"] >= 1 - 1e-9 for r in rows),
                               "gpt39b_planning_under_60s": all(r["auto_planning_s"] < 60 for r in rows
                                                                 if r["model"] == "GPT-39B")}},
                  f, indent=1)
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
