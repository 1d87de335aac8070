"""The pipeline simulator: checked against real runs here, then used where this machine cannot go.

**Validation.** For the reference transformer (8 blocks, d_model 64, sequence 64, 4
micro-batches of 8, GPipe) on 2 and 4 stages: the simulator's step time from measured layer
profiles, with a per-action overhead and a compute scale calibrated on the 2-stage pipeline
at micro-batch sizes 1, 4 and 16 (:mod:`vpipe_lab.runtime.calibrate`) and used unchanged for
4 stages (``--recalibrate``: each depth on its own runs), against real ``vpipe train`` runs;
each run is simulated under the outside load it saw. The target is within 15% of the real
step time (``--repeats 5 --recalibrate``: each depth calibrated on its own runs, a median of
five runs per size); the table says how far each depth is. It measures this machine, whose
load comes and goes, so it is a benchmark and not a test: the suite keeps the simulator's
arithmetic (``tests/unit/test_simulate.py``: bubble formulas, calibration on synthetic runs).

**Projection.** A transformer with two identical blocks per stage (every block costs what
the reference model's median block measured here, the embedding and head as measured),
``2 x stages`` micro-batches, one device per stage, on 8 to 64 stages, with GPU-like links:
a PCIe copy engine for swaps (``--pcie-gbs``, overlapped with compute as far as compute
lasts) and ``--net-gbs`` between stages. What decides swap against recompute on a GPU is
the ratio of a block's compute (forward + backward) to the time its activations take to go
out to the host and back over PCIe; the compute is scaled so that this ratio is
``--ratios`` (2 by default: a large model's blocks on a GPU, whose compute grows with the
square of the width and activations only linearly) on every depth, and ``--sweep-ratios``
on the first depth. Per configuration, the fraction of the ideal (the compute split
evenly, no bubble, no recompute) that each reaches:

  GPipe (all R)       every layer recomputed: the memory-lean baseline
  1F1B (all S)        every layer swapped to the host: what vpipe turns to on a GPU
  1F1B (all D)        every activation kept: needs unlimited memory
  PipeDream (all D)   asynchronous, no flush

    python benchmarks/simulator_bench.py [--repeats 1] [--no-validation] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vpipe_lab.runtime.calibrate import REFERENCE_RUN as REFERENCE  # noqa: E402
from vpipe_lab.runtime.costs import (
    Link,
    ModelCosts,
    balanced_counts,
    ideal_step_s,
    measure_model_costs,
    scaled,
    stage_costs,  # noqa: E402
)
from vpipe_lab.runtime.simulate import simulate  # noqa: E402

SYSTEMS = {"GPipe (all R)": ("gpipe", "R"), "1F1B (all S)": ("1f1b", "S"), "1F1B (all D)": ("1f1b", "D"),
           "PipeDream (all D)": ("pipedream", "D")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="real runs per micro-batch size and depth")
    p.add_argument("--run-steps", type=int, default=10,
                   help=f"steps per real run (the first 2 are warm-up; default {REFERENCE.steps})")
    p.add_argument("--validation-stages", type=int, nargs="*", default=[2, 4])
    p.add_argument("--recalibrate", action="store_true",
                   help="calibrate every validated depth on its own runs (default: the first "
                        "depth's calibration predicts the others)")
    p.add_argument("--no-validation", action="store_true", help="projection only (no real runs)")
    p.add_argument("--stages", type=int, nargs="*", default=[8, 16, 32, 64], help="projected pipeline depths")
    p.add_argument("--ratios", type=float, nargs="*", default=[2.0],
                   help="a block's compute / its activations' PCIe round trip, on every projected depth")
    p.add_argument("--sweep-ratios", type=float, nargs="*", default=[0.5, 1.0, 4.0],
                   help="more ratios, on the first projected depth only")
    p.add_argument("--pcie-gbs", type=float, default=12.0, help="host<->device copies, GB/s")
    p.add_argument("--net-gbs", type=float, default=10.0, help="between stages, GB/s")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def validation(args: argparse.Namespace, profiles: dict[int, ModelCosts]) -> list[dict[str, Any]]:
    """Calibrate on the first depth's runs; the other depths are predicted with that calibration unless
    ``--recalibrate`` (each its own)."""
    from vpipe_lab.runtime.calibrate import validate

    rows = []
    first = None
    for stages in args.validation_stages:
        cfg = dataclasses.replace(REFERENCE, stages=stages, steps=args.run_steps)
        reuse = first is not None and not args.recalibrate
        prediction = validate(cfg, repeats=args.repeats, profiles=profiles,
                              calibration=first.calibration if reuse else None,
                              calibrated_on_stages=first.stages if reuse else 0)
        first = first or prediction
        rows.append(prediction.to_dict())
    return rows


def repeated_blocks(costs: ModelCosts, blocks: int) -> ModelCosts:
    """``costs`` with its middle layers (the transformer's blocks) replaced by ``blocks`` copies of the median
    block: what a deeper stack of the same block costs."""
    inner = costs.layers[1:-1]
    typical = sorted(inner, key=lambda c: c.fwd_s + c.bwd_s)[len(inner) // 2]
    return dataclasses.replace(costs, layers=[costs.layers[0], *[typical] * blocks, costs.layers[-1]])


def project(costs: ModelCosts, stages: int, ratio: float, link: Link) -> dict[str, Any]:
    """Simulate every system on ``stages`` devices whose block
    compute is ``ratio`` times its PCIe round trip."""
    model = repeated_blocks(costs, 2 * stages - 2)
    block = model.layers[1]
    speedup = (block.fwd_s + block.bwd_s) / (ratio * 2 * block.act_bytes / link.swap_bytes_per_s)
    model = scaled(model, 1.0 / speedup)
    counts = balanced_counts(model, stages)
    m = 2 * stages
    ideal = ideal_step_s(model, stages, m)
    row: dict[str, Any] = {"stages": stages, "ratio": ratio, "speedup": speedup, "micro_batches": m,
                           "layers": len(model.layers), "ideal_step_s": ideal, "systems": {}}
    for name, (schedule, policy) in SYSTEMS.items():
        per_stage = stage_costs(model, counts, schedule=schedule, link=link,
                                policies={i: policy for i in range(len(model.layers))})
        result = simulate(per_stage, schedule=schedule, micro_batches=m, steps=3 if schedule == "pipedream"
                          else 2)
        row["systems"][name] = {"step_s": result.step_s, "of_ideal": ideal / result.step_s,
                                "bubble": result.bubble_fraction}
    return row


def projection(args: argparse.Namespace, costs: ModelCosts) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    link = Link(send_bytes_per_s=args.net_gbs * 1e9, swap_bytes_per_s=args.pcie_gbs * 1e9, overlap=1.0)
    cases = [(p, r) for p in args.stages for r in args.ratios]
    cases += [(args.stages[0], r) for r in args.sweep_ratios if (args.stages[0], r) not in cases]
    return [project(costs, p, s, link) for p, s in cases], {
        "link": dataclasses.asdict(link),
        "block_compute_s": statistics.median(c.fwd_s + c.bwd_s for c in costs.layers[1:-1]),
    }


def print_tables(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    if out["validation"]:
        table = Table(title="simulator vs real runs (reference transformer, GPipe, this machine)")
        for col in ("stages", "predicted ms", "measured ms (runs)", "error (target 15%)", "outside load",
                    "overhead/action", "compute scale", "calibrated on"):
            table.add_column(col, justify="right")
        for r in out["validation"]:
            runs = ", ".join(f"{x * 1e3:.0f}" for x in r["measured_runs_s"])
            table.add_row(str(r["stages"]), f"{r['predicted_s'] * 1e3:.0f}",
                          f"{r['measured_s'] * 1e3:.0f} ({runs})",
                          f"{r['error']:+.1%} {'met' if abs(r['error']) <= 0.15 else 'NOT met'}",
                          f"{r['background']:.1f} threads",
                          f"{r['action_overhead_s'] * 1e3:.2f} ms", f"{r['compute_scale']:.2f}",
                          f"{r['calibrated_on_stages']} stages")
        console.print(table)
    table = Table(title=("projection: fraction of ideal, one GPU-like device per stage, PCIe "
                         f"{out['config']['pcie_gbs']:g} GB/s swaps overlapped, {out['config']['net_gbs']:g} "
                         "GB/s between stages, 2 blocks per stage, 2 x stages micro-batches"))
    for col in ("stages", "compute / PCIe", "speedup over this CPU", *SYSTEMS):
        table.add_column(col, justify="right")
    for r in out["projection"]:
        table.add_row(str(r["stages"]), f"{r['ratio']:g}", f"{r['speedup']:.0f}x",
                      *(f"{r['systems'][n]['of_ideal']:.0%}" for n in SYSTEMS))
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    # one set of layer profiles (the model's, at every size the validation calibrates on, taken between the
    # first depth's runs) serves every stage count and the projection
    profiles: dict[int, ModelCosts] = {}
    if args.no_validation:
        profiles[REFERENCE.micro_batch_size] = measure_model_costs(REFERENCE, repeats=3, rounds=2)
    rows = [] if args.no_validation else validation(args, profiles)
    projected, details = projection(args, profiles[REFERENCE.micro_batch_size])
    out = {"benchmark": "simulator", "validation": rows, "projection": projected, **details,
           "seconds": time.perf_counter() - started, "config": {k: v for k, v in vars(args).items()
                                                                if k != "json"}}
    print_tables(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
