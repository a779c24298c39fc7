"""`autopar tune`: tune kernels on this machine and store every measurement in the tuning DB.

    autopar tune --task matmul --shape 512,512,512 --trials 256 [--db PATH]
    autopar tune --plan plan.json --trials 64 [--db PATH]     # every local op of a plan
"""
from __future__ import annotations

import argparse
import math
import sys
import warnings

# task -> (shape fields in --shape order, optional trailing fields)
SHAPES = {
    "matmul": (("M", "N", "K"), ()),
    "dense": (("M", "N", "K"), ()),
    "batch_matmul": (("B", "M", "N", "K"), ()),
    "softmax": (("M", "N"), ()),
    "layernorm": (("M", "N"), ()),
    "conv2d": (("N", "H", "W", "CI", "CO", "KH", "KW"), ("stride", "pad")),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", default=None, metavar="PLAN.json",
                        help="tune the kernel tasks of a saved plan (the local ops of each stage; --trials per task, "
                             "spent where the expected gain is largest) instead of one --task")
    parser.add_argument("--task", choices=sorted(SHAPES), help="operator to tune")
    parser.add_argument("--shape",
                        help="comma-separated sizes: matmul/dense M,N,K; batch_matmul B,M,N,K; softmax/layernorm "
                             "M,N; conv2d N,H,W,CI,CO,KH,KW[,stride,pad] (NHWC)")
    parser.add_argument("--epilogue", choices=["none", "relu", "gelu"], default=None,
                        help="element-wise epilogue of matmul/dense (dense: bias + this; default relu)")
    parser.add_argument("--trials", type=int, default=64, help="schedules to measure (default 64; with --plan: "
                                                               "per task)")
    parser.add_argument("--batch-size", type=int, default=16, help="schedules measured per round")
    parser.add_argument("--policy", choices=["evolutionary", "random"], default="evolutionary")
    parser.add_argument("--target", choices=["cpu", "pallas"], default="cpu",
                        help="cpu: C/OpenMP kernels compiled and timed here (default); pallas: Pallas kernels, timed "
                             "on this machine's GPU, or without one only checked in interpret mode (not timed)")
    parser.add_argument("--db", default=None, help="tuning database path (default: AUTOPAR_TUNING_DB or the "
                                                   "user cache directory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-transfer", dest="transfer", action="store_false",
                        help="do not pre-train the cost model on the DB's records of other tasks")
    parser.add_argument("--show-source", action="store_true", help="print the C source of the best kernel")


