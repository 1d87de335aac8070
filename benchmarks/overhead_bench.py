"""What attaching vpipe costs when there is nothing to gain: a balanced pipeline that fits.

The trainer is ``examples/train_sequential.py`` (each rank an ``nn.Sequential`` slice,
1F1B, Adam) on 2 CPU stages split 4,4, at two sizes:

- **small**: width 64, sequence 32, 4 micro-batches of 2 (about 13 ms steps on 2 cores),
  where a fixed cost per step or per layer call shows most;
- **medium**: width 256, sequence 64, 4 micro-batches of 4 (about 180 ms steps).

Three runs of the same script per round: **plain** (no vpipe), **attached**
(``vpipe.attach(schedule, optimizer=opt, planning=False)``: tensor manager and monitor)
and **planned** (the one line with its defaults: the planner daemon runs, samples every
10th step and finds nothing to change). Rounds alternate the order (plain, attached,
planned, then the reverse), so a machine that slows down shifts all alike. Each run's
figure is the mean step of its second half (two ranks on two cores step at one of two
paces, depending on how the scheduler interleaves them, so a median flips between the two
and a mean does not); a round's ratio is a run's figure over plain's in that round; the
table gives the median over rounds and their range.

Where the attached run's time goes (``--profile``, on by default): one more attached run
of the small model, every rank under ``cProfile``; vpipe's own functions are grouped by
what they run for: per saved tensor (the pack and unpack hooks), per layer call (the
tensor manager's forward hooks, the monitor's on sampled steps), per micro-batch (the
chunk wrappers and contexts), per step (the step boundary, the monitor's records, the
control plane). cProfile slows Python down (each call pays for being counted), so the
figures are upper bounds; their shares say where the time goes.

Run: ``python benchmarks/overhead_bench.py [--json OUT]`` (about 5-10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "small": (["--width", "64", "--seq-len", "32", "--micro-batch-size", "2"], 600),
    "medium": (["--width", "256", "--seq-len", "64", "--micro-batch-size", "4"], 40),
}
RUNS = {"plain": [], "attached": ["--vpipe", "--no-planning"], "planned": ["--vpipe"]}


def _env(log_file: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", VPIPE_LOG_FILE=str(log_file))
    env.pop("RANK", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_once(size: str, run: str, steps: int, tmp: Path) -> dict:
    """One torchrun launch; the median step of its second half, and whether vpipe changed anything."""
    args, _ = SIZES[size]
    out, log_file = tmp / f"{size}-{run}.json", tmp / f"{size}-{run}.log"
    log_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_sequential.py"), "--steps", str(steps), "--partition", "4,4",
           "--out", str(out), *args, *RUNS[run]]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(log_file), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{size} {run} failed:\n{proc.stderr[-2000:]}")
    from vpipe.log import read_log

    log = read_log(log_file) if log_file.exists() else []
    step_s = json.loads(out.read_text())["step_s"]
    return {"step_s": statistics.fmean(step_s[len(step_s) // 2:]),
            "plans": sum(1 for r in log if r.get("event") == "plan_applied")}


# vpipe's functions by what they run for (the rest, set-up at attach, runs once)
_PER = {
    "saved tensor": ("tensor_manager/interception.py:pack", "tensor_manager/interception.py:unpack",
                     "tensor_manager/swap", "tensor_manager/handles.py:", "tensor_manager/accounting.py:",
                     "tensor_manager/layers.py:is_weight"),
    "layer call": ("tensor_manager/interception.py:pre_forward", "tensor_manager/interception.py:post_forward",
                   "tensor_manager/interception.py:_frames", "tensor_manager/layers.py:__init__",
                   "monitors/stage.py:_forward", "monitors/stage.py:_backward", "monitors/stage.py:_counts"),
    "micro-batch": ("tensor_manager/pipelining.py:", "tensor_manager/manager.py:micro_batch",
                    "tensor_manager/manager.py:backward", "tensor_manager/manager.py:_begin_forward",
                    "tensor_manager/interception.py:uncount", "tensor_manager/governor.py:comfortably_within",
                    "tensor_manager/prefetch.py:"),
    "step": ("rank/", "control/", "monitors/", "log.py:"),
}


def profile_breakdown(steps: int, tmp: Path) -> dict:
    """Per-step seconds of vpipe's own functions on each rank of an attached small run, under cProfile."""
    import pstats

    args, _ = SIZES["small"]
    out, log_file = tmp / "profiled.json", tmp / "profiled.log"
    script = str(ROOT / "examples" / "train_sequential.py")
    wrapper = f'exec "{sys.executable}" -m cProfile -o "{tmp}/rank$RANK.prof" "{script}" "$@"'
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
           "sh", "-c", wrapper, "sh", "--steps", str(steps), "--partition", "4,4", "--out", str(out), *args,
           "--vpipe"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(log_file), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"profiled run failed:\n{proc.stderr[-2000:]}")
    ranks = []
    for rank in range(2):
        stats = pstats.Stats(str(tmp / f"rank{rank}.prof")).stats  # type: ignore[attr-defined]
        groups = {name: 0.0 for name in _PER}
        calls = {"saved tensor": 0, "layer call": 0, "micro-batch": 0}
        for (path, _line, func), (_cc, ncalls, tottime, _ct, _callers) in stats.items():
            where = path.split("/vpipe/", 1)[1] + ":" + func if "/vpipe/" in path else None
            if where is None or where.startswith(("attach.py", "rank/agreement.py", "rank/stages.py")):
                continue
            group = next((g for g, prefixes in _PER.items() if where.startswith(prefixes)), None)
            if group is not None:
                groups[group] += tottime
            if where == "tensor_manager/interception.py:pack":
                calls["saved tensor"] = ncalls
            elif where == "tensor_manager/interception.py:pre_forward":
                calls["layer call"] = ncalls
            elif where == "tensor_manager/manager.py:micro_batch":
                calls["micro-batch"] = ncalls
        step_s = json.loads(out.read_text())["step_s"]
        ranks.append({"rank": rank, "per_step_s": {g: t / steps for g, t in groups.items()},
                      "calls_per_step": {g: n / steps for g, n in calls.items()},
                      "step_s": statistics.median(step_s[len(step_s) // 2:])})
    return {"steps": steps, "ranks": ranks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ", ".join(SIZES))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile breakdown")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        parser.error(f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    from rich.console import Console
    from rich.table import Table

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            steps = SIZES[size][1]
            figures: dict[str, list[float]] = {run: [] for run in RUNS}
            plans = 0
            for r in range(args.rounds):
                for run in (list(RUNS) if r % 2 == 0 else list(reversed(RUNS))):
                    print(f"overhead: {size} round {r + 1}/{args.rounds}: {run} ...", flush=True)
                    result = run_once(size, run, steps, Path(tmp))
                    figures[run].append(result["step_s"])
                    plans += result["plans"]
            row = {"size": size, "steps": steps, "plain_step_s": statistics.median(figures["plain"]),
                   "plans_applied": plans}
            for run in ("attached", "planned"):
                ratios = [a / p for a, p in zip(figures[run], figures["plain"])]
                row[f"{run}_step_s"] = statistics.median(figures[run])
                row[f"{run}_over_plain"] = statistics.median(ratios)
                row[f"{run}_range"] = [min(ratios), max(ratios)]
            rows.append(row)
        breakdown = None if args.no_profile else profile_breakdown(SIZES["small"][1], Path(tmp))
    table = Table(title="attaching vpipe to a balanced 2-stage pipeline that fits (examples/train_sequential.py, 4,4)")
    for col in ("size", "plain", "attached", "attached / plain", "planned", "planned / plain", "plans applied"):
        table.add_column(col, justify="left" if col == "size" else "right")
    for row in rows:
        cells = [row["size"], f"{row['plain_step_s'] * 1e3:.1f} ms"]
        for run in ("attached", "planned"):
            lo, hi = row[f"{run}_range"]
            cells += [f"{row[f'{run}_step_s'] * 1e3:.1f} ms", f"{row[f'{run}_over_plain']:.3f}x ({lo:.3f}-{hi:.3f})"]
        table.add_row(*cells, str(row["plans_applied"]))
    Console().print(table)
    if breakdown is not None:
        parts = Table(title="vpipe's own time per step of the small attached run, under cProfile (upper bounds)")
        for col in ("rank", "step", "per step", "per micro-batch", "per layer call", "per saved tensor"):
            parts.add_column(col, justify="right")
        for r in breakdown["ranks"]:
            per, calls = r["per_step_s"], r["calls_per_step"]
            parts.add_row(str(r["rank"]), f"{r['step_s'] * 1e3:.1f} ms", f"{per['step'] * 1e6:.0f} us",
                          *(f"{per[g] * 1e6:.0f} us ({calls[g]:.0f} calls)" for g in
                            ("micro-batch", "layer call", "saved tensor")))
        Console().print(parts)
    result = {"benchmark": "overhead", "rounds": args.rounds, "rows": rows, "breakdown": breakdown}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
