"""The ``vpipe`` console script: the whole command, or the library's commands alone without the lab extra.

``pip install vpipe`` installs the library's dependencies only; the laboratory's commands
need rich (``pip install 'vpipe[lab]'``). Without it ``vpipe plan``, ``planner``, ``keys``
and ``trace`` still run, and a laboratory command says in one line what it needs.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from vpipe import cli as library_cli

__all__ = ["LAB_COMMANDS", "main"]

LAB_COMMANDS = ("demo", "train", "nas", "logs", "plot", "bench")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if importlib.util.find_spec("rich") is None:
        command = next((a for a in argv if not a.startswith("-")), None)
        if command in LAB_COMMANDS:
            print(f"vpipe {command} is a vpipe laboratory command and needs rich: pip install 'vpipe[lab]'",
                  file=sys.stderr)
            return 2
        parser, _ = library_cli.build_parser()
        parser.epilog = f"{', '.join(LAB_COMMANDS)}: pip install 'vpipe[lab]'"
        return library_cli.run(parser, argv)
    from vpipe_lab.cli import main as lab_main

    return lab_main(argv)


if __name__ == "__main__":
    sys.exit(main())
