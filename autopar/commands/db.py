"""`autopar db {list,show,export,import,remove}`: inspect, share and clean the kernel tuning
database."""
from __future__ import annotations

import argparse
import datetime
import difflib
import json
import math
import sys
import warnings
from typing import Any

from rich.console import Console
from rich.table import Table

from search.database import (
    ENV_VAR, SkippedRecordsWarning, TuningDB, TuningDBError, default_db_path, summarize_problems,
)
from search.record import TuningRecord
from search.task import Task


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `db` subcommands to `parser` (the parser of `autopar db`)."""
    _add_db_option(parser, default=None)
    sub = parser.add_subparsers(dest="db_command", metavar="{list,show,export,import,remove}")
    sub.required = True
    p = sub.add_parser("list", help="table of tuned workloads: records, best latency, GFLOP/s, and XLA's time for "
                                    "the same op where a planned step compared them")
    _add_db_option(p)
    _add_target_option(p)
    p = sub.add_parser("show", help="the best record of one workload and its schedule steps")
    p.add_argument("key", help="workload key (or a unique prefix of one)")
    _add_db_option(p)
    _add_target_option(p)
    p = sub.add_parser("export", help="write records as JSON lines, for another machine")
    p.add_argument("out", metavar="OUT.jsonl", help="file to write (replaced atomically)")
    p.add_argument("--workload", default=None, help="export only this workload key")
    p.add_argument("--salvage", action="store_true",
                   help="read a damaged database read-only and export every record still readable")
    _add_db_option(p)
    _add_target_option(p)
    p = sub.add_parser("import", help="add records from a JSON-lines file, skipping duplicates")
    p.add_argument("src", metavar="IN.jsonl", help="file written by `autopar db export`")
    _add_db_option(p)
    p = sub.add_parser("remove", help="delete the records of a workload, or the invalid ones")
    p.add_argument("key", nargs="?", default=None, help="workload key (exact) whose records to delete")
    p.add_argument("--invalid", action="store_true",
                   help="delete only records that fail validation (with KEY: only that workload's)")
    p.add_argument("--dry-run", action="store_true", help="count what would be deleted; delete nothing")
    _add_db_option(p)
    _add_target_option(p)


def run(args: argparse.Namespace) -> int:
    """Run one `autopar db` subcommand; returns the process exit code: 0 ok, 1 the operation
    failed, 2 a usage error (including a --db file that cannot be used)."""
    command = getattr(args, "db_command", None)
    handlers = {"list": _list, "show": _show, "export": _export, "import": _import, "remove": _remove}
    if command not in handlers:
        return _error("db", f"choose one of {', '.join(handlers)}", 2)
    if command == "remove" and args.key is None and not args.invalid:
        return _error("db remove", "name a workload KEY, or pass --invalid", 2)
    try:
        # Reading commands never create a database file; import creates one if needed.
        db = TuningDB(getattr(args, "db", None), create=command == "import",
                      salvage=getattr(args, "salvage", False))
    except TuningDBError as e:
        return _error(f"db {command}", str(e), 2)
    with db, warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedRecordsWarning)  # said once, below
        try:
            code = handlers[command](db, args)
        except TuningDBError as e:
            return _error(f"db {command}", str(e), 1)
        if db.skipped and command != "remove":
            print(f"autopar db {command}: note: left out {summarize_problems(db.skipped.values())}; "
                  f"`autopar db remove --invalid --db '{db.path}'` deletes them", file=sys.stderr)
        return code


def _error(command: str, message: str, code: int) -> int:
    """Print one line `autopar COMMAND: error: MESSAGE` on stderr; returns the exit code."""
    print(f"autopar {command}: error: {message}", file=sys.stderr)
    return code


def _add_db_option(parser: argparse.ArgumentParser, default: Any = argparse.SUPPRESS) -> None:
    # SUPPRESS on the subcommands keeps a `--db` given before the subcommand name.
    parser.add_argument(
        "--db", metavar="PATH", default=default,
        help=f"tuning database file (default: ${ENV_VAR} or {default_db_path()})",
    )


def _add_target_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="only records of this target key")


def _list(db: TuningDB, args: argparse.Namespace) -> int:
    target = getattr(args, "target", None)
    rows = db.workloads(target_key=target)
    if not rows:
        print(f"{db.path}: no tuning records" + (f" for target {target}" if target else ""))
        return 0
    table = Table(title=f"Tuned workloads in {db.path}")
    table.add_column("workload key", overflow="fold")
    table.add_column("records", justify="right")
    table.add_column("best latency", justify="right")
    table.add_column("GFLOP/s", justify="right")
    table.add_column("XLA (same op)", justify="right")
    table.add_column("tuned vs XLA", justify="right")
    versus = _versus_xla(db, target)
    for key, n_records, best_latency_s in rows:
        best = db.best(key, target) if math.isfinite(best_latency_s) else None
        xla, ratio = versus.get(key, ("-", "-"))
        table.add_row(key, str(n_records), _format_seconds(best_latency_s), _gflops(best), xla, ratio)
    _console(max(len(key) for key, _, _ in rows) + 80).print(table)
    return 0


def _versus_xla(db: TuningDB, target: str | None) -> dict[str, tuple[str, str]]:
    """Workload -> (XLA's time, tuned speedup) from the head-to-head comparisons that
    `kernels="tuned"|"cached"` stored (one per op layout; a range when layouts differ)."""
    from autopar.kernel_choice import PROFILE_KIND

    by_key: dict[str, list[dict]] = {}
    for prof in db.profiles(PROFILE_KIND).values():
        key = prof.get("workload_key")
        if key is None or (target is not None and prof.get("target_key") != target):
            continue
        by_key.setdefault(key, []).append(prof)
    out = {}
    for key, profs in by_key.items():
        xla = [p["xla_s"] for p in profs]
        ratios = [p["xla_s"] / p["tuned_s"] for p in profs if p["tuned_s"] > 0]
        spread = (f"{min(ratios):.2f}x" if max(ratios) - min(ratios) < 0.005 else
                  f"{min(ratios):.2f}-{max(ratios):.2f}x") if ratios else "-"
        out[key] = (_format_seconds(min(xla)), spread)
    return out


def _show(db: TuningDB, args: argparse.Namespace) -> int:
    target = getattr(args, "target", None)
    key = _resolve_key(db, args.key, target)
    all_records = db.records(key, target)
    best = db.best(key, target)
    if best is None:
        errors = sorted({r.error or "no latencies" for r in all_records})
        print(
            f"autopar db show: error: all {len(all_records)} records of {key} failed; "
            f"errors: {'; '.join(errors[:5])}",
            file=sys.stderr,
        )
        return 1
    n_failed = sum(not r.ok for r in all_records)
    xs = sorted(best.latencies_s)
    info = Table.grid(padding=(0, 2))
    info.add_column(style="bold")
    info.add_column(overflow="fold")
    info.add_row("workload", key)
    info.add_row("target", f"{best.target_key}  {json.dumps(best.target, sort_keys=True)}")
    info.add_row(
        "latency",
        f"{_format_seconds(best.latency_s)} median of {len(xs)} runs "
        f"(min {_format_seconds(xs[0])}, max {_format_seconds(xs[-1])})",
    )
    info.add_row("GFLOP/s", _gflops(best))
    info.add_row("records", f"{len(all_records)} ({n_failed} failed)")
    when = datetime.datetime.fromtimestamp(best.timestamp, datetime.timezone.utc)
    info.add_row(
        "measured",
        f"{when:%Y-%m-%d %H:%M:%S} UTC by autopar {best.library_version or '?'}, "
        f"tuning time {best.tuning_time_s:.1f} s",
    )
    info.add_row("task", json.dumps(best.task, sort_keys=True))
    steps = Table(title=f"Schedule ({len(best.schedule)} steps)")
    steps.add_column("#", justify="right")
    steps.add_column("step", overflow="fold")
    for i, step in enumerate(best.schedule):
        steps.add_row(str(i), _format_step(step))
    console = _console(len(key) + 40)
    console.print(info)
    console.print(steps)
    return 0


def _export(db: TuningDB, args: argparse.Namespace) -> int:
    n = db.export_jsonl(args.out, workload_key=getattr(args, "workload", None),
                        target_key=getattr(args, "target", None))
    print(f"exported {n} records from {db.path} to {args.out}")
    for first, last in db.unreadable:
        where = f"ids {first} to {last}" if last is not None else f"ids from {first} on"
        print(f"autopar db export: note: records with {where} sit on damaged pages and were "
              "not exported", file=sys.stderr)
    return 0


def _import(db: TuningDB, args: argparse.Namespace) -> int:
    report = db.import_jsonl(args.src)
    print(f"imported {report.added} new records from {args.src} into {db.path} "
          f"({report.duplicates} exact duplicates skipped)")
    if report.invalid:
        lines = ", ".join(str(number) for number, _ in report.invalid[:10])
        more = ", ..." if len(report.invalid) > 10 else ""
        print(f"autopar db import: note: skipped "
              f"{summarize_problems(problem for _, problem in report.invalid)} "
              f"on lines {lines}{more}", file=sys.stderr)
    return 0


def _remove(db: TuningDB, args: argparse.Namespace) -> int:
    target = getattr(args, "target", None)
    found = db.remove(args.key, target, invalid_only=args.invalid, dry_run=args.dry_run)
    what = "invalid records" if args.invalid else "records"
    scope = (f" of {args.key}" if args.key else "") + (f" on target {target}" if target else "")
    if not found:
        if args.key is not None and not args.invalid:
            raise TuningDBError(f"no records of workload {args.key!r} in {db.path}"
                                f"{_suggestion(db, args.key, target)}")
        print(f"no {what}{scope} in {db.path}; nothing to remove")
        return 0
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(found)} {what}{scope} from {db.path}")
    problems = [p for _, p in found if p is not None]
    if problems:
        print(f"  {summarize_problems(problems)}")
    if args.dry_run:
        print("dry run: nothing was deleted; run again without --dry-run to delete them")
    return 0


def _resolve_key(db: TuningDB, key: str, target: str | None) -> str:
    """An exact workload key, or the one key that starts with `key`."""
    keys = [k for k, _, _ in db.workloads(target_key=target)]
    if key in keys:
        return key
    prefixed = [k for k in keys if k.startswith(key)]
    if len(prefixed) == 1:
        return prefixed[0]
    if prefixed:
        raise TuningDBError(
            f"{key!r} is the start of {len(prefixed)} workload keys ({', '.join(prefixed[:5])}"
            f"{', ...' if len(prefixed) > 5 else ''}); give more of the key"
        )
    where = f" for target {target}" if target else ""
    raise TuningDBError(f"no workload {key!r} in {db.path}{where}{_suggestion(db, key, target)}")


def _suggestion(db: TuningDB, key: str, target: str | None) -> str:
    """'; did you mean ...?' with the closest workload keys, or where to see them."""
    close = difflib.get_close_matches(key, [k for k, _, _ in db.workloads(target_key=target)], n=3)
    return f"; did you mean {' or '.join(close)}?" if close else "; `autopar db list` shows them"


def _format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _gflops(record: TuningRecord | None) -> str:
    if record is None or not record.ok or record.latency_s <= 0:
        return "-"
    flops = _task_flops(record.task)
    return "-" if flops is None else f"{flops / record.latency_s / 1e9:.2f}"


def _task_flops(task: dict[str, Any]) -> float | None:
    """The FLOPs a record's task states, else those of its compute definition (`Task.flops`, as
    `search.tune` stores {op, params, dtype}); None for a task neither describes."""
    flops = task.get("flops")
    if isinstance(flops, (int, float)) and not isinstance(flops, bool):
        return flops
    try:
        return Task.from_dict(task).flops
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _format_step(step: Any) -> str:
    """`name(arg=value, ...)` for a dict step that names its transform, else its JSON."""
    if isinstance(step, dict):
        for name_field in ("kind", "op", "name", "type"):
            if isinstance(step.get(name_field), str):
                rest = ", ".join(
                    f"{k}={json.dumps(v)}" for k, v in sorted(step.items()) if k != name_field
                )
                return f"{step[name_field]}({rest})"
    return json.dumps(step, sort_keys=True)


def _console(min_width: int) -> Console:
    """Stdout console; when piped, wide enough that keys stay whole for grep."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(120, min_width))
    return console
