"""``python -m vpipe_lab.report``: regenerate the README's headline, the docs' tables and the plots.

The tables are written between their markers (``<!-- headline:start -->`` ..., the docs'
``results`` and ``gpu`` sections), so the
rest of each file stays as it is; without ``--readme``, ``--docs`` or ``--plots`` the
headline table is printed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from vpipe_lab.report.gpu import gpu_markdown
from vpipe_lab.report.headline import headline_markdown
from vpipe_lab.report.plots import plot
from vpipe_lab.report.results import load_results
from vpipe_lab.report.tables import results_markdown

__all__ = ["replace_between", "main"]

DESCRIPTION = ("Benchmark results users can read: the README's headline table, docs tables and "
               "plots, from the JSON.")


def replace_between(text: str, marker: str, body: str) -> str:
    """``text`` with what lies between ``<!-- marker:start -->`` and
    ``<!-- marker:end -->`` replaced by ``body``."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"markers {start} ... {end} not found")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", text, count=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vpipe_lab.report", description=DESCRIPTION)
    p.add_argument("results", nargs="?", default="docs/results",
                   help="directory of NAME.json (default docs/results)")
    p.add_argument("--readme", default=None, help="rewrite its headline table (between the headline markers)")
    p.add_argument("--docs", default=None, help="rewrite its full tables (between the results markers)")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here (needs matplotlib)")
    args = p.parse_args(argv)
    try:
        results = load_results(Path(args.results))
        if args.readme:
            path = Path(args.readme)
            path.write_text(replace_between(path.read_text(), "headline", headline_markdown(results)))
        if args.docs:
            path = Path(args.docs)
            text = replace_between(path.read_text(), "results", results_markdown(results))
            path.write_text(replace_between(text, "gpu", gpu_markdown(results)))
        written = plot(results, Path(args.plots)) if args.plots else []
    except ValueError as e:
        print(f"vpipe_lab.report: error: {e}", file=sys.stderr)
        return 2
    if not (args.readme or args.docs or args.plots):
        print(headline_markdown(results))
    for path in written:
        print(f"wrote {path}")
    return 0
