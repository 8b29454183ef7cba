"""The `linattn` command line (`linattn.cli.app`); argument types in `linattn.cli.args`."""

from .app import main

__all__ = ["main"]
