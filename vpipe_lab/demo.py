"""``vpipe demo``: a NAS-style run whose layers change mid-training, with and without vpipe.

The reference transformer trains on 2 stages (1F1B, CPU). A neural-architecture-search
driver grows it by six blocks on stage 0, later removes two blocks from stage 1. Without
vpipe (layers added and removed where they land, no planner) the pipeline stays as the
edits left it; with vpipe the monitor reports the imbalance, the planner re-plans and the
layer managers move layers live. The demo ends with the throughput of each phase for both
runs and the decisions vpipe took, and leaves both logs for ``vpipe logs`` / ``vpipe plot``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from vpipe.files import make_dirs
from vpipe.log import read_log
from vpipe.output_paths import check_output_dir
from vpipe_lab.logview import decision_rows
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.measure import run_training, samples_per_s

__all__ = ["DemoPlan", "phase_throughput", "register"]

_SHOWN = {"layers_added", "layers_removed", "imbalance", "plan", "plan_applied"}


@dataclass(frozen=True)
class DemoPlan:
    """When the edits happen; phases are the steps between them."""

    steps: int = 44
    add_step: int = 8
    remove_step: int = 26
    added: int = 6

    def __post_init__(self) -> None:
        if not 3 <= self.add_step < self.remove_step - 2 < self.steps - 4:
            raise ValueError(f"need 3 <= add step < remove step - 2 < steps - 4, got add {self.add_step}, "
                             f"remove {self.remove_step}, steps {self.steps}")

    def edits(self) -> list[dict[str, Any]]:
        # 6 layers at first: embedding 0, blocks 1-4, head 5; stage 1 starts with blocks 3, 4 and the head
        return [{"step": self.add_step, "add": {"position": 1, "types": ["attn"] * self.added}},
                {"step": self.remove_step, "remove": [3, 4]}]

    def phases(self) -> dict[str, range]:
        return {"before the edits": range(2, self.add_step),
                f"{self.added} blocks added to stage 0": range(self.add_step, self.remove_step),
                "2 blocks removed from stage 1": range(self.remove_step, self.steps)}


def phase_throughput(step_s: list[list[float]], samples_per_step: int,
                     phases: dict[str, range]) -> dict[str, float]:
    """Median samples per second of each phase."""
    per_step = samples_per_s(step_s, samples_per_step)
    return {name: statistics.median(per_step[i] for i in span if i < len(per_step))
            for name, span in phases.items()}


def run_demo(plan: DemoPlan, log_dir: Path) -> int:
    check_output_dir(log_dir, "--log-dir")  # a ValueError: one line, before the first run
    console = Console()
    make_dirs(log_dir, "--log-dir")  # 0700, never through a link another user planted
    model: dict[str, Any] = dict(blocks=4, d_model=128, n_heads=4, seq_len=64, micro_batches=4,
                                 micro_batch_size=4,
                                 dropout=0.0, stages=2, schedule="1f1b", steps=plan.steps)
    console.print("[bold]vpipe demo[/]: a 4-block byte-level transformer on 2 stages (1F1B); at step "
                  f"{plan.add_step} a NAS driver adds {plan.added} blocks to stage 0, at step "
                  f"{plan.remove_step} it removes 2 blocks from stage 1. Once without vpipe's planner, once "
                  "with it (~1-2 minutes).")
    results = {}
    for name, planning in (("static", False), ("vpipe", True)):
        log_file = log_dir / f"{name}.log"
        log_file.unlink(missing_ok=True)  # logs append: start clean
        cfg = RunConfig(**model, vpipe=True, planning=planning, nas=plan.edits(), monitor_every=2,
                        log_file=str(log_file))
        console.print(f"  running {name} ...", end="")
        run = run_training(cfg)
        results[name] = (run, phase_throughput(run.step_s, cfg.micro_batches * cfg.micro_batch_size,
                                               plan.phases()))
        console.print(f" done in {run.wall_s:.0f} s, final layers per stage "
                      f"{[len(r['layer_ids']) for r in run.ranks]}")

    table = Table(title="throughput per phase (samples/s, median step)")
    for col in ("phase", "static", "vpipe", "vpipe / static"):
        table.add_column(col, justify="right")
    for phase in plan.phases():
        static, vp = results["static"][1][phase], results["vpipe"][1][phase]
        table.add_row(phase, f"{static:.1f}", f"{vp:.1f}", f"{vp / static:.2f}x")
    console.print(table)

    decisions = (Table(title="what vpipe decided (vpipe logs " + str(log_dir / "vpipe.log") + " shows every "
                                                                                              "number)"))
    for col in ("t (s)", "who", "event", "message"):
        decisions.add_column(col)
    for when, who, event, message, _ in decision_rows(read_log(log_dir / "vpipe.log"), _SHOWN):
        decisions.add_row(when, who, event, message)
    console.print(decisions)
    console.print(f"logs: {log_dir}/static.log, {log_dir}/vpipe.log; draw one with "
                  f"[bold]vpipe plot {log_dir}/vpipe.log -o vpipe.png[/]")
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("demo",
                            help="layers added and removed mid-run on 2 stages, with and without vpipe")
    parser.add_argument("--steps", type=int, default=DemoPlan.steps)
    parser.add_argument("--add-step", type=int, default=DemoPlan.add_step)
    parser.add_argument("--remove-step", type=int, default=DemoPlan.remove_step)
    parser.add_argument("--log-dir", default="vpipe-demo",
                        help="where the two runs' logs go (default ./vpipe-demo)")
    parser.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace, argv: Any) -> int:
    try:
        plan = DemoPlan(steps=args.steps, add_step=args.add_step, remove_step=args.remove_step)
    except ValueError as e:
        print(f"vpipe demo: {e}", file=sys.stderr)
        return 2
    return run_demo(plan, Path(args.log_dir))
