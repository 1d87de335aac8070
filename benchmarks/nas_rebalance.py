"""A NAS edit unbalances the pipeline: throughput per phase for static vs vpipe vs the optimal static run.

Scenario (2 stages, 1F1B, CPU): a transformer with 4 blocks trains; at step ``--add-step``
eight more blocks are added to stage 0 (as a NAS driver growing the model would).

- **static**: vpipe adds the layers but never plans (``--no-planning``): the new layers stay
  on stage 0, which now does most of the work;
- **vpipe**: the same run with the planner on: the monitor reports the imbalance, the
  planner's SRP search moves layers to stage 1 and the layer managers apply it live;
- **optimal**: the grown model trained from the start on the best static partition for it
  (chosen from measured layer costs), without vpipe: the throughput to recover to (its median
  over the steps after the first two).

Phases: *before* the edit (steps 2 .. add), *transition* (the 30 steps after it), *after*
(the rest). The acceptance number is the *recovery*: the first step after the edit from
which vpipe's median throughput over 5 steps reaches 90% of the optimal run's, counted in
steps after the edit. Runs alternate in order (A B C, C B A, ...) and every ratio is taken
within one round, so a shared machine's drift cancels; reported as median and spread.

Run: ``python benchmarks/nas_rebalance.py [--json OUT] [--plot PNG] [--log-dir DIR]``
(about 2 minutes on 2 cores at the default size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vpipe_lab.runtime.config import RunConfig  # noqa: E402
from vpipe_lab.runtime.measure import run_training, samples_per_s  # noqa: E402

VARIANTS = ("static", "vpipe", "optimal")
MODEL = dict(model="transformer", d_model=96, n_heads=4, seq_len=64, micro_batches=4, micro_batch_size=4,
             schedule="1f1b", dropout=0.0, stages=2)
RECOVERY_WINDOW = 5
RECOVERY_FRACTION = 0.9
TRANSITION_STEPS = 30


def optimal_partition(cfg: RunConfig) -> list[int]:
    """The 2-or-more-stage split of ``cfg``'s model with the smallest slowest stage, from measured costs."""
    from itertools import combinations

    from vpipe_lab.runtime.costs import measure_model_costs, stage_costs

    costs = measure_model_costs(cfg, repeats=3, rounds=2)
    n, p = len(costs.layers), cfg.stages
    best: tuple[float, list[int]] | None = None
    for cuts in combinations(range(1, n), p - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, n))]
        slowest = max(s.fwd_s + s.bwd_s + s.optimizer_s
                      for s in stage_costs(costs, counts, schedule=cfg.schedule))
        if best is None or slowest < best[0]:
            best = (slowest, counts)
    assert best is not None
    return best[1]


def phases(add_step: int, steps: int) -> dict[str, range]:
    return {"before": range(2, add_step), "transition": range(add_step, add_step + TRANSITION_STEPS),
            "after": range(add_step + TRANSITION_STEPS, steps)}


def recovery_steps(tput: Sequence[float], target: float, add_step: int) -> int | None:
    """Steps after the edit until the rolling median first reaches ``RECOVERY_FRACTION`` of ``target``."""
    for start in range(add_step, len(tput) - RECOVERY_WINDOW + 1):
        if statistics.median(tput[start:start + RECOVERY_WINDOW]) >= RECOVERY_FRACTION * target:
            return start - add_step
    return None


def configs(args: argparse.Namespace, log_dir: Path, round_no: int) -> dict[str, RunConfig]:
    edits = [{"step": args.add_step, "add": {"position": 1, "types": ["attn"] * args.added}}]
    common = dict(MODEL, blocks=args.blocks, steps=args.steps, seed=args.seed)
    grown = RunConfig(**{**common, "blocks": args.blocks + args.added})
    return {
        "static": RunConfig(**common, vpipe=True, planning=False, nas=edits, monitor_every=args.monitor_every,
                            log_file=str(log_dir / f"static-{round_no}.log")),
        "vpipe": RunConfig(**common, vpipe=True, planning=True, nas=edits, monitor_every=args.monitor_every,
                           log_file=str(log_dir / f"vpipe-{round_no}.log")),
        # as long as the others: a run speeds up over its first tens of
        # steps, so a shorter one would read slower
        "optimal": RunConfig(**{**grown.to_dict(), "partition": args.optimal_partition}),
    }


def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    samples = MODEL["micro_batches"] * MODEL["micro_batch_size"]
    grown = RunConfig(**dict(MODEL, blocks=args.blocks + args.added))
    args.optimal_partition = optimal_partition(grown)
    print(f"optimal static partition of the grown model ({args.blocks + args.added} blocks): "
          f"{args.optimal_partition} layers per stage", flush=True)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        cfgs = configs(args, log_dir, r)
        runs: dict[str, Any] = {}
        for name in order:
            run = run_training(cfgs[name])
            runs[name] = {"throughput": samples_per_s(run.step_s, samples),
                          "external_cores": run.external_cores,
                          "final_layers": [len(rank["layer_ids"]) for rank in run.ranks]}
            print(f"round {r + 1}/{args.rounds} {name:8s} done ({run.wall_s:.0f} s, other load "
                  f"{run.external_cores:.2f} cores, final layers per stage {runs[name]['final_layers']})",
                  flush=True)
        rounds.append(runs)
    return {"rounds": rounds, "optimal_partition": args.optimal_partition}


