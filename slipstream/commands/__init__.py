"""Subcommands of the `slipstream` CLI, one module each (see slipstream/cli.py)."""
