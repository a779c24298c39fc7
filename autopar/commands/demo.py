"""`autopar demo`: plan, run and check a small GPT train step on 8 (simulated) devices."""
from __future__ import annotations

import argparse
import os
import sys
import time


def ensure_simulated_devices(n: int = 8) -> None:
    """On a CPU-only machine, ask XLA for n host devices (must happen before jax starts its backend)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={n}").strip()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--method", default="auto", help="auto | data_parallel | zero3 | megatron:TP")
    p.add_argument("--out", default=None, help="also save the plan as JSON here")


def method_from_string(s: str):
    import autopar

    if s == "auto":
        return "auto"
    if s in ("data_parallel", "dp"):
        return autopar.DataParallel()
    if s == "zero3":
        return autopar.ZeRO3()
    if s in ("pipeshard", "pipeline"):
        return autopar.PipeshardParallel(num_micro_batches=2)
    if s.startswith("megatron"):
        _, _, tp = s.partition(":")
        if tp and not tp.isdigit():
            raise ValueError(f"--method {s!r}: write megatron:TP with TP a number of devices, e.g. megatron:2")
        return autopar.Megatron(tp=int(tp or 2))
    raise ValueError(f"unknown --method {s!r}; use auto, data_parallel, zero3, megatron:TP or pipeshard")


def run(args: argparse.Namespace) -> int:
    import jax
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    import autopar
    from autopar.model_zoo import GPTConfig, gpt_setup

    con = Console()
    try:
        cfg = GPTConfig(vocab=args.vocab, seq=args.seq, hidden=args.hidden, heads=args.heads, layers=args.layers,
                        batch=args.batch)
        method = method_from_string(args.method)
    except ValueError as e:
        print(f"autopar demo: {e}", file=sys.stderr)
        return 2
    step, state, batch = gpt_setup(cfg)
    devices = jax.devices()
    con.print(f"[bold]autopar demo[/]: GPT {cfg.layers} layers, d={cfg.hidden}, seq {cfg.seq}, batch {cfg.batch}, "
              f"{cfg.num_params / 1e6:.2f}M params, adamw; {len(devices)} {devices[0].platform} devices")
    t0 = time.perf_counter()
    ref_state, ref_loss = jax.jit(step)(state, batch)
    jax.block_until_ready(ref_loss)
    t_ref = time.perf_counter() - t0
    pstep = autopar.parallelize(step, method=method)
    t0 = time.perf_counter()
    try:
        plan = pstep.get_plan(state, batch)
    except (autopar.MemoryBudgetError, autopar.MeshDivisibilityError, ValueError) as e:
        print(f"autopar demo: {e}", file=sys.stderr)
        return 2
    t_plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    new_state, loss = pstep(state, batch)
    jax.block_until_ready(loss)
    t_run = time.perf_counter() - t0
    con.print(plan.summary(max_rows=12))
    worst = 0.0
    for a, b in zip(jax.tree_util.tree_leaves(new_state), jax.tree_util.tree_leaves(ref_state)):
        a, b = np.asarray(a), np.asarray(b)
        worst = max(worst, float(np.max(np.abs(a - b))) if a.size else 0.0)
    ok = abs(float(loss) - float(ref_loss)) <= 1e-4 * max(1.0, abs(float(ref_loss))) and worst <= 2e-3 * 2
    t = Table(title="check against one device (jax.jit)")
    for c in ("quantity", "autopar", "one device"):
        t.add_column(c)
    t.add_row("loss", f"{float(loss):.6f}", f"{float(ref_loss):.6f}")
    t.add_row("max |new params - reference|", f"{worst:.2e}", "(atol 2*lr for adamw)")
    t.add_row("plan time", f"{t_plan:.2f} s", "")
    t.add_row("first step (compile + run)", f"{t_run:.2f} s", f"{t_ref:.2f} s")
    con.print(t)
    if args.out:
        plan.save(args.out)
        con.print(f"plan saved to {args.out} (view it with: autopar inspect {args.out})")
    con.print("[bold green]OK[/]: same result as one device" if ok else "[bold red]MISMATCH[/] against one device")
    return 0 if ok else 1
