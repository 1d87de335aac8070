"""Overhead of the monitor + control plane + planner daemon on pipeline training, in one launch.

    python benchmarks/monitor_overhead.py [--stages 2] [--rounds 8] [--block 20] [--json OUT]

Each rank trains the reference transformer and alternates blocks of steps without vpipe
(A) and with a ControlSession (B: monitor sampling every ``--sample-every`` steps, stats
down the pipeline, a ``no_change`` planner daemon) in the order A B B A, ``--rounds``
times. Each block is timed in wall-clock seconds and in the rank's CPU seconds. Reported:

- overhead (wall, stage 0, which finishes each step last in a flush pipeline): median over
  rounds of time(B)/time(A) - 1. Other processes on the machine are in it, so compare it
  with the spread of the A blocks among themselves (also reported);
- overhead (CPU, every rank): the same ratio on the rank's own CPU time, which other
  processes hardly move: this is what vpipe takes away from the rank's compute;
- sampled-step slowdown (CPU): in B blocks, sampled steps over unsampled ones; divided
  by k it is the hooks' and record's share per step;
- session bookkeeping: wall time inside ``end_step`` per step (record, msgpack, sockets);
- layer-sum / step: per-layer fwd+bwd over the stage's step time on one sampled step (with
  ``--stages 1`` there are no bubbles, so this is the monitor's coverage of the step);
- the planner daemon's CPU time over its lifetime (a separate process, so outside the ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b", "pipedream"))
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--sample-every", type=int, default=None, help="default: ControlOptions' default")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--block", type=int, default=20, help="steps per A or B block")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--rank-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- one rank
def rank_main(args: argparse.Namespace) -> None:
    import torch

    from vpipe.control.session import ControlOptions, open_for_stage_run
    from vpipe.monitors.sampling import SampleSchedule
    from vpipe_lab.runtime.config import RunConfig
    from vpipe_lab.runtime.launch import init_distributed, run_rank
    from vpipe_lab.runtime.stage_run import build_stage_run

    ctx = init_distributed()
    torch.set_num_threads(1)

    def main() -> None:
        cfg = RunConfig(stages=args.stages, schedule=args.schedule, blocks=args.blocks, d_model=args.d_model,
                        seq_len=args.seq_len, micro_batches=args.micro_batches,
                        micro_batch_size=args.micro_batch_size, progress=False)
        run = build_stage_run(cfg, ctx.rank, ctx.device)
        defaults = ControlOptions()
        options = ControlOptions(sample_every=args.sample_every or defaults.sample_every)
        session = open_for_stage_run(run, ctx, options)
        step, b_step = 0, 0
        out: dict = {"blocks": [], "sampled_cpu_s": [], "unsampled_cpu_s": [], "unsampled_s": [],
                     "end_step_s": [], "coverage": [], "sample_every": options.sample_every}

        def plain() -> None:
            nonlocal step
            run.run_step(step)
            step += 1

        def monitored() -> None:
            nonlocal step, b_step
            start, cpu = time.perf_counter(), time.process_time()
            session.begin_step(b_step)
            run.run_step(step)
            t_end = time.perf_counter()
            session.end_step()
            done = time.perf_counter()
            if session.monitor.is_sampled(b_step):
                out["sampled_cpu_s"].append(time.process_time() - cpu)
            else:
                out["unsampled_cpu_s"].append(time.process_time() - cpu)
                out["unsampled_s"].append(done - start)
            out["end_step_s"].append(done - t_end)
            step += 1
            b_step += 1

        for _ in range(args.warmup):
            monitored()
        schedule = session.monitor.schedule
        session.monitor.schedule = SampleSchedule(1)  # one sampled step to read the layer coverage from
        with session.monitor.iteration(10**9) as sample:
            run.run_step(step)
        step += 1
        session.monitor.schedule = schedule
        out["coverage"].append(sample.record.compute_s / sample.record.step_s)
        for r in range(args.rounds):
            for kind in "ABBA":
                fn = plain if kind == "A" else monitored
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(args.block):
                    fn()
                out["blocks"].append({"round": r, "kind": kind, "seconds": time.perf_counter() - start,
                                      "cpu_s": time.process_time() - cpu})
        out["dropped"] = dict(session.plane.dropped)
        link = session.agent.planner
        if link is not None and link.process is not None:  # the daemon's CPU, a cost on the machine
            import psutil

            times = psutil.Process(link.process.pid).cpu_times()
            out["daemon_cpu_s"] = times.user + times.system
            out["daemon_wall_s"] = time.time() - psutil.Process(link.process.pid).create_time()
        session.close()
        Path(args.rank_dir, f"rank{ctx.rank}.json").write_text(json.dumps(out))

    run_rank(ctx, main)


# ---------------------------------------------------------------- report
def ab_ratios(blocks: list[dict], key: str) -> tuple[list[float], list[float]]:
    """Per round B/A, and the A/A ratio within each round (the noise floor)."""
    rounds: dict[int, dict[str, list[float]]] = {}
    for b in blocks:
        rounds.setdefault(b["round"], {"A": [], "B": []})[b["kind"]].append(b[key])
    ratios = [sum(v["B"]) / sum(v["A"]) for _, v in sorted(rounds.items())]
    noise = [abs(v["A"][0] / v["A"][1] - 1) for _, v in sorted(rounds.items())]
    return ratios, noise


def summarise(ranks: list[dict], args: argparse.Namespace) -> dict:
    rank0 = ranks[0]
    wall, wall_noise = ab_ratios(rank0["blocks"], "seconds")
    k = rank0["sample_every"]
    per_rank = []
    for data in ranks:
        cpu, cpu_noise = ab_ratios(data["blocks"], "cpu_s")
        sampled = statistics.median(data["sampled_cpu_s"]) / statistics.median(data["unsampled_cpu_s"])
        per_rank.append({"cpu_overhead_median": statistics.median(cpu) - 1,
                         "cpu_noise_median": statistics.median(cpu_noise),
                         "sampled_step_cpu_slowdown": sampled - 1,
                         "amortised_sampled_cpu_overhead": (sampled - 1) / k})
    step_s = statistics.median(rank0["unsampled_s"])
    bookkeeping = statistics.mean(rank0["end_step_s"])
    return {
        "config": {k2: v for k2, v in vars(args).items() if k2 not in ("json", "rank_dir")},
        "sample_every": k,
        "wall_overhead_median": statistics.median(wall) - 1,
        "wall_overhead_per_round": [r - 1 for r in wall],
        "wall_noise_median": statistics.median(wall_noise),
        "ranks": per_rank,
        "step_s_unsampled_median": step_s,
        "bookkeeping_s_per_step": bookkeeping,
        "bookkeeping_fraction": bookkeeping / step_s,
        "layer_sum_over_step": statistics.median(rank0["coverage"]),
        "dropped_messages": rank0["dropped"],
        "daemon_cpu_fraction": next((r["daemon_cpu_s"] / r["daemon_wall_s"] for r in ranks
                                     if "daemon_cpu_s" in r),
                                    None),
    }


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = result["config"]
    table = Table(title=f"monitor + control plane overhead ({c['stages']} stages, {c['schedule']}, "
                        f"k={result['sample_every']}, {c['rounds']} rounds x ABBA x {c['block']} steps)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("overhead, wall, stage 0: median B/A - 1", f"{100 * result['wall_overhead_median']:+.2f} %")
    table.add_row("  per round", " ".join(f"{100 * x:+.1f}"
                                          for x in result["wall_overhead_per_round"]) + " %")
    table.add_row("  noise floor: median |A/A - 1|", f"{100 * result['wall_noise_median']:.2f} %")
    for rank, r in enumerate(result["ranks"]):
        table.add_row(f"overhead, CPU time, rank {rank}: median B/A - 1",
                      f"{100 * r['cpu_overhead_median']:+.2f} % (noise {100 * r['cpu_noise_median']:.2f} %)")
        table.add_row(f"  sampled step slowdown (CPU), rank {rank}",
                      f"{100 * r['sampled_step_cpu_slowdown']:+.2f} % -> "
                      f"{100 * r['amortised_sampled_cpu_overhead']:+.3f} % per step")
    table.add_row("step time (unsampled, median)", f"{1000 * result['step_s_unsampled_median']:.1f} ms")
    table.add_row("session bookkeeping per step", f"{1e6 * result['bookkeeping_s_per_step']:.0f} us "
                                                  f"({100 * result['bookkeeping_fraction']:.3f} %)")
    table.add_row("per-layer sum / stage step (stage 0)", f"{result['layer_sum_over_step']:.3f}")
    if result["daemon_cpu_fraction"] is not None:
        table.add_row("planner daemon CPU / wall time",
                      f"{100 * result['daemon_cpu_fraction']:.2f} % of a core")
    table.add_row("bad messages dropped", str(result["dropped_messages"] or 0))
    Console().print(table)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if os.environ.get("RANK") is not None:
        rank_main(args)
        return 0
    from vpipe_lab.runtime.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        code = spawn([sys.executable, __file__, *argv, "--rank-dir", tmp], args.stages, extra_env=env)
        if code != 0:
            return code
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.stages)]
    result = summarise(ranks, args)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
