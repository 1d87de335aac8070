"""``vpipe logs FILE``: a run's decisions as a readable timeline (a rich table).

Each row is one decision (logger ``vpipe.decisions``): seconds since the first record
of the log, who made it (a rank, or the planner daemon), the event, its message and the
numbers that came with it. ``--all`` adds every other log record (warnings and so on).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from vpipe.log import DECISIONS, read_log

__all__ = ["timeline_rows", "decision_rows", "render", "register", "printable"]

_BOOKKEEPING = {"t", "rank", "logger", "level", "msg", "event", "exc", "role"}


def _who(record: dict[str, Any]) -> str:
    if record.get("role") == "planner":
        return "planner"
    rank = record.get("rank")
    return "-" if rank is None else str(rank)


MAX_CELL = 4000  # characters of one cell shown; the table's folding is quadratic in a cell's length


def printable(text: str) -> str:
    """``text`` with control and format characters written as escapes: a log's messages (plan reasons come
    from the wire) must not move the cursor, retitle the terminal or reorder what it shows. A cell longer
    than :data:`MAX_CELL` is cut, saying how much (a 16 MB line took 44 s to fold whole)."""
    cut = len(text) - MAX_CELL
    if cut > 0:
        text = text[:MAX_CELL]
    shown = "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii")
                    for ch in text)
    return shown + (f" ... ({cut} more characters)" if cut > 0 else "")


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return json.dumps(list(value[:8]))[:-1] + ", ...]"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def timeline_rows(records: Iterable[dict[str, Any]], *, everything: bool = False,
                  events: set[str] | None = None) -> list[tuple[str, str, str, str, str]]:
    """(time, who, event, message, details) per record, oldest first."""
    records = list(records)
    times = [r["t"] for r in records if isinstance(r.get("t"), (int, float))]
    start = min(times) if times else 0.0
    rows = []
    for r in records:
        is_decision = r.get("logger") == DECISIONS
        if not (is_decision or everything):
            continue
        event = str(r.get("event", "")) if is_decision else str(r.get("level", "")).lower()
        if events and event not in events:
            continue
        t = r.get("t")
        when = f"{t - start:9.3f}" if isinstance(t, (int, float)) else "?"
        details = "  ".join(f"{k}={_number(v)}" for k, v in r.items() if k not in _BOOKKEEPING)
        rows.append((when, printable(_who(r)), printable(event), printable(str(r.get("msg", ""))),
                     printable(details)))
    return rows


def decision_rows(records: Iterable[dict[str, Any]], events: set[str]) -> list[tuple[str, str, str, str,
                                                                                     str]]:
    """The timeline of ``events``, with layer edits (which every rank logs) shown once, as rank 0 saw them."""
    return [row for row in timeline_rows(records, events=events) if not row[2].startswith("layers_")
            or row[1] == "0"]


def render(path: str, *, everything: bool = False, events: set[str] | None = None) -> int:
    rows = timeline_rows(read_log(path), everything=everything, events=events)
    console = Console()
    if not console.is_terminal:  # into a file or a pipe: wide rows that grep can find whole
        console = Console(width=max(console.width, 200))
    if not rows:
        console.print(Text(f"no {'records' if everything else 'decisions'} in {printable(path)}"))
        return 0
    table = Table(title=Text(f"vpipe decisions: {printable(path)}"), show_lines=False)
    table.add_column("t [s]", justify="right", no_wrap=True, min_width=9)
    table.add_column("who", no_wrap=True)
    table.add_column("event", style="bold", no_wrap=True)
    table.add_column("message", overflow="fold")
    table.add_column("numbers", style="dim", overflow="fold")
    for row in rows:
        style = "red" if row[2] in ("planner_lost", "planner_error", "error", "warning") else None
        table.add_row(*(Text(cell) for cell in row), style=style)  # Text: a log's "[...]" is not rich markup
    console.print(table)
    return 0


def register(subparsers: Any) -> None:
    """Add ``vpipe logs`` to the CLI."""
    p = subparsers.add_parser("logs", help="show a run's decisions as a timeline")
    p.add_argument("file", help="a run log written with --log-file")
    p.add_argument("--all", action="store_true", help="include every log record, not only decisions")
    p.add_argument("--event", action="append", default=None, help="show only this event (repeatable)")
    p.set_defaults(func=cmd_logs)


def cmd_logs(args: argparse.Namespace, argv: Any = None) -> int:
    return render(args.file, everything=args.all, events=set(args.event) if args.event else None)
