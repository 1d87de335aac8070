"""A pipeline with one slow device, projected: the even split against the split that knows the speeds.

A stack of identical blocks (64 by default) on 16 stages of 1F1B with ``2 x stages``
micro-batches, one device per stage, simulated (``vpipe_lab.runtime.simulate``) in three
cases:

  (a) even      the blocks split evenly, every device the same speed
  (b) even      the same split, stage ``--slow-stage`` ``--slowdown`` times slower (1.5x)
  (c) aware     the same devices, the blocks split knowing the speeds

A device's speed multiplies its compute and leaves the boundary transfers alone, as
``simulate(stage_speeds=...)`` and the planner's ``stage_speeds`` both mean it. The split
of (c) is an exact DP over contiguous splits (:func:`speed_aware_counts`): the smallest
slowest stage (speed x its blocks' cost), then, among the splits that reach it, the fewest
stages that slow, as early as they go. Where ``plan_pipeline`` takes
``stage_speeds``, the planner's split is simulated too (row "planner") and compared.

The block is synthetic, not measured: forward ``--fwd-ms``, backward ``--bwd-ms``,
``--boundary-mib`` of activations to the next stage over ``--net-gbs`` (defaults: 1.5 ms,
3 ms, 8 MiB, 10 GB/s: a width-4096 block on 1024 tokens in bf16 on a GPU, roughly); no
optimizer step, loss or embedding. ``--markdown OUT`` writes the table and this command.

    python benchmarks/uneven_projection.py [--stages 16] [--blocks 64] [--slow-stage 5] [--slowdown 1.5]
        [--json OUT] [--markdown OUT]
"""

from __future__ import annotations

import argparse
import inspect
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vpipe_lab.runtime.simulate import StageCost, simulate  # noqa: E402

INF = float("inf")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=16)
    p.add_argument("--blocks", type=int, default=64, help="identical blocks in the model")
    p.add_argument("--micro-batches", type=int, default=None, help="per step (default: 2 x stages)")
    p.add_argument("--slow-stage", type=int, default=5, help="the stage on the slow device (0-based)")
    p.add_argument("--slowdown", type=float, default=1.5, help="how much longer the slow device takes")
    p.add_argument("--fwd-ms", type=float, default=1.5, help="one block's forward, per micro-batch")
    p.add_argument("--bwd-ms", type=float, default=3.0, help="one block's backward, per micro-batch")
    p.add_argument("--boundary-mib", type=float, default=8.0, help="activations sent to the next stage")
    p.add_argument("--net-gbs", type=float, default=10.0, help="between stages, GB/s")
    p.add_argument("--no-planner", action="store_true", help="leave out the planner's split")
    p.add_argument("--steps", type=int, default=4,
                   help="simulated steps (the step time is the steady state's)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--markdown", default=None, help="write the table and the command here")
    args = p.parse_args(argv)
    args.micro_batches = args.micro_batches or 2 * args.stages
    if not 1 <= args.stages <= args.blocks:
        p.error(f"need 1 <= --stages <= --blocks, got {args.stages} stages for {args.blocks} blocks")
    if not 0 <= args.slow_stage < args.stages:
        p.error(f"--slow-stage must be a stage, 0 to {args.stages - 1}")
    return args


def even_counts(blocks: int, stages: int) -> list[int]:
    """Blocks per stage as even as they go (the first stages take the remainder): a speed-blind split."""
    base, extra = divmod(blocks, stages)
    return [base + (k < extra) for k in range(stages)]


