"""The `autopar` command line: demo, plan, inspect, tune, db."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module under autopar.commands, one-line help)
COMMANDS = {
    "demo": ("demo", "plan and run a small GPT train step on this machine and check it against one device"),
    "plan": ("plan", "plan a built-in model family for a cluster that need not exist here"),
    "inspect": ("inspect", "show a saved plan: stages, meshes, shardings, predicted costs"),
    "tune": ("tune", "tune a tensor-program kernel and store the measurements in the tuning database"),
    "db": ("db", "list, show, export or import the tuning database"),
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """All subcommands are listed; only the selected one's module is imported (fast startup)."""
    parser = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization of JAX train steps.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            mod = importlib.import_module(f"autopar.commands.{module}")
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "demo":
        from autopar.commands.demo import ensure_simulated_devices

        ensure_simulated_devices()
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