def summarise(result: dict[str, Any], add_step: int, steps: int) -> dict[str, Any]:
    spans = phases(add_step, steps)
    per_round = []
    for runs in result["rounds"]:
        phase_tput = {name: {ph: statistics.median(runs[name]["throughput"][i] for i in span)
                             for ph, span in spans.items()}
                      for name in ("static", "vpipe")}
        optimal = statistics.median(runs["optimal"]["throughput"][2:])
        phase_tput["optimal"] = {"steady": optimal}
        per_round.append({
            "throughput": phase_tput,
            "vpipe_over_static_after": phase_tput["vpipe"]["after"] / phase_tput["static"]["after"],
            "vpipe_over_optimal_after": phase_tput["vpipe"]["after"] / optimal,
            "static_over_optimal_after": phase_tput["static"]["after"] / optimal,
            "recovery_steps": recovery_steps(runs["vpipe"]["throughput"], optimal, add_step),
            "static_recovery_steps": recovery_steps(runs["static"]["throughput"], optimal, add_step),
        })

    def stats(key: str) -> dict[str, float]:
        values = [r[key] for r in per_round]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    recoveries = [r["recovery_steps"] for r in per_round]
    return {"per_round": per_round,
            "vpipe_over_static_after": stats("vpipe_over_static_after"),
            "vpipe_over_optimal_after": stats("vpipe_over_optimal_after"),
            "static_over_optimal_after": stats("static_over_optimal_after"),
            "recovery_steps": recoveries,
            "recovered_within_30_steps": all(s is not None and s <= TRANSITION_STEPS for s in recoveries)}


def decisions(log_file: Path) -> list[tuple[str, str, str, str, str]]:
    """The timeline rows that explain the recovery."""
    from vpipe.log import read_log
    from vpipe_lab.logview import decision_rows

    if not log_file.exists():
        return []
    return decision_rows(read_log(log_file), {"layers_added", "imbalance", "plan", "plan_applied"})


def report(summary: dict[str, Any], result: dict[str, Any], log_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="NAS edit: 8 blocks added to stage 0 (samples/s, median over rounds)")
    for col in ("run", "before", "transition (30 steps)", "after", "after / optimal"):
        table.add_column(col, justify="right")
    rows = summary["per_round"]
    for name in ("static", "vpipe"):
        med = {ph: statistics.median(r["throughput"][name][ph] for r in rows)
               for ph in ("before", "transition", "after")}
        ratio = summary[f"{name}_over_optimal_after"]
        table.add_row(name, f"{med['before']:.1f}", f"{med['transition']:.1f}", f"{med['after']:.1f}",
                      f"{ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}]")
    optimal = statistics.median(r["throughput"]["optimal"]["steady"] for r in rows)
    table.add_row(f"optimal static {result['optimal_partition']}", "", "", f"{optimal:.1f}", "1.00")
    console.print(table)
    v = summary["vpipe_over_static_after"]
    console.print(f"vpipe / static after the edit: {v['median']:.2f}x [{v['min']:.2f}, {v['max']:.2f}]; "
                  f"vpipe reached 90% of optimal {summary['recovery_steps']} steps after the edit "
                  f"(static: {[r['static_recovery_steps'] for r in rows]})")
    rows_ = decisions(log_dir / "vpipe-0.log")
    if rows_:
        dt = Table(title="decisions of vpipe's first run")
        for col in ("t", "who", "event", "message"):
            dt.add_column(col)
        for t, who, event, message, _ in rows_:
            dt.add_row(t, who, event, message)
        console.print(dt)


def plot(result: dict[str, Any], add_step: int, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["rounds"][0]
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, style in (("static", "C3"), ("vpipe", "C0")):
        tput = runs[name]["throughput"]
        ax.plot(range(len(tput)), tput, color=style, label=name)
    ax.axhline(statistics.median(runs["optimal"]["throughput"][2:]), color="C2",
               label="optimal static (steady)")
    ax.axvline(add_step, color="0.4", linestyle="--", linewidth=0.8)
    ax.text(add_step + 0.5, ax.get_ylim()[1] * 0.95, "8 blocks added to stage 0", fontsize=8, va="top")
    ax.set_xlabel("step")
    ax.set_ylabel("samples / s")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right")
    ax.set_title("NAS edit on a 2-stage pipeline: static vs vpipe")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--added", type=int, default=8)
    parser.add_argument("--add-step", type=int, default=6)
    parser.add_argument("--steps", type=int, default=42)
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of the three runs, alternating their order")
    parser.add_argument("--monitor-every", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="draw throughput per step (first round) into this PNG")
    parser.add_argument("--log-dir", default=None,
                        help="keep the runs' logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.steps < args.add_step + TRANSITION_STEPS + RECOVERY_WINDOW:
        parser.error(f"--steps must be at least --add-step + {TRANSITION_STEPS + RECOVERY_WINDOW}")
    with tempfile.TemporaryDirectory(prefix="vpipe-nas-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for old in log_dir.glob("*.log"):
            old.unlink()  # logs append: a rerun must not mix with an old one
        result = measure(args, log_dir)
        summary = summarise(result, args.add_step, args.steps)
        report(summary, result, log_dir)
    if args.plot:
        plot(result, args.add_step, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "nas_rebalance", "config": {
            k: v for k, v in vars(args).items() if k not in ("json", "plot", "log_dir")}, "model": MODEL,
            **summary, "runs": result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
