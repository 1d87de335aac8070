"""Under a budget plain 1F1B overflows: vpipe's throughput vs GPipe with full recompute (the usual way out).

Scenario (2 stages, CPU): a per-stage budget between stage 0's all-recompute and all-kept
footprints. Three systems at the same micro-batch size:

- **1F1B kept** (plain, every activation kept): the fastest schedule, but its stage 0 exceeds
  the budget, so it could not run on a device of that size: only its footprint is measured
  (``--run-over-budget`` also runs it, for its throughput);
- **GPipe recompute**: every layer recomputed in the backward (torchgpipe's checkpointing,
  here through vpipe's tensor manager with policy R and planning off): fits, pays a forward;
- **vpipe**: 1F1B with ``vpipe.attach`` and the budget: the tensor manager keeps what fits and
  swaps or recomputes only the rest, the planner may move layers.

Footprints are vpipe's accounting (weights, gradients, optimizer state, peak saved
activations) from each run's ranks; plain 1F1B's is measured by :func:`vpipe_lab.runtime.fit.pipeline_fit`.
Runs alternate in order and the ratio vpipe / GPipe-recompute is taken within each round.
Run: ``python benchmarks/memory_budget.py [--json OUT]`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vpipe_lab.runtime.config import RunConfig  # noqa: E402
from vpipe_lab.runtime.fit import pipeline_fit  # noqa: E402
from vpipe_lab.runtime.measure import run_training  # noqa: E402

MODEL = dict(model="transformer", blocks=4, d_model=128, n_heads=4, seq_len=64, micro_batches=4,
             micro_batch_size=8,
             dropout=0.0, stages=2)
BUDGET = 18 * 2**20


def variants(steps: int, budget: int) -> dict[str, RunConfig]:
    common = dict(MODEL, steps=steps)
    return {
        "1f1b_kept": RunConfig(**common, schedule="1f1b"),
        "gpipe_recompute": RunConfig(**common, schedule="gpipe", vpipe=True, planning=False, policy="R"),
        "vpipe": RunConfig(**common, schedule="1f1b", vpipe=True, memory_budget=budget, monitor_every=2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=BUDGET, help="per-stage bytes")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--run-over-budget", action="store_true",
                        help="also run plain 1F1B, which exceeds the budget (for its throughput)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    cfgs = variants(args.steps, args.budget)
    timed = [name for name in cfgs if args.run_over_budget or name != "1f1b_kept"]
    plain_fit = pipeline_fit(cfgs["1f1b_kept"], args.budget, managed=False, policy="D")
    samples = MODEL["micro_batches"] * MODEL["micro_batch_size"]
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = timed if r % 2 == 0 else timed[::-1]
        got: dict[str, Any] = {}
        for name in order:
            run = run_training(cfgs[name])
            memory = [rank.get("memory") for rank in run.ranks]
            got[name] = {"samples_per_s": samples / statistics.median(run.steady()), "memory": memory,
                         "external_cores": run.external_cores}
            print(f"round {r + 1}/{args.rounds} {name} done ({run.wall_s:.0f} s)", flush=True)
        got["vpipe_over_recompute"] = got["vpipe"]["samples_per_s"] / got["gpipe_recompute"]["samples_per_s"]
        rounds.append(got)

    def footprint(name: str) -> list[int]:
        if name == "1f1b_kept":
            return [s.footprint_bytes for s in plain_fit.stages]
        return [max(round_[name]["memory"][k]["footprint_bytes"] for round_ in rounds)
                for k in range(MODEL["stages"])]

    ratios = [r["vpipe_over_recompute"] for r in rounds]
    summary = {
        "budget_bytes": args.budget,
        "samples_per_s": {name: statistics.median(r[name]["samples_per_s"] for r in rounds)
                          for name in timed},
        "footprint_bytes": {name: footprint(name) for name in cfgs},
        "vpipe_policies": [rounds[-1]["vpipe"]["memory"][k]["policies"] for k in range(MODEL["stages"])],
        "vpipe_over_recompute": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }
    summary["within_budget"] = {name: max(f) <= args.budget for name, f in summary["footprint_bytes"].items()}

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"2 stages under a {args.budget / 2**20:.0f} MiB per-stage budget "
                        f"(micro-batch {MODEL['micro_batch_size']})")
    for col in ("run", "samples/s", "stage footprints (MiB)", "within budget"):
        table.add_column(col, justify="right")
    for name in cfgs:
        tput = summary["samples_per_s"].get(name)
        table.add_row(name, "not run (over budget)" if tput is None else f"{tput:.1f}",
                      ", ".join(f"{b / 2**20:.1f}" for b in summary["footprint_bytes"][name]),
                      "yes" if summary["within_budget"][name] else "NO")
    Console().print(table)
    v = summary["vpipe_over_recompute"]
    print(f"vpipe / GPipe-recompute throughput: {v['median']:.2f}x [{v['min']:.2f}, {v['max']:.2f}]; "
          f"vpipe's policies per stage: {summary['vpipe_policies']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "memory_budget", "model": MODEL, **summary,
                                               "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
