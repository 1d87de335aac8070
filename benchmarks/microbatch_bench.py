"""The largest micro-batch each system trains under one fixed per-stage memory budget.

vPipe reports training micro-batches 3.75x larger than PipeDream's on the same GPUs. Here
the budget is what PipeDream (every activation kept, weight stashing) needs at
``--pipedream-size`` samples per micro-batch on its fullest stage, i.e. a device on which
PipeDream just fits that size; every system then gets that same budget on every stage:

  GPipe (all D), 1F1B (all D), PipeDream (all D)   every activation kept
  GPipe (all R)                                    every layer recomputed (torch checkpoint)
  GPipe / 1F1B / PipeDream + vpipe                 start all kept; the tensor manager
                                                   escalates keep -> swap -> recompute
                                                   whenever the next micro-batch would not fit

"Trains" is decided by :func:`vpipe_lab.runtime.fit.pipeline_fit`: every stage run for real
for two steps in this process, in its schedule's order, under the real tensor manager
(managed for vpipe: fits unless it raises ``MemoryBudgetError``; accounting only for the
baselines: fits if weights + gradients + optimizer state + stashed weight versions +
peak saved activations + a recomputed layer's working set stay within the budget). The
search doubles the micro-batch size until it fails, then bisects, up to ``--max-size``
(a system still fitting there is reported as ">= max"). Swapped bytes go to the host
pool, which this benchmark does not limit. No step is timed, but vpipe's budget picks the
layers to swap or recompute by their measured times, and a recomputed layer's working set
counts in the fit: on a loaded machine the choice, and so the vpipe rows, can differ (run
it alone).

    python benchmarks/microbatch_bench.py [--cases transformer:2,cnn:2] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vpipe_lab.runtime.config import RunConfig  # noqa: E402
from vpipe_lab.runtime.fit import largest_fitting, pipeline_fit  # noqa: E402

REFERENCE = "PipeDream (all D)"
# label -> (schedule, policy, managed by vpipe)
SYSTEMS: dict[str, tuple[str, str, bool]] = {
    "GPipe (all D)": ("gpipe", "D", False),
    "GPipe (all R)": ("gpipe", "R", False),
    "1F1B (all D)": ("1f1b", "D", False),
    REFERENCE: ("pipedream", "D", False),
    "GPipe + vpipe": ("gpipe", "D", True),
    "1F1B + vpipe": ("1f1b", "D", True),
    "PipeDream + vpipe": ("pipedream", "D", True),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="transformer:2,transformer:4,cnn:2",
                   help="model:stages, comma-separated (models: transformer, cnn)")
    p.add_argument("--blocks", type=int, default=4, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (>= stages)")
    p.add_argument("--pipedream-size", type=int, default=4,
                   help="the budget is what PipeDream (all D) needs at this micro-batch size")
    p.add_argument("--max-size", type=int, default=256, help="stop searching above this micro-batch size")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def base_config(args: argparse.Namespace, model: str, stages: int) -> RunConfig:
    return RunConfig(model=model, blocks=args.blocks, d_model=args.d_model, seq_len=args.seq_len,
                     stages=stages,
                     micro_batches=max(args.micro_batches, stages), micro_batch_size=args.pipedream_size,
                     progress=False)


def run_case(args: argparse.Namespace, model: str, stages: int) -> dict[str, Any]:
    base = base_config(args, model, stages)
    reference = pipeline_fit(dataclasses.replace(base, schedule="pipedream"), 1 << 62, managed=False)
    budget = max(s.footprint_bytes for s in reference.stages)
    rows = []
    for label, (schedule, policy, managed) in SYSTEMS.items():
        started = time.perf_counter()
        results: dict[int, dict[str, Any]] = {}

        def fits(size: int) -> bool:
            cfg = dataclasses.replace(base, schedule=schedule, micro_batch_size=size)
            results[size] = pipeline_fit(cfg, budget, managed=managed, policy=policy).to_dict()
            return results[size]["fits"]

        size = largest_fitting(fits, high=args.max_size)
        at = results.get(size, {})
        rows.append({"system": label, "schedule": schedule, "policy": policy, "vpipe": managed,
                     "max_micro_batch_size": size, "capped": size >= args.max_size,
                     "policies": [s["policies"] for s in at.get("stages", [])] if managed else None,
                     "footprint_bytes": [s["footprint_bytes"] for s in at.get("stages", [])],
                     "search_s": time.perf_counter() - started})
    ref = next(r["max_micro_batch_size"] for r in rows if r["system"] == REFERENCE)
    for r in rows:
        r["vs_pipedream"] = r["max_micro_batch_size"] / ref if ref else None
    return {"model": model, "stages": stages, "micro_batches": base.micro_batches, "budget_bytes": budget,
            "partition": base.layer_counts(),
            "budget_rule": f"PipeDream (all D) at micro-batch {args.pipedream_size}",
            "rows": rows}


def print_case(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from vpipe.tensor_manager.accounting import format_bytes

    table = Table(
        title=(
            f"{result['model']} on {result['stages']} stages, {result['micro_batches']} micro-batches: "
            f"budget {format_bytes(result['budget_bytes'])} per stage ({result['budget_rule']})"
        )
    )
    for col in ("system", "max micro-batch", f"vs {REFERENCE}", "policies at max (per stage)"):
        table.add_column(col, justify="left" if col in ("system", "policies at max (per stage)") else "right")
    for r in result["rows"]:
        size = f">= {r['max_micro_batch_size']}" if r["capped"] else str(r["max_micro_batch_size"])
        ratio = ("-" if r["vs_pipedream"] is None
                 else f"{'>= ' if r['capped'] else ''}{r['vs_pipedream']:.2f}x")
        table.add_row(r["system"], size, ratio, " | ".join(r["policies"] or []))
    Console(width=150).print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    results = []
    for item in args.cases.split(","):
        model, _, stages = item.partition(":")
        if model not in ("transformer", "cnn") or not stages.isdigit():
            raise SystemExit(f"microbatch_bench: cases look like transformer:2,cnn:2, got {item!r}")
        results.append(run_case(args, model, int(stages)))
        print_case(results[-1])
    out = {"benchmark": "microbatch", "cases": results, "seconds": time.perf_counter() - started,
           "config": {k: v for k, v in vars(args).items() if k != "json"}}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
