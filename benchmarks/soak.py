"""Soak: thousands of steps with constant live migrations and policy changes; memory must stay flat.

A 2-stage GPipe run of a small transformer on CPU (gloo, one thread per rank) with vpipe
attached. Every ``--move-every`` steps a forced plan moves layers to the next partition
of a cycle and rotates every layer's policy through keep (D), swap (S) and recompute (R),
so the layer manager, the optimizer-state transfer, the tensor manager's hooks and its
host pool are exercised thousands of times. Each rank samples its own RSS (psutil) and
its host pool's use and capacity every ``--sample-every`` steps.

Reported: per rank, RSS at the start of the second half and at the end, and its growth
over the second half (target < 2%: the first half absorbs warm-up, allocator growth and
the pool's first chunk); the host pool's peak use and capacity; and whether the final
parameters equal, bit for bit, a single-process run of the same steps without any
migration (:func:`vpipe_lab.runtime.reference.reference_flush`).

Run: ``python benchmarks/soak.py [--steps 2000] [--json OUT]`` (about 3 minutes on 2 cores).
Exit code 0 when the parameters match and RSS growth is under the target, else 1.
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PARTITIONS = ([1, 3], [2, 2], [3, 1], [2, 2])  # 4 layers: embedding, 2 blocks, head
POLICIES = "DSR"
RSS_TARGET = 0.02
POOL_BYTES = 16 << 20


def run_config(steps: int) -> Any:
    from vpipe_lab.runtime.config import RunConfig

    return RunConfig(blocks=2, d_model=32, n_heads=2, seq_len=16, micro_batches=2, micro_batch_size=2,
                     dropout=0.0, stages=2, steps=steps, vpipe=True, planning=False, progress=False)


def soak_plans(steps: int, every: int) -> list[tuple[int, Any]]:
    """(step, plan) for every forced change: the next partition and rotated policies."""
    from vpipe.plan import Plan, Policy

    plans = []
    for i, step in enumerate(range(every, steps, every)):
        counts = PARTITIONS[(i + 1) % len(PARTITIONS)]
        plan = Plan.from_counts(range(4), counts, epoch=i + 1)
        policies = {lid: Policy(POLICIES[(i + lid) % 3]) for lid in range(4)}
        plans.append((step, Plan(epoch=plan.epoch, stages=plan.stages, policies=policies)))
    return plans


# ---------------------------------------------------------------------- one rank
def worker(out_dir: Path, steps: int, every: int, sample_every: int) -> dict[str, Any]:
    import psutil
    import torch

    from vpipe_lab.runtime.launch import init_distributed, run_rank
    from vpipe_lab.runtime.results import RunResult, save_rank_result
    from vpipe_lab.runtime.stage_run import build_stage_run
    from vpipe_lab.runtime.trainer import attach_vpipe

    ctx = init_distributed()

    def body() -> dict[str, Any]:
        torch.set_num_threads(1)
        cfg = run_config(steps)
        cfg.out_dir = str(out_dir)
        run = build_stage_run(cfg, ctx.rank, ctx.device)
        # the small activations swap too
        vp = attach_vpipe(cfg, run, min_swap_bytes=1024, host_pool_bytes=POOL_BYTES)
        for step, plan in soak_plans(steps, every):
            vp.request_plan(plan, at_step=step)
        me = psutil.Process()
        samples = []
        started = time.perf_counter()
        for step in range(steps):
            run.run_step(step)
            if step % sample_every == 0 or step == steps - 1:
                tm = vp.tensor_manager.stats()
                samples.append({"step": step, "t": time.perf_counter() - started, "rss": me.memory_info().rss,
                                "pool_used": tm.host_pool_used_bytes, "pool_peak": tm.host_pool_peak_bytes,
                                "pool_capacity": tm.host_pool_capacity_bytes, "layers": vp.layer_ids})
        seconds = time.perf_counter() - started
        moves = vp.layer_manager.epoch
        vp.detach()
        save_rank_result(cfg, run, RunResult(steps=steps, seconds=seconds))
        record = {"rank": ctx.rank, "seconds": seconds, "epoch": moves, "samples": samples}
        (out_dir / f"soak{ctx.rank}.json").write_text(json.dumps(record))
        return record

    return run_rank(ctx, body)


# ---------------------------------------------------------------------- the launcher
def rss_growth(samples: list[dict[str, Any]]) -> tuple[int, int, float]:
    """(RSS at the start of the second half, RSS at the end, relative growth); each a median of 3 samples."""
    half = len(samples) // 2
    mid = int(statistics.median(s["rss"] for s in samples[half:half + 3]))
    end = int(statistics.median(s["rss"] for s in samples[-3:]))
    return mid, end, (end - mid) / mid


def soak(steps: int, every: int, sample_every: int) -> dict[str, Any]:
    import torch

    from vpipe_lab.runtime.launch import spawn
    from vpipe_lab.runtime.reference import reference_flush

    with tempfile.TemporaryDirectory(prefix="vpipe-soak-") as tmp:
        out = Path(tmp)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1"}
        started = time.perf_counter()
        code = spawn([sys.executable, str(Path(__file__).resolve()), "--worker", str(out), "--steps",
                      str(steps),
                      "--move-every", str(every), "--sample-every", str(sample_every)], 2, extra_env=env)
        wall = time.perf_counter() - started
        if code != 0:
            raise RuntimeError(f"the soak run failed with exit code {code}")
        ranks = [json.loads((out / f"soak{r}.json").read_text()) for r in range(2)]
        params: dict[str, torch.Tensor] = {}
        for r in range(2):
            params.update(torch.load(out / f"rank{r}.pt", weights_only=True)["params"])
    want = reference_flush(run_config(steps))[0]
    mismatched = sorted(n for n in want if n not in params or not torch.equal(params[n], want[n]))
    result: dict[str, Any] = {
        "steps": steps, "move_every": every, "forced_plans": len(soak_plans(steps, every)),
        "run_wall_s": wall, "params_equal_reference": not mismatched and sorted(params) == sorted(want),
        "mismatched_params": mismatched[:10], "rss_target": RSS_TARGET, "ranks": [],
    }
    for rec in ranks:
        mid, end, growth = rss_growth(rec["samples"])
        result["ranks"].append({
            "rank": rec["rank"], "train_s": rec["seconds"], "plans_applied": rec["epoch"],
            "rss_first_bytes": rec["samples"][0]["rss"], "rss_mid_bytes": mid, "rss_end_bytes": end,
            "rss_growth_second_half": growth,
            "pool_peak_bytes": max(s["pool_peak"] for s in rec["samples"]),
            "pool_capacity_mid_bytes": rec["samples"][len(rec["samples"]) // 2]["pool_capacity"],
            "pool_capacity_end_bytes": rec["samples"][-1]["pool_capacity"],
            "pool_used_end_bytes": rec["samples"][-1]["pool_used"],
            "samples": [{k: s[k] for k in ("step", "t", "rss", "pool_used", "pool_capacity")}
                        for s in rec["samples"]],
        })
    result["max_rss_growth_second_half"] = max(r["rss_growth_second_half"] for r in result["ranks"])
    result["ok"] = result["params_equal_reference"] and result["max_rss_growth_second_half"] < RSS_TARGET
    return result


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    table = (Table(title=f"vpipe soak: {result['steps']} steps, a forced plan every "
                         f"{result['move_every']} steps ({result['forced_plans']} plans), 2 stages"))
    for col in ("rank", "plans applied", "RSS start MiB", "RSS mid MiB", "RSS end MiB", "growth 2nd half",
                "pool peak KiB", "pool capacity mid/end MiB", "train s"):
        table.add_column(col, justify="right")
    for r in result["ranks"]:
        table.add_row(str(r["rank"]), str(r["plans_applied"]), f"{r['rss_first_bytes'] / mib:.1f}",
                      f"{r['rss_mid_bytes'] / mib:.1f}", f"{r['rss_end_bytes'] / mib:.1f}",
                      f"{100 * r['rss_growth_second_half']:+.2f}%", f"{r['pool_peak_bytes'] / 1024:.1f}",
                      f"{r['pool_capacity_mid_bytes'] / mib:.0f}/{r['pool_capacity_end_bytes'] / mib:.0f}",
                      f"{r['train_s']:.0f}")
    console = Console()
    console.print(table)
    console.print(f"final parameters equal the no-migration reference: {result['params_equal_reference']}"
                  + (f" (differ: {result['mismatched_params']})" if result["mismatched_params"] else ""))
    console.print(f"max RSS growth over the second half: {100 * result['max_rss_growth_second_half']:+.2f}% "
                  f"(target < {100 * RSS_TARGET:.0f}%)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    parser.add_argument("--move-every", type=int, default=5, help="a forced plan every N steps (default 5)")
    parser.add_argument("--sample-every", type=int, default=20, help="sample RSS and the pool every N steps")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 4 * args.sample_every or args.move_every < 1:
        parser.error("need --steps >= 4 x --sample-every and --move-every >= 1")
    if args.worker:
        worker(Path(args.worker), args.steps, args.move_every, args.sample_every)
        from vpipe_lab.runtime.launch import exit_now

        exit_now(0)  # a finished rank skips torch's slow interpreter shutdown
    result = soak(args.steps, args.move_every, args.sample_every)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