def parse_task(task: str, shape: str, epilogue: str | None):
    """A search.Task from the CLI's --task/--shape/--epilogue; ValueError with a usage hint."""
    from search import Task

    names, optional = SHAPES[task]
    try:
        sizes = [int(x) for x in shape.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--shape {shape!r}: sizes must be integers separated by commas") from None
    if not len(names) <= len(sizes) <= len(names) + len(optional):
        want = ",".join(names) + ("".join(f"[,{o}]" for o in optional))
        raise ValueError(f"--shape {shape!r}: {task} takes {want}")
    params = dict(zip(names + optional, sizes))
    if task in ("matmul", "dense"):
        ep = None if epilogue in (None, "none") else epilogue
        if task == "dense":
            params["epilogue"] = "relu" if epilogue is None else ep
        elif ep:
            params["epilogue"] = ep
    elif epilogue not in (None, "none"):
        raise ValueError(f"--epilogue applies to matmul and dense, not {task}")
    return Task.make(task, **params)


def run(args: argparse.Namespace) -> int:
    """Tune one kernel; exit code 0 ok, 1 no valid kernel or no compiler, 2 a usage error (bad
    shape or counts, a task too large for this machine, a --db that cannot be used), 130 on
    Ctrl-C (every record measured so far is kept)."""
    import search
    from search.backend import CBackend, CompilerNotFoundError
    from search.database import SkippedRecordsWarning, TuningDB, TuningDBError, summarize_problems
    from search.measure import check_fits_in_memory
    from search.tune import TuneInterrupted

    if args.plan is not None:
        if args.task or args.shape:
            return _error("--plan tunes the plan's own tasks; leave out --task and --shape", 2)
        return run_plan(args)
    if not (args.task and args.shape):
        return _error("name a --task and its --shape, or a --plan", 2)
    try:
        task = parse_task(args.task, args.shape, args.epilogue)
        for name in ("trials", "batch_size"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
        check_fits_in_memory(task)
        db = TuningDB(args.db)
    except (ValueError, TuningDBError) as e:
        return _error(str(e), 2)
    with db, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SkippedRecordsWarning)
        try:
            if args.target == "cpu":
                CBackend().target()  # the compiler, before anything starts
            res = _tune_with_progress(search, task, db, args)
        except CompilerNotFoundError as e:
            return _error(str(e), 1)
        except TuneInterrupted as e:
            print(f"autopar tune: interrupted; {len(e.result.records)} records kept in {db.path} "
                  "(every measurement of this run)", file=sys.stderr)
            return 130
        finally:
            notes = [str(w.message) for w in caught if issubclass(w.category, SkippedRecordsWarning)]
            for note in dict.fromkeys(notes):
                print(f"autopar tune: note: {note}", file=sys.stderr)
    n_err = sum(1 for r in res.records if not r.ok)
    if res.best_schedule is None:
        errors = summarize_problems((r.error or "no latencies" for r in res.records), "failed trial")
        return _error(f"no valid kernel in {res.trials} trials: {errors}", 1)
    if not math.isfinite(res.best_latency_s):     # Pallas in interpret mode: checked, not timed
        n_ok = sum(1 for r in res.records if r.unmeasured)
        print(f"{task.workload_key}: {n_ok} of {res.trials} {args.target} kernels match the reference in interpret "
              "mode (not timed: no GPU here)")
        return 0
    print(f"{task.workload_key}: best {res.best_latency_s * 1e3:.4f} ms, {res.best_gflops:.2f} GFLOP/s after "
          f"{res.trials} trials ({n_err} failed) in {res.tuning_time_s:.1f} s")
    if args.show_source:
        print(search.build(task, res.best_schedule, target=args.target).source)
    return 0


def plan_tasks(plan) -> tuple[list, list[int]]:
    """(search tasks, how many ops each serves) of every stage of `plan`, merged by workload."""
    from autopar.kernel_sites import search_task

    counts: dict[str, int] = {}
    tasks: dict[str, object] = {}
    for stage in plan.stages:
        for kt in stage.kernel_tasks:
            tasks.setdefault(kt.workload_key, search_task(kt))
            counts[kt.workload_key] = counts.get(kt.workload_key, 0) + kt.ops
    keys = list(tasks)
    return [tasks[k] for k in keys], [counts[k] for k in keys]


def run_plan(args: argparse.Namespace) -> int:
    """Tune every kernel task of a saved plan with --trials trials per task (the task
    scheduler moves trials to where the expected gain is largest); exit codes as `run`."""
    import search
    from autopar.plan import Plan, PlanFileError
    from search.backend import CBackend, CompilerNotFoundError
    from search.database import TuningDB, TuningDBError
    from search.tune import TuneInterrupted

    try:
        plan = Plan.load(args.plan)
        for name in ("trials", "batch_size"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
        tasks, counts = plan_tasks(plan)
        if not tasks:
            raise ValueError(f"{args.plan} lists no kernel tasks: its stages have no float32 matmuls a kernel "
                             "could serve (an SPMD or token-sliced pipeline plan lists none: they run XLA's code)")
        db = TuningDB(args.db)
    except (PlanFileError, ValueError, TuningDBError) as e:
        return _error(str(e), 2)
    from rich.console import Console

    console = Console(stderr=True)
    console.print(f"tuning {len(tasks)} kernel tasks of {args.plan} ({sum(counts)} ops), {args.trials} trials per "
                  f"task, into {db.path}", highlight=False)
    done: dict[str, "search.TuneResult"] = {}

    def on_round(results: dict) -> None:
        done.update(results)
        n = sum(r.trials for r in results.values())
        console.print(f"  {n} / {args.trials * len(tasks)} trials", highlight=False)

    with db:
        try:
            if args.target == "cpu":
                CBackend().target()
            results = search.tune_tasks(tasks, trials=args.trials * len(tasks), weights=counts, db=db,
                                        target=args.target,
                                        policy=args.policy, batch_size=min(args.batch_size, args.trials),
                                        seed=args.seed, callback=on_round, transfer=args.transfer)
        except CompilerNotFoundError as e:
            return _error(str(e), 1)
        except KeyboardInterrupt:
            kept = sum(len(r.records) for r in done.values())
            print(f"autopar tune: interrupted; {kept} records kept in {db.path} (every measurement of this run); "
                  "`kernels=\"cached\"` uses them", file=sys.stderr)
            return 130
    from rich.table import Table

    table = Table(title=f"kernel tasks of {args.plan}")
    for col in ("task", "ops", "trials", "best", "GFLOP/s"):
        table.add_column(col)
    for task, n in zip(tasks, counts):
        r = results[task.workload_key]
        table.add_row(task.workload_key, str(n), str(r.trials),
                      "no valid kernel" if r.best_schedule is None else f"{r.best_latency_s * 1e3:.3f} ms"
                      if math.isfinite(r.best_latency_s) else "checked, not timed (no GPU)",
                      f"{r.best_gflops:.1f}" if r.best_schedule is not None and math.isfinite(r.best_latency_s)
                      else "-")
    Console(width=140).print(table)
    return 0 if any(r.best_schedule is not None for r in results.values()) else 1


def _tune_with_progress(search, task, db, args: argparse.Namespace):
    """search.tune with a progress bar on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    console.print(f"tuning [bold]{task.workload_key}[/bold] ({task.flops / 1e9:.3f} GFLOP) "
                  f"with {args.policy} search, {args.trials} trials", markup=True, highlight=False)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), console=console) as bar:
        tid = bar.add_task("trials", total=args.trials, status="")

        def on_batch(r: "search.TuneResult") -> None:
            status = (f"best {r.best_latency_s * 1e3:.3f} ms  {r.best_gflops:.1f} GFLOP/s"
                      if r.best_schedule else "no valid kernel yet")
            bar.update(tid, completed=r.trials, status=status)

        return search.tune(task, target=args.target, trials=args.trials, db=db, policy=args.policy,
                           batch_size=args.batch_size,
                           seed=args.seed, callback=on_batch, transfer=args.transfer)


def _error(message: str, code: int) -> int:
    """One line `autopar tune: error: MESSAGE` on stderr; returns the exit code."""
    print(f"autopar tune: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="autopar tune")
    add_arguments(p)
    sys.exit(run(p.parse_args()))
