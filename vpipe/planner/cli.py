"""``vpipe plan``: plan a layer graph offline and print the plan (a table, or JSON with ``--json``).

Every problem with the input (unreadable or invalid graph, bad numbers, a budget no plan
fits) ends the command with exit status 2 and one line ``vpipe: error: ...``; argument
errors too, so scripts get the same one-line diagnostics whatever went wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

from vpipe.planner.cost_model import SCHEDULES, Hardware
from vpipe.sizes import parse_bytes as _parse_size

__all__ = ["register", "parse_bytes", "cmd_plan"]

def parse_bytes(text: str) -> int:
    """A memory budget as the user typed it (see :mod:`vpipe.sizes`)."""
    return _parse_size(text, what="memory budget")


def _positive_int(what: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value}")
    return value


def _positive_float(what: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{what} must be a positive finite number, got {text!r}")
    return value


def _one_line_error(message: str) -> NoReturn:
    print(f"vpipe: error: {message}", file=sys.stderr)
    sys.exit(2)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to the ``vpipe`` parser."""
    p = subparsers.add_parser(
        "plan", help="plan a layer graph onto pipeline stages (partition + swap/recompute policies)",
        description="Partition GRAPH.json into contiguous pipeline stages and choose each layer's "
                    "keep (D) / swap (S) / recompute (R) policy (vPipe's SRP search).")
    p.error = _one_line_error  # type: ignore[method-assign]  # one line, never a usage dump
    p.add_argument("graph", metavar="GRAPH.json", help="layer graph (docs/graph-format.md)")
    p.add_argument("--stages", required=True, metavar="P", help="number of pipeline stages")
    p.add_argument("--memory-budget", metavar="BYTES", default=None,
                   help="device memory per stage, e.g. 16e9, 16GB, 15GiB, or one per stage: 8GB,8GB,12GB")
    p.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (default 1f1b)")
    p.add_argument("--micro-batches", default="8", metavar="M", help="micro-batches per step (default 8)")
    p.add_argument("--method", default="kl", help="kl (vPipe's Alg. 3, default) or exact (optimal DP)")
    p.add_argument("--copy-bandwidth", default=None, metavar="BYTES_PER_S",
                   help=f"device-host copy link for swaps (default {Hardware().copy_bytes_per_s:.3g})")
    p.add_argument("--network-bandwidth", default=None, metavar="BYTES_PER_S",
                   help=f"link between neighbouring stages (default {Hardware().net_bytes_per_s:.3g})")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=cmd_plan)
    return p


def _budget(text: str | None) -> int | list[int] | None:
    if text is None:
        return None
    parts = [parse_bytes(part) for part in text.split(",")]
    return parts[0] if len(parts) == 1 else parts


def cmd_plan(args: argparse.Namespace, argv: object = None) -> int:
    from vpipe.graph import LayerGraph
    from vpipe.planner.srp import METHODS, plan_pipeline

    stages = _positive_int("--stages", args.stages)
    micro_batches = _positive_int("--micro-batches", args.micro_batches)
    if args.schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {args.schedule!r}")
    if args.method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {args.method!r}")
    budget = _budget(args.memory_budget)
    defaults = Hardware()
    hardware = Hardware(
        copy_bytes_per_s=(_positive_float("--copy-bandwidth", args.copy_bandwidth)
                          if args.copy_bandwidth is not None else defaults.copy_bytes_per_s),
        net_bytes_per_s=(_positive_float("--network-bandwidth", args.network_bandwidth)
                         if args.network_bandwidth is not None else defaults.net_bytes_per_s),
    )
    graph = LayerGraph.load(args.graph)
    if stages > len(graph):
        raise ValueError(f"--stages {stages} is more than the graph's {len(graph)} layers")
    result = plan_pipeline(graph, stages, schedule=args.schedule, micro_batches=micro_batches,
                           memory_budget=budget, method=args.method, hardware=hardware)
    if args.json:
        print(json.dumps(result.summary()))
    else:
        _print_table(graph, result, args)
    return 0


def _print_table(graph: object, result: object, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from vpipe.plan import Policy

    table = Table(title=f"{getattr(graph, 'name', 'graph')}: {len(result.stages)} stages, "
                        f"{args.schedule}, {args.micro_batches} micro-batches, method {result.method}")
    for column in ("stage", "layers", "ids", "time ms", "memory", "swap", "recompute", "boundary out"):
        table.add_column(column, justify="left" if column == "ids" else "right", no_wrap=True)
    from vpipe.planner.cost_model import GraphProfile

    profile = GraphProfile(graph)  # type: ignore[arg-type]
    end = 0
    for k, layers in enumerate(result.stages):
        end += len(layers)
        swaps = sum(1 for lid in layers if result.policies[lid] is Policy.SWAP)
        recomputes = sum(1 for lid in layers if result.policies[lid] is Policy.RECOMPUTE)
        out_bytes = profile.cut[end] if end < profile.n else 0.0
        table.add_row(str(k), str(len(layers)), f"{layers[0]}..{layers[-1]}",
                      f"{result.stage_times_s[k] * 1e3:.3f}", _human(result.stage_memory_bytes[k]),
                      str(swaps), str(recomputes), _human(out_bytes))
    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=120)
    console.print(table)
    console.print(f"slowest stage {result.bottleneck_s * 1e3:.3f} ms, step {result.step_s * 1e3:.3f} ms "
                  f"(bubble included), boundary bytes {result.comm_bytes:,}, planned in "
                  f"{result.planner_s * 1e3:.1f} ms ({result.iterations} SRP iteration(s))")


def _human(nbytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"
