"""Subcommands of the `autopar` command line, one module each."""
