"""`CommandParser`: the argparse parser of `deltaspec` and each of its subcommands.

It takes no abbreviation of a flag (argparse's default would read `-t 2` as `-tp 2`), and a subcommand refuses
an argument it does not know itself, so the error shows that subcommand's usage line rather than the top-level
one. The usage line of an error is short (the positional arguments and `[options]`); --help shows every flag.
"""

from __future__ import annotations

import argparse


class CommandParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's, but arguments this parser does not know are a usage error of this parser."""
        parsed, unknown = super().parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}; '{self.prog} --help' lists the options.")
        return parsed, unknown

    def format_usage(self) -> str:
        """`usage: PROG [options] POSITIONALS`: one line, where argparse's lists every flag."""
        formatter = self._get_formatter()
        formatter.add_usage(None, [action for action in self._actions if not action.option_strings], [], prefix="")
        positionals = formatter.format_help().strip().removeprefix(self.prog)
        return f"usage: {self.prog} [options]{positionals}\n"
