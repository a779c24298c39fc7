"""`autopar plan`: plan a train step for a cluster that need not exist here.

The step is a built-in model family (`--model gpt|moe|wresnet`, sized by flags or by
`--preset` from Alpa's benchmark suites) or any importable function
(`--step package.module:function` returning `(step, example_args)`; ShapeDtypeStructs
are fine). Every method plans, pipelines included (`--method pipeshard`).
"""
from __future__ import annotations

import argparse
import importlib
import sys

FAMILIES = ("gpt", "moe", "wresnet")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt", choices=FAMILIES, help="built-in model family")
    p.add_argument("--preset", default=None, help="an Alpa benchmark size, e.g. GPT-39B, MoE-10B, WResNet-2B "
                                                  "(sets the model flags)")
    p.add_argument("--step", default=None, metavar="MODULE:FUNCTION",
                   help="plan your own step: FUNCTION() returns (step, example_args)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=51200)
    p.add_argument("--experts", type=int, default=8, help="moe: experts per MoE layer")
    p.add_argument("--channels", type=int, default=160, help="wresnet: base channels")
    p.add_argument("--width", type=int, default=2, help="wresnet: width factor")
    p.add_argument("--image-size", type=int, default=224, help="wresnet")
    p.add_argument("--classes", type=int, default=1024, help="wresnet")
    p.add_argument("--scan", action="store_true", help="gpt: stack the layers with nn.scan")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--cluster", default="1x8:a100-80g", help="HOSTSxDEVICES:PRESET, e.g. 4x8:a100-80g")
    p.add_argument("--method", default="auto", help="auto | data_parallel | zero3 | megatron:TP | pipeshard")
    p.add_argument("--micro-batches", default="auto", help="pipeshard: auto or a number")
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="pipeshard schedule")
    p.add_argument("--token-slices", default="1", help="pipeshard, causal LMs (TeraPipe): 1, a number of equal "
                   "slices, comma-separated slice lengths, or auto")
    p.add_argument("--stages", type=int, default=None, help="pipeshard: number of stages (default: planner's choice)")
    p.add_argument("--remat", default=None, choices=["auto", "none", "rockmate", "full"],
                   help="rematerialization (default: auto for pipeshard, none otherwise; "
                        "rockmate: pipeshard, every stage on a rockmate schedule)")
    p.add_argument("--memory-budget", default=None, help="per device, e.g. 40GB (default: device memory)")
    p.add_argument("--out", default=None, help="save the plan JSON here")
    p.add_argument("--gantt", default=None, metavar="OUT.png", help="pipeshard: draw the schedule")


def method_from_args(args: argparse.Namespace):
    """The method object named by --method (and the pipeline flags)."""
    import autopar
    from autopar.commands.demo import method_from_string

    if args.method in ("pipeshard", "pipeline"):
        B = args.micro_batches if args.micro_batches == "auto" else _positive_int(args.micro_batches, "--micro-batches")
        return autopar.PipeshardParallel(num_micro_batches=B, schedule=args.schedule, num_stages=args.stages,
                                         token_slices=token_slices_from_arg(args.token_slices))
    if args.token_slices != "1":
        raise ValueError("--token-slices needs --method pipeshard")
    return method_from_string(args.method)


def token_slices_from_arg(text: str):
    """--token-slices: "auto", a count, or comma-separated lengths."""
    if text == "auto":
        return "auto"
    parts = [t for t in text.split(",") if t.strip()]
    values = [_positive_int(t.strip(), "--token-slices") for t in parts]
    if not values:
        raise ValueError("--token-slices: write auto, a number of slices or comma-separated slice lengths")
    return values[0] if len(values) == 1 and "," not in text else values


def _positive_int(text: str, flag: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: write 'auto' or a positive integer") from None
    if n < 1:
        raise ValueError(f"{flag} {n}: must be at least 1")
    return n


def model_setup(args: argparse.Namespace):
    """(step, example_args) of the built-in family, as ShapeDtypeStructs."""
    import jax.numpy as jnp

    from autopar import model_zoo as mz

    dtype = getattr(jnp, args.dtype)
    if args.preset is not None:
        cases = {c.name.lower(): c for c in (*mz.GPT_SUITE, *mz.MOE_SUITE, *mz.WRESNET_SUITE)}
        case = cases.get(args.preset.lower())
        if case is None:
            raise ValueError(f"unknown --preset {args.preset!r}; choose one of {', '.join(c.name for c in cases.values())}")
        cfg = case.model
    elif args.model == "gpt":
        cfg = mz.GPTConfig(vocab=args.vocab, seq=args.seq, hidden=args.hidden, heads=args.heads, layers=args.layers,
                           batch=args.batch, scan=args.scan, dtype=dtype)
    elif args.model == "moe":
        cfg = mz.MoEConfig(vocab=args.vocab, seq=args.seq, hidden=args.hidden, heads=args.heads, layers=args.layers,
                           experts=args.experts, batch=args.batch, dtype=dtype)
    else:
        cfg = mz.WResNetConfig(image_size=args.image_size, num_classes=args.classes, layers=args.layers,
                               channels=args.channels, width=args.width, batch=args.batch, dtype=dtype)
    setup = {mz.GPTConfig: mz.gpt_abstract_setup, mz.MoEConfig: mz.moe_abstract_setup,
             mz.WResNetConfig: mz.wresnet_abstract_setup}[type(cfg)]
    step, state, batch = setup(cfg)
    return step, (state, batch)


def user_setup(spec: str):
    """(step, example_args) from `module:function`."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--step {spec!r}: write package.module:function")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--step {spec!r}: cannot import it ({e})") from None
    out = fn()
    if not (isinstance(out, tuple) and len(out) == 2 and callable(out[0])):
        raise ValueError(f"--step {spec!r} must return (step, example_args); it returned {type(out).__name__}")
    step, example = out
    return step, tuple(example) if isinstance(example, (tuple, list)) else (example,)


def run(args: argparse.Namespace) -> int:
    import autopar

    try:
        cluster = autopar.Cluster.parse(args.cluster)
        method = method_from_args(args)
        budget = args.memory_budget or cluster.device.memory_bytes
        autopar.cluster.parse_memory(budget)
        step, example = user_setup(args.step) if args.step else model_setup(args)
        remat = args.remat or ("auto" if isinstance(method, autopar.PipeshardParallel) else "none")
        plan = autopar.make_plan(step, *example, cluster=cluster, method=method, memory_budget=budget, remat=remat)
    except (autopar.MemoryBudgetError, autopar.MeshDivisibilityError, ValueError, TypeError) as e:
        print(f"autopar plan: {e}", file=sys.stderr)
        return 2
    print(plan.summary())
    if args.out:
        plan.save(args.out)
        print(f"plan saved to {args.out}")
    if args.gantt:
        if plan.pipeline is None:
            print("autopar plan: --gantt needs --method pipeshard", file=sys.stderr)
            return 2
        from autopar.pipeline.gantt import draw

        draw(plan, args.gantt)
        print(f"schedule drawn to {args.gantt}")
    return 0
