"""`autopar db {list,show,export,import}`: inspect and share the kernel tuning database."""
from __future__ import annotations

import argparse
import datetime
import difflib
import json
import math
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from search.database import ENV_VAR, TuningDB, TuningDBError, default_db_path
from search.record import TuningRecord


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `db` subcommands to `parser` (the parser of `autopar db`)."""
    _add_db_option(parser, default=None)
    sub = parser.add_subparsers(dest="db_command", metavar="{list,show,export,import}")
    sub.required = True
    p = sub.add_parser("list", help="table of tuned workloads: records, best latency, GFLOP/s")
    _add_db_option(p)
    _add_target_option(p)
    p = sub.add_parser("show", help="the best record of one workload and its schedule steps")
    p.add_argument("key", help="workload key (or a unique prefix of one)")
    _add_db_option(p)
    _add_target_option(p)
    p = sub.add_parser("export", help="write records as JSON lines, for another machine")
    p.add_argument("out", metavar="OUT.jsonl", help="file to write (replaced atomically)")
    p.add_argument("--workload", default=None, help="export only this workload key")
    _add_db_option(p)
    _add_target_option(p)
    p = sub.add_parser("import", help="add records from a JSON-lines file, skipping duplicates")
    p.add_argument("src", metavar="IN.jsonl", help="file written by `autopar db export`")
    _add_db_option(p)


def run(args: argparse.Namespace) -> int:
    """Run one `autopar db` subcommand; returns the process exit code (0 ok, 1 error)."""
    command = getattr(args, "db_command", None)
    handlers = {"list": _list, "show": _show, "export": _export, "import": _import}
    if command not in handlers:
        print(f"autopar db: error: choose one of {', '.join(handlers)}", file=sys.stderr)
        return 2
    path = getattr(args, "db", None)
    try:
        # Reading commands never create a database file; import creates one if needed.
        with TuningDB(path, create=command == "import") as db:
            return handlers[command](db, args)
    except TuningDBError as e:
        print(f"autopar db {command}: error: {e}", file=sys.stderr)
        return 1


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
    for key, n_records, best_latency_s in rows:
        best = db.best(key, target) if math.isfinite(best_latency_s) else None
        table.add_row(key, str(n_records), _format_seconds(best_latency_s), _gflops(best))
    _console(max(len(key) for key, _, _ in rows) + 50).print(table)
    return 0


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
    return 0


def _import(db: TuningDB, args: argparse.Namespace) -> int:
    n = db.import_jsonl(args.src)
    print(f"imported {n} new records from {args.src} into {db.path} (exact duplicates skipped)")
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
    close = difflib.get_close_matches(key, keys, n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; `autopar db list` shows them"
    where = f" for target {target}" if target else ""
    raise TuningDBError(f"no workload {key!r} in {db.path}{where}{hint}")


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
    flops = record.task.get("flops")
    if isinstance(flops, bool) or not isinstance(flops, (int, float)):
        return "-"
    return f"{flops / record.latency_s / 1e9:.2f}"


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
