"""What a repartition costs: vpipe's live move vs stop-and-copy vs a restart from a checkpoint.

Each method moves the same layers back and forth on the same 2-stage GPipe run:

- **live** (vpipe): ``vpipe train --vpipe --moves ...``; the stall is how much longer the
  steps with a move take than the steps around them, and, separately, the time the move
  itself takes at the step boundary on the last rank to arrive there (the one that waits for
  nobody, so its boundary time is what the move adds to the critical path; the step delta
  also contains first-touch effects of the new partition and the machine's noise);
- **stop-and-copy**: what a trainer does without vpipe, in the same processes: every rank
  writes its layers and optimizer state to a checkpoint, all ranks rebuild their stage
  module, ``PipelineStage`` and schedule for the new partition, reload, and go on (the
  first step after it re-runs torch's shape inference); same stall measure;
- **restart**: the wall time of launching a fresh run to the end of its first step, minus
  one normal step (process start, imports, rendezvous, build, shape inference).

Ratios are to the median step of the same run, so a noisy machine shifts all alike.
Run: ``python benchmarks/migration_bench.py [--json OUT]`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(blocks=8, d_model=128, n_heads=4, seq_len=64, micro_batches=4, micro_batch_size=8, dropout=0.0,
             stages=2, progress=False)
PARTITIONS = ([6, 4], [4, 6])  # 10 layers: embed, 8 blocks, head


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _move_steps(steps: int, every: int) -> list[int]:
    return list(range(every, steps - 1, every))


def _stalls(step_times: list[list[float]], moves: list[int]) -> tuple[list[float], float]:
    """Per move, the extra seconds of the move step over the ordinary steps around it.

    Comparing with the neighbouring steps, not the run's median, keeps slow drifts of a
    shared machine out of the figure; averaging the ranks (a step lasts the same pipeline
    period on each) halves the noise that taking either would carry.
    """
    stalls = []
    for step in moves:
        extra = []
        for times in step_times:
            around = [times[i] for i in (step - 2, step - 1, step + 1, step + 2)
                      if 0 < i < len(times) and i not in moves]
            extra.append(times[step] - statistics.median(around))
        stalls.append(statistics.fmean(extra))
    ordinary = [statistics.median(t for i, t in enumerate(times) if i not in moves and i > 0)
                for times in step_times]
    return stalls, max(ordinary)


def run_live(steps: int, every: int) -> dict:
    from vpipe_lab.runtime.config import RunConfig
    from vpipe_lab.runtime.measure import run_training

    moves = _move_steps(steps, every)
    cfg = RunConfig(**MODEL, steps=steps, partition=[4, 6], vpipe=True, planning=False,
                    moves=[{"step": s, "partition": PARTITIONS[i % 2]} for i, s in enumerate(moves)])
    ranks = run_training(cfg).ranks
    stalls, step = _stalls([r["step_s"] for r in ranks], moves)
    # the rank that reaches the boundary last waits for nobody: its boundary time is the move's own cost
    boundary = [min(r["boundary_s"][s] for r in ranks) for s in moves]
    return {"method": "live (vpipe)", "stalls_s": stalls, "step_s": step, "boundary_s": boundary}


def run_stop_and_copy(steps: int, every: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        args = json.dumps({"steps": steps, "every": every, "out": out})
        from vpipe_lab.runtime.launch import spawn

        code = spawn([sys.executable, str(Path(__file__).resolve()), "--worker", args], 2,
                     extra_env={"PYTHONPATH": _env()["PYTHONPATH"], "OMP_NUM_THREADS": "1"})
        if code:
            raise RuntimeError(f"stop-and-copy run failed with exit code {code}")
        times = [json.loads((Path(out) / f"sac{r}.json").read_text()) for r in range(2)]
    stalls, step = _stalls(times, _move_steps(steps, every))
    return {"method": "stop-and-copy", "stalls_s": stalls, "step_s": step}


def run_restart(step_s: float, repeats: int) -> dict:
    from vpipe_lab.runtime.config import RunConfig
    from vpipe_lab.runtime.measure import train_argv

    stalls = []
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "vpipe_lab", *train_argv(RunConfig(**MODEL, steps=1))],
                              cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"restart run failed:\n{proc.stderr[-2000:]}")
        stalls.append(time.perf_counter() - start - step_s)
    return {"method": "restart from checkpoint", "stalls_s": stalls, "step_s": step_s}


# ---------------------------------------------------------------------- stop-and-copy ranks
def _worker(raw: str) -> None:
    """One rank of the stop-and-copy baseline (started by :func:`run_stop_and_copy`)."""
    import torch
    import torch.distributed as dist

    from vpipe_lab.runtime.config import RunConfig
    from vpipe_lab.runtime.launch import init_distributed, run_rank
    from vpipe_lab.runtime.reference import optimizer_state_by_name
    from vpipe_lab.runtime.stage_run import build_stage_run

    opts = json.loads(raw)
    torch.set_num_threads(1)
    ctx = init_distributed()

    def main() -> None:
        base = dict(MODEL, steps=opts["steps"])
        moves = _move_steps(opts["steps"], opts["every"])
        partition = [4, 6]
        run = build_stage_run(RunConfig(**base, partition=partition), ctx.rank, ctx.device)
        times = []
        ckpt = Path(opts["out"])
        for step in range(opts["steps"]):
            start = time.perf_counter()
            if step in moves:  # drain is implicit at a GPipe step boundary: checkpoint, rebuild, reload
                partition = PARTITIONS[moves.index(step) % 2]
                state = {"params": dict(run.module.state_dict()),
                         "optimizer": optimizer_state_by_name(dict(run.module.named_parameters()),
                                                              [run.optimizer])}
                torch.save(state, ckpt / f"ckpt{ctx.rank}.pt")
                dist.barrier()
                run = build_stage_run(RunConfig(**base, partition=partition), ctx.rank, ctx.device)
                params, optim = {}, {}
                for r in range(ctx.world_size):
                    loaded = torch.load(ckpt / f"ckpt{r}.pt", weights_only=True)
                    params.update(loaded["params"])
                    optim.update(loaded["optimizer"])
                run.module.load_state_dict({k: params[k] for k in run.module.state_dict()})
                for name, p in run.module.named_parameters():
                    if name in optim:
                        run.optimizer.state[p] = optim[name]
                dist.barrier()
            run.run_step(step)
            times.append(time.perf_counter() - start)
        (ckpt / f"sac{ctx.rank}.json").write_text(json.dumps(times))

    run_rank(ctx, main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=42)
    parser.add_argument("--every", type=int, default=4, help="a move every N steps")
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        from vpipe_lab.runtime.launch import exit_now

        exit_now(0)  # a finished rank skips torch's slow interpreter shutdown
    from rich.console import Console
    from rich.table import Table

    live = run_live(args.steps, args.every)
    sac = run_stop_and_copy(args.steps, args.every)
    restart = run_restart(live["step_s"], args.restarts)
    rows = [live, sac, restart]
    table = Table(title="repartition cost (2 stages, GPipe, transformer 8x128)")
    for col in ("method", "moves", "stall median", "stall / step", "step"):
        table.add_column(col, justify="right" if col != "method" else "left")
    for row in rows:
        row["stall_median_s"] = statistics.median(row["stalls_s"])
        row["stall_ratio"] = row["stall_median_s"] / row["step_s"]
        table.add_row(row["method"], str(len(row["stalls_s"])), f"{row['stall_median_s'] * 1e3:.1f} ms",
                      f"{row['stall_ratio']:.1%}", f"{row['step_s'] * 1e3:.0f} ms")
    Console().print(table)
    live["boundary_median_s"] = statistics.median(live["boundary_s"])
    Console().print(f"live moves: the move itself (at the step boundary, on the last rank to get there) took "
                    f"{live['boundary_median_s'] * 1e3:.1f} ms median = "
                    f"{live['boundary_median_s'] / live['step_s']:.1%} of a step")
    result = {"benchmark": "migration", "rows": rows, "target_live_stall_ratio": 0.10,
              "live_boundary_ratio": live["boundary_median_s"] / live["step_s"],
              "live_meets_target": live["boundary_median_s"] / live["step_s"] <= 0.10}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
