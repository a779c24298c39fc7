"""`autopar plan --model gpt ... --cluster 4x8:a100-80g`: plan without the hardware."""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt", choices=["gpt"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=51200)
    p.add_argument("--scan", action="store_true", help="stack the layers with nn.scan")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--cluster", default="1x8:a100-80g", help="HOSTSxDEVICES:PRESET, e.g. 4x8:a100-80g")
    p.add_argument("--method", default="auto", help="auto | data_parallel | zero3 | megatron:TP")
    p.add_argument("--memory-budget", default=None, help="per device, e.g. 40GB (default: device memory)")
    p.add_argument("--out", default=None, help="save the plan JSON here")


def run(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    import autopar
    from autopar.commands.demo import method_from_string
    from autopar.model_zoo import GPTConfig, gpt_abstract_setup

    try:
        cluster = autopar.Cluster.parse(args.cluster)
    except ValueError as e:
        print(f"autopar plan: {e}", file=sys.stderr)
        return 2
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, hidden=args.hidden, heads=args.heads, layers=args.layers,
                    batch=args.batch, scan=args.scan, dtype=getattr(jnp, args.dtype))
    step, state, batch = gpt_abstract_setup(cfg)
    budget = args.memory_budget or cluster.device.memory_bytes
    try:
        plan = autopar.make_plan(step, state, batch, cluster=cluster, method=method_from_string(args.method),
                                 memory_budget=budget)
    except (autopar.MemoryBudgetError, autopar.MeshDivisibilityError) as e:
        print(f"autopar plan: {e}", file=sys.stderr)
        return 2
    print(plan.summary())
    if args.out:
        plan.save(args.out)
        print(f"plan saved to {args.out}")
    return 0
