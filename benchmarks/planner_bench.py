"""Planner benchmark: time and gap to the optimum of vPipe's partitioner on the paper's models.

For each zoo graph (BERT-large, Transformer, AmoebaNet, GNMT) and 4 to 128 stages it
reports, like the paper's Table 4:

- the coarse graph (nodes, edges) that Alg. 3's coarsening produces;
- ``plan_pipeline(method="kl")``: median planning time over ``--repeats`` runs (the
  machine is shared, so one run proves little), slowest stage, boundary bytes;
- the exact oracle (``method="exact"``): its time, and the vpipe plan's gap to it (slowest
  stage) and to its fewest boundary bytes, at every size;
- networkx's plain Kernighan-Lin, recursive bisection of the uncoarsened graph into the
  same number of parts (edge weight = bytes): its time, whether the parts form a valid
  pipeline (they do not: KL ignores the execution order), the gap of its slowest part
  (its layers' time plus the bytes it receives) and its cut bytes.

Prints a rich table; ``--json OUT`` also writes every number.

    python benchmarks/planner_bench.py [--repeats 5] [--graphs
    amoebanet gnmt] [--stages 16 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import networkx as nx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from vpipe.graph import LayerGraph  # noqa: E402
from vpipe.planner.coarsen import coarsen  # noqa: E402
from vpipe.planner.cost_model import GraphProfile, Hardware, PipelineSetup, StageCosts  # noqa: E402
from vpipe.planner.partition import is_valid_pipeline  # noqa: E402
from vpipe.planner.srp import plan_pipeline  # noqa: E402
from vpipe_lab.runtime import zoo  # noqa: E402

STAGES = (4, 8, 16, 32, 64, 128)


def networkx_kl(graph: LayerGraph, parts: int, seed: int = 0) -> list[list[int]]:
    """Recursive bisection with networkx's Kernighan-Lin on the undirected graph."""
    undirected = nx.Graph()
    undirected.add_nodes_from(graph.ids)
    for s, d, b in graph.edges:
        w = undirected.get_edge_data(s, d, {"weight": 0})["weight"]
        undirected.add_edge(s, d, weight=w + b)

    def split(nodes: list[int], count: int) -> list[list[int]]:
        if count == 1 or len(nodes) < 2:
            return [nodes]
        left, right = nx.algorithms.community.kernighan_lin_bisection(
            undirected.subgraph(nodes), weight="weight", seed=seed)
        return split(sorted(left), count // 2) + split(sorted(right), count - count // 2)

    order = {lid: i for i, lid in enumerate(graph.ids)}
    result = [sorted(p, key=order.get) for p in split(list(graph.ids), parts) if p]
    return sorted(result, key=lambda p: order[p[0]])


def parts_cost(graph: LayerGraph, parts: list[list[int]], hardware: Hardware) -> tuple[float, int]:
    """Slowest part (its layers' time + the bytes it receives) and total cut bytes, a source's
    tensor counted once per receiving part, as the planner's cost model counts boundaries."""
    part_of = {lid: k for k, p in enumerate(parts) for lid in p}
    received: dict[tuple[int, int], int] = {}
    for s, d, b in graph.edges:
        if part_of[s] != part_of[d]:
            key = (s, part_of[d])
            received[key] = max(received.get(key, 0), b)
    times = [sum(graph.node(lid).cost_s for lid in p) for p in parts]
    for (_, k), b in received.items():
        times[k] += b / hardware.net_bytes_per_s
    return max(times), sum(received.values())


def bench_graph(name: str, graph: LayerGraph, repeats: int, with_networkx: bool,
                stages: tuple[int, ...] = STAGES) -> list[dict[str, Any]]:
    rows = []
    hardware = Hardware()
    for p in stages:
        costs = StageCosts(GraphProfile(graph), PipelineSetup(p, hardware=hardware))
        coarse = coarsen(costs, p)
        kl_times, kl = [], None
        for _ in range(repeats):
            kl = plan_pipeline(graph, p)
            kl_times.append(kl.planner_s)
        exact = plan_pipeline(graph, p, method="exact")
        row: dict[str, Any] = {
            "graph": name, "nodes": len(graph), "edges": len(graph.edges), "stages": p,
            "coarse_nodes": coarse.num_nodes, "coarse_edges": coarse.coarse_edges,
            "kl_s_median": statistics.median(kl_times), "kl_s_all": kl_times,
            "kl_bottleneck_ms": kl.bottleneck_s * 1e3, "kl_comm_bytes": kl.comm_bytes,
            "kl_valid": is_valid_pipeline(graph.ids, graph.edges, kl.stages),
            "exact_s": exact.planner_s, "exact_bottleneck_ms": exact.bottleneck_s * 1e3,
            "exact_comm_bytes": exact.comm_bytes,
            "kl_gap": kl.bottleneck_s / exact.bottleneck_s - 1,
            "kl_bytes_gap": kl.comm_bytes / exact.comm_bytes - 1 if exact.comm_bytes else 0.0,
        }
        if with_networkx:
            started = time.perf_counter()
            parts = networkx_kl(graph, p)
            row["nx_s"] = time.perf_counter() - started
            slowest, cut = parts_cost(graph, parts, hardware)
            row.update(nx_valid=is_valid_pipeline(graph.ids, graph.edges, parts), nx_parts=len(parts),
                       nx_bottleneck_ms=slowest * 1e3, nx_gap=slowest / exact.bottleneck_s - 1,
                       nx_comm_bytes=cut)
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]], console: Console) -> None:
    table = (Table(title="vPipe planner (coarsen + coarse-chain DP + refine) vs exact optimum "
                         "vs networkx plain KL"))
    columns = ["graph", "n/e", "P", "coarse n/e", "kl ms (median)", "kl gap", "kl bytes gap", "valid",
               "exact ms", "nx KL ms", "nx valid", "nx gap"]
    for c in columns:
        table.add_column(c, justify="left" if c == "graph" else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            r["graph"], f"{r['nodes']}/{r['edges']}", str(r["stages"]),
                      f"{r['coarse_nodes']}/{r['coarse_edges']}",
            f"{r['kl_s_median'] * 1e3:.1f}", f"{r['kl_gap']:+.2%}", f"{r['kl_bytes_gap']:+.2%}",
            "yes" if r["kl_valid"] else "NO", f"{r['exact_s'] * 1e3:.0f}",
            f"{r['nx_s'] * 1e3:.0f}" if "nx_s" in r else "-",
            ("yes" if r["nx_valid"] else "no") if "nx_valid" in r else "-",
            f"{r['nx_gap']:+.1%}" if "nx_gap" in r else "-",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="KL runs per case; the median is reported")
    parser.add_argument("--graphs", nargs="*", default=list(zoo.ZOO), choices=list(zoo.ZOO))
    parser.add_argument("--stages", nargs="*", type=int, default=list(STAGES), help="pipeline depths")
    parser.add_argument("--no-networkx", action="store_true", help="skip networkx's plain KL")
    parser.add_argument("--json", metavar="OUT", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    console = Console(width=160)
    rows: list[dict[str, Any]] = []
    for name in args.graphs:
        started = time.perf_counter()
        graph = zoo.build(name)
        console.print(f"built {name}: {len(graph)} nodes, {len(graph.edges)} edges in "
                      f"{time.perf_counter() - started:.1f} s")
        rows.extend(bench_graph(name, graph, args.repeats, not args.no_networkx, tuple(args.stages)))
    render(rows, console)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine_note": "shared 2-core CPU; times are medians",
                                               "rows": rows}, indent=1))
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
