"""The one line on the trainers people write: a 6,2 split rebalanced by vpipe vs the 4,4 split without it.

For each trainer shape in ``examples/`` (the torch pipelining tutorial / torchtitan
``ModuleDict``, a plain ``nn.Sequential`` slice, a hand-split Hugging Face GPT-2 when
``transformers`` is installed), on 2 CPU stages with 1F1B, at a size where compute
dominates (about 180 ms steps on 2 cores), three runs of the same script:

- **balanced**: the 4,4 split without vpipe (what a user who balanced by hand gets);
- **uneven**: the 6,2 split without vpipe (what the uneven split costs);
- **vpipe**: the 6,2 split with ``vpipe.attach(schedule, optimizer=opt)`` added, default
  options; its blocks move once the planner has two samples (steps 9 and 19).

The figure is the median step time of the last ``--measure`` steps of each run (after
vpipe's move), as a ratio to *balanced* in the same round; rounds alternate the runs
(balanced, uneven, vpipe, then the reverse), so a machine that slows down shifts all alike.
Run: ``python benchmarks/shapes_bench.py [--json OUT]`` (about 2.5 minutes a round on 2 cores).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "tutorial": ("train_tutorial.py", ["--dim", "160", "--seq-len", "64", "--micro-batch-size", "4"]),
    "sequential": ("train_sequential.py", ["--width", "256", "--seq-len", "64", "--micro-batch-size", "4"]),
    "hf_gpt2": ("train_hf_gpt2.py", ["--width", "176", "--seq-len", "64", "--micro-batch-size", "4"]),
}
RUNS = {"balanced": ("4,4", False), "uneven": ("6,2", False), "vpipe": ("6,2", True)}


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_once(shape: str, run: str, steps: int, tmp: Path) -> dict:
    """One torchrun launch of the shape's example; its per-step seconds and whether blocks moved."""
    script, size = SHAPES[shape]
    partition, with_vpipe = RUNS[run]
    out, log_file = tmp / f"{shape}-{run}.json", tmp / f"{shape}-{run}.log"
    log_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / script), "--steps", str(steps), "--partition", partition, "--out",
           str(out), *size]
    if with_vpipe:
        cmd.append("--vpipe")
    env = dict(_env(), VPIPE_LOG_FILE=str(log_file))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{shape} {run} failed:\n{proc.stderr[-2000:]}")
    from vpipe.log import read_log

    log = read_log(log_file) if log_file.exists() else []
    moved = [r for r in log if r.get("event") == "migration_done" and r.get("moved")]
    applied = [r for r in log if r.get("event") == "plan_applied"]
    counts = [int(c) for c in partition.split(",")]
    for r in applied:
        counts[r["stage"]] = len(r["layers"])
    return {"step_s": json.loads(out.read_text())["step_s"], "moved": bool(moved), "final_partition": counts,
            "moved_at_step": min((r["step"] for r in applied), default=None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--steps", type=int, default=56)
    parser.add_argument("--measure", type=int, default=24, help="median over the last N steps of each run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        parser.error(f"unknown shape(s) {unknown}; choose from {', '.join(SHAPES)}")
    if args.measure >= args.steps - 25:
        parser.error(f"--measure {args.measure} must leave the first 25 steps (two samples and the move) out")
    from rich.console import Console
    from rich.table import Table

    skipped = {}
    if "hf_gpt2" in shapes and importlib.util.find_spec("transformers") is None:
        shapes.remove("hf_gpt2")
        skipped["hf_gpt2"] = "transformers is not installed"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            medians: dict[str, list[float]] = {run: [] for run in RUNS}
            details = {}
            for r in range(args.rounds):
                order = list(RUNS) if r % 2 == 0 else list(reversed(RUNS))
                for run in order:
                    print(f"shapes: {shape} round {r + 1}/{args.rounds}: {run} ...", flush=True)
                    result = run_once(shape, run, args.steps, Path(tmp))
                    medians[run].append(statistics.median(result["step_s"][-args.measure:]))
                    details[run] = result
            ratios = [v / b for v, b in zip(medians["vpipe"], medians["balanced"])]
            rows.append({
                "shape": shape, "balanced_step_s": statistics.median(medians["balanced"]),
                "uneven_step_s": statistics.median(medians["uneven"]),
                "vpipe_step_s": statistics.median(medians["vpipe"]),
                "vpipe_over_balanced": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                "uneven_over_balanced": statistics.median(
                    [u / b for u, b in zip(medians["uneven"], medians["balanced"])]),
                "moved": details["vpipe"]["moved"], "final_partition": details["vpipe"]["final_partition"],
                "moved_at_step": details["vpipe"]["moved_at_step"],
            })
    table = (Table(title="the one line on users' trainers: 6,2 split + vpipe vs hand-balanced 4,4 "
                         "(2 CPU stages, 1F1B)"))
    for col in ("shape", "4,4 plain", "6,2 plain", "6,2 + vpipe", "vpipe / 4,4", "6,2 / 4,4",
                "vpipe's split"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for row in rows:
        lo, hi = row["ratio_range"]
        table.add_row(row["shape"], f"{row['balanced_step_s'] * 1e3:.0f} ms",
                      f"{row['uneven_step_s'] * 1e3:.0f} ms",
                      f"{row['vpipe_step_s'] * 1e3:.0f} ms",
                      f"{row['vpipe_over_balanced']:.2f}x" + (f" ({lo:.2f}-{hi:.2f})" if args.rounds > 1
                                                              else ""),
                      f"{row['uneven_over_balanced']:.2f}x",
                      ",".join(map(str, row["final_partition"])) + (f" at step {row['moved_at_step']}"
                                                                     if row["moved"] else " (no move)"))
    Console().print(table)
    for shape, why in skipped.items():
        print(f"shapes: {shape} skipped: {why}")
    result = {"benchmark": "shapes", "steps": args.steps, "measure_steps": args.measure,
              "rounds": args.rounds,
              "rows": rows, "skipped": skipped}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
