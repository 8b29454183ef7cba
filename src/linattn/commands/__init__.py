"""Subcommands of the `linattn` CLI, one module each.

Contract: a module here defines `add_parser(subparsers)` that calls `subparsers.add_parser(name, ...)`,
adds its arguments (shared ones via `linattn.cli.add_common_options`) and sets
`func=callable(args) -> int` with `set_defaults`. `linattn.cli` imports every module of this package
(sorted by name) and calls it. Keep commands thin: parse, call the library, print, return a status.
"""
