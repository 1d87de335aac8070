"""The library's command line, ``python -m vpipe``: ``plan | planner | keys | trace``.

These commands need only the library's own dependencies. The ``vpipe`` command that
``pip install`` puts on the PATH adds the laboratory's commands (``demo``, ``train``,
``nas``, ``logs``, ``plot``, ``bench``) on top of these.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from vpipe import __version__, timeline
from vpipe.checks import shorten
from vpipe.control import daemon, keys
from vpipe.planner.cli import register as register_plan

__all__ = ["build_parser", "register_commands", "run", "main"]


def register_commands(sub: Any) -> None:
    """Add the library's subcommands to a parser's subparsers (the lab's ``vpipe`` command adds its own)."""
    register_plan(sub)
    daemon.register(sub)
    keys.register(sub)
    timeline.register(sub)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its error line cut where it echoes an overlong value (:func:`vpipe.checks.shorten`);
    its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        super().error(shorten(message))


def build_parser(description: str | None = None) -> tuple[argparse.ArgumentParser, Any]:
    """The ``vpipe`` parser with the library's subcommands, and its subparsers for more."""
    parser = _Parser(prog="vpipe", description=description or __doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"vpipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    register_commands(sub)
    return parser, sub


def run(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """Parse ``argv`` and run its subcommand; a ``ValueError`` is the user's input, said in one line."""
    args = parser.parse_args(list(argv))
    try:
        return int(args.func(args, list(argv)) or 0)
    except ValueError as e:
        print(shorten(f"vpipe: error: {e}"), file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser, _ = build_parser()
    return run(parser, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
