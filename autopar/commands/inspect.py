"""`autopar inspect PLAN.json`: show a saved plan."""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="a plan JSON file written by Plan.save / autopar plan --out")
    p.add_argument("--all", action="store_true", help="show every sharding row")
    p.add_argument("--gantt", default=None, metavar="OUT.png", help="draw the pipeline schedule (pipeline plans)")


def run(args: argparse.Namespace) -> int:
    from autopar.plan import Plan, PlanFileError

    try:
        plan = Plan.load(args.plan)
    except PlanFileError as e:
        print(f"autopar inspect: {e}", file=sys.stderr)
        return 2
    print(plan.summary(max_rows=10**9 if args.all else 40))
    if args.gantt:
        if not plan.pipeline:
            print("autopar inspect: --gantt needs a pipeline plan (PipeshardParallel); this plan has one stage", file=sys.stderr)
            return 2
        from autopar.pipeline.gantt import draw

        draw(plan, args.gantt)
        print(f"schedule drawn to {args.gantt}")
    return 0
