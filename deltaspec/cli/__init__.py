"""The `deltaspec` command line: `main` parses the arguments, runs the subcommand, and turns a user error into one
`error: ...` line with exit status 2. Modules: `commands` (the subcommands), `flags` (flags generated from the
config dataclasses, sampling flags), `speculative_config` (vLLM's JSON flag), `generation` (generate, chat)."""

from __future__ import annotations

import sys

from deltaspec.cli.commands import build_parser
from deltaspec.cli.flags import config_from_args, engine_config
from deltaspec.errors import DeltaspecError

__all__ = ["build_parser", "config_from_args", "engine_config", "main"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except DeltaspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code or 0