def speed_aware_counts(costs: Sequence[float], speeds: Sequence[float]) -> list[int]:
    """Blocks per stage of the contiguous split whose slowest stage
    (``speeds[k]`` x its blocks' cost) is fastest.

    Exact (a DP over every contiguous split). Many splits tie on the slowest stage, and
    1F1B's step still differs between them (each stage at the bottleneck can hold up the
    others, and the later it is the more of the pipeline fills in front of it), so the ties
    are broken: the fewest stages at the bottleneck (exact), then front to back, each stage
    at the bottleneck when that count allows, else the most blocks that keep it.
    """
    n, p = len(costs), len(speeds)
    if not 1 <= p <= n:
        raise ValueError(f"cannot split {n} blocks into {p} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def t(k: int, i: int, j: int) -> float:
        return speeds[k] * (prefix[j] - prefix[i])

    # best[k][j]: the smallest slowest stage of the first j blocks on the first k stages
    best = [[INF] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            best[k][j] = min(max(best[k - 1][i], t(k - 1, i, j)) for i in range(k - 1, j))
    tol = 1e-9 * max(1.0, prefix[-1] * max(speeds))
    bottleneck = best[p][n]

    def ends(k: int, i: int) -> list[tuple[int, int]]:  # (at the bottleneck, end) of stage k's choices from i
        return [(int(t(k, i, j) >= bottleneck - tol), j) for j in range(i + 1, n - (p - k - 1) + 1)
                if t(k, i, j) <= bottleneck + tol]

    # fewest[k][i]: the fewest stages at the bottleneck for blocks i.. on stages k.., none over it
    fewest = [[n + 1] * (n + 1) for _ in range(p + 1)]
    fewest[p][n] = 0
    for k in range(p - 1, -1, -1):
        for i in range(k, n - (p - k) + 1):
            fewest[k][i] = min((at + fewest[k + 1][j] for at, j in ends(k, i)), default=n + 1)
    counts, i = [], 0
    for k in range(p):
        _, j = max((at, j) for at, j in ends(k, i) if at + fewest[k + 1][j] == fewest[k][i])
        counts.append(j - i)
        i = j
    return counts


def slowest_stage_s(costs: Sequence[float], speeds: Sequence[float], counts: Sequence[int]) -> float:
    """The min-max objective of a split: its slowest stage's compute per micro-batch."""
    out, i = 0.0, 0
    for speed, n in zip(speeds, counts):
        out = max(out, speed * sum(costs[i:i + n]))
        i += n
    return out


def planner_counts(args: argparse.Namespace, speeds: Sequence[float]) -> tuple[list[int] | None, str]:
    """The planner's split of the same blocks for these speeds, or
    None (and why) where it cannot take speeds."""
    from vpipe.graph import LayerGraph, LayerNode
    from vpipe.planner.setup import Hardware
    from vpipe.planner.srp import plan_pipeline

    if "stage_speeds" not in inspect.signature(plan_pipeline).parameters:
        return None, "vpipe.planner.srp.plan_pipeline takes no stage_speeds yet"
    nodes = [LayerNode(i, f"block{i}", args.fwd_ms / 1e3, args.bwd_ms / 1e3, 0, 0, i)
             for i in range(args.blocks)]
    edges = [(i, i + 1, int(args.boundary_mib * 2**20)) for i in range(args.blocks - 1)]
    result = plan_pipeline(LayerGraph("identical blocks", nodes, edges), args.stages, schedule="1f1b",
                           micro_batches=args.micro_batches,
                           hardware=Hardware(net_bytes_per_s=args.net_gbs * 1e9),
                           stage_speeds=list(speeds))
    kept = all(policy.value == "D" for policy in result.policies.values())
    return [len(stage) for stage in result.stages], "" if kept else "the planner chose swaps or recomputes"


def run_case(args: argparse.Namespace, name: str, about: str, counts: list[int],
             speeds: list[float]) -> dict[str, Any]:
    """Simulate one split on one set of devices."""
    send_s = args.boundary_mib * 2**20 / (args.net_gbs * 1e9)
    per_stage = [StageCost(fwd_s=n * args.fwd_ms / 1e3, bwd_s=n * args.bwd_ms / 1e3,
                           send_s=send_s if k < args.stages - 1 else 0.0) for k, n in enumerate(counts)]
    result = simulate(per_stage, schedule="1f1b", micro_batches=args.micro_batches, steps=args.steps,
                      stage_speeds=speeds)
    block_s = [(args.fwd_ms + args.bwd_ms) / 1e3] * args.blocks
    return {"case": name, "about": about, "counts": counts, "speeds": speeds, "step_s": result.step_s,
            "slowest_stage_s": slowest_stage_s(block_s, speeds, counts), "bubble": result.bubble_fraction}


def project(args: argparse.Namespace) -> dict[str, Any]:
    uniform = [1.0] * args.stages
    uneven = list(uniform)
    uneven[args.slow_stage] = args.slowdown
    block_s = [(args.fwd_ms + args.bwd_ms) / 1e3] * args.blocks
    even = even_counts(args.blocks, args.stages)
    aware = speed_aware_counts(block_s, uneven)
    slow = f"stage {args.slow_stage} {args.slowdown:g}x slower"
    cases = [run_case(args, "(a) even", "even split, uniform devices", even, uniform),
             run_case(args, "(b) even", f"even split, {slow}", even, uneven),
             run_case(args, "(c) aware", f"split knowing the speeds (DP), {slow}", aware, uneven)]
    planned, note = (None, "left out (--no-planner)") if args.no_planner else planner_counts(args, uneven)
    if planned is not None:
        cases.append(run_case(args, "planner", f"plan_pipeline(stage_speeds=...), {slow}", planned, uneven))
        planner, dp = cases[-1], cases[2]
        same = abs(planner["slowest_stage_s"] - dp["slowest_stage_s"]) <= 1e-9 * dp["slowest_stage_s"]
        note = note or (f"{'the same' if same else 'NOT the same'} slowest stage as the DP's "
                        f"({planner['slowest_stage_s'] * 1e3:.1f} ms against "
                        f"{dp['slowest_stage_s'] * 1e3:.1f}), "
                        f"{'the same split' if planner['counts'] == dp['counts'] else 'another split'}, "
                        f"a step {planner['step_s'] / dp['step_s']:.3f}x the DP split's")
    for case in cases:
        case["vs_a"] = case["step_s"] / cases[0]["step_s"]
        case["vs_b"] = case["step_s"] / cases[1]["step_s"]
    # no split of whole blocks beats the compute shared in proportion to the devices' speeds
    bound_s = sum(block_s) / sum(1.0 / s for s in uneven)
    return {"benchmark": "uneven_projection", "cases": cases, "planner": note, "fractional_bound_s": bound_s}


def markdown(out: dict[str, Any], command: str) -> str:
    """The table and what produced it, for docs/benchmarks.md."""
    cfg, cases = out["config"], out["cases"]
    lines = [f"{cfg['blocks']} identical blocks on {cfg['stages']} stages, 1F1B, {cfg['micro_batches']} "
             f"micro-batches; a block {cfg['fwd_ms']:g} ms forward + {cfg['bwd_ms']:g} ms backward, "
             f"{cfg['boundary_mib']:g} MiB to the next stage at {cfg['net_gbs']:g} GB/s "
             "(synthetic); the slow "
             f"device's compute takes {cfg['slowdown']:g}x, its transfers do not. Simulated step time:", "",
             "| case | devices and split | blocks per stage | slowest stage (ms per micro-batch) | step (ms) "
             "| vs (a) | vs (b) |", "|---|---|---|---|---|---|---|"]
    for c in cases:
        lines.append(f"| {c['case']} | {c['about']} | {','.join(map(str, c['counts']))} | "
                     f"{c['slowest_stage_s'] * 1e3:.1f} | {c['step_s'] * 1e3:.1f} | {c['vs_a']:.3f}x "
                     f"| {c['vs_b']:.3f}x |")
    a, b, c = (x["step_s"] for x in cases[:3])
    recovered = (b - c) / (b - a) if b > a else 0.0
    lines += ["", f"The slow device costs the even split {b / a - 1:.1%} of its step; knowing "
                  "the speeds, the split "
              f"gives back {recovered:.0%} of that ({c / a - 1:+.1%} over (a)). Whole blocks are "
              "the limit: shared in proportion to the devices' speeds, the slowest stage would be "
              f"{out['fractional_bound_s'] * 1e3:.1f} ms "
              f"per micro-batch. Planner: {out['planner']}.", "", "Produced by:", "", "```bash", command,
              "```", ""]
    return "\n".join(lines)


def print_table(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = out["config"]
    table = Table(
        title=f"{cfg['blocks']} blocks on {cfg['stages']} stages, 1F1B, {cfg['micro_batches']} "
        f"micro-batches, stage {cfg['slow_stage']} {cfg['slowdown']:g}x slower in (b) and (c)"
    )
    for col in ("case", "devices and split", "blocks per stage", "slowest stage ms/mb", "step ms", "vs (a)",
                "vs (b)"):
        table.add_column(col, justify="left" if col in ("case", "devices and split", "blocks per stage")
                         else "right")
    for c in out["cases"]:
        table.add_row(c["case"], c["about"], ",".join(map(str, c["counts"])),
                      f"{c['slowest_stage_s'] * 1e3:.1f}",
                      f"{c['step_s'] * 1e3:.1f}", f"{c['vs_a']:.3f}x", f"{c['vs_b']:.3f}x")
    console = Console(width=170)
    console.print(table)
    console.print(f"planner: {out['planner']}; fractional bound on the slowest stage "
                  f"{out['fractional_bound_s'] * 1e3:.1f} ms per micro-batch")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    out = project(args)
    out["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "markdown")}
    out["seconds"] = time.perf_counter() - started
    print_table(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.markdown:
        given = sys.argv[1:] if argv is None else argv
        command = shlex.join(["python", "benchmarks/uneven_projection.py", *given])
        title = (f"# Draft: one slow device in a {args.stages}-stage pipeline "
                 "(`benchmarks/uneven_projection.py`)")
        Path(args.markdown).write_text(f"{title}\n\n{markdown(out, command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
