"""DeepSpeed's pipeline engine alone vs with ``vpipe.attach(engine)``, side by side in one launch.

The trainer is ``examples/train_deepspeed.py``: an embedding, 8 blocks of equal parameters of
which the first four do five times the MLP work, a head; DeepSpeed's ``uniform`` partition
(``parameters`` gives the same) puts the embedding and blocks 1-4 on stage 0, blocks 5-8 and
the head on stage 1, so stage 0 does about three times stage 1's work (sequences of 64 tokens,
16 micro-batches per step). Each rank builds both
engines alike (same seed, same batches) and trains them in turn, one ``train_batch`` each
per round, the order alternating, so the machine's drift falls on both. vpipe plans on its
own (the one line, defaults); once its planner has moved layers, ``--measure`` more rounds
are timed. Reported: each engine's median step, their ratio (the acceptance number: at most
0.85), the placement vpipe reached, and whether the losses were bitwise equal throughout.

Run: ``python benchmarks/deepspeed_balance.py [--json OUT]`` (about a minute and a half on 2 cores;
needs the ``deepspeed`` extra, ``DS_ACCELERATOR=cpu`` is set here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
MODEL = "--seq 64 --micro-batches 16"  # compute, not the engine's fixed cost per step, sets the pace


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("train_deepspeed", ROOT / "examples" / "train_deepspeed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def rank_main(out: str, max_rounds: int, measure: int, model: list[str]) -> None:
    """One rank: both engines, trained in alternating order until vpipe moved and ``measure`` rounds more."""
    import torch
    import torch.distributed as dist

    import vpipe

    example = _example()
    torch.set_num_threads(1)
    example.deepspeed.init_distributed(dist_backend="gloo")
    args = example.parse_args(model)
    plain, with_vpipe = example.build_engine(args), example.build_engine(args)
    vp = vpipe.attach(with_vpipe)
    home = [list(s) for s in vp.placement]
    data = {"plain": example.batches(args, 0), "vpipe": example.batches(args, 0)}
    engines = {"plain": plain, "vpipe": with_vpipe}
    times: dict[str, list[float]] = {"plain": [], "vpipe": []}
    losses: dict[str, list[float]] = {"plain": [], "vpipe": []}
    moved_at = None
    for round_no in range(max_rounds):
        for name in (("plain", "vpipe") if round_no % 2 else ("vpipe", "plain")):
            started = time.perf_counter()
            loss = engines[name].train_batch(data_iter=data[name])
            times[name].append(time.perf_counter() - started)
            losses[name].append(float(loss))
        moved = [list(s) for s in vp.placement] != home
        flag = torch.tensor([int(moved)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank stops at the same round
        if moved_at is None and flag.item():
            moved_at = round_no
        if moved_at is not None and round_no >= moved_at + 2 + measure:
            break
    placement = [list(s) for s in vp.placement]
    vp.detach()
    if dist.get_rank() == 0:
        start = -measure
        plain_s, vpipe_s = (statistics.median(times["plain"][start:]),
                            statistics.median(times["vpipe"][start:]))
        ratios = [v / p for v, p in zip(times["vpipe"][start:], times["plain"][start:])]
        Path(out).write_text(json.dumps({
            "plain_step_s": plain_s, "vpipe_step_s": vpipe_s, "ratio": vpipe_s / plain_s,
            "ratio_of_rounds": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
            "moved_at_round": moved_at, "rounds": len(times["plain"]), "home": home, "placement": placement,
            "losses_bitwise_equal": losses["plain"] == losses["vpipe"], "measured_rounds": measure}))
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the result here")
    p.add_argument("--max-rounds", type=int, default=120)
    p.add_argument("--measure", type=int, default=30, help="rounds timed after vpipe's move")
    p.add_argument("--model", default=MODEL, help=f"the example trainer's model options (default: {MODEL!r})")
    p.add_argument("--rank-main", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        rank_main(args.rank_main[0], int(args.rank_main[1]), int(args.rank_main[2]), args.model.split())
        return 0
    from vpipe_lab.runtime.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        code = spawn([sys.executable, __file__, "--rank-main", str(out), str(args.max_rounds),
                      str(args.measure),
                      f"--model={args.model}"], 2,
                     extra_env=env, timeout_s=900)
        if code != 0 or not out.exists():
            print(f"deepspeed_balance: the ranks failed (exit code {code})", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    print(f"DeepSpeed alone {result['plain_step_s'] * 1e3:.1f} ms/step, with vpipe "
          f"{result['vpipe_step_s'] * 1e3:.1f} ms/step: {result['ratio']:.3f}x (rounds: median "
          f"{result['ratio_of_rounds']['median']:.3f}); placement {result['home']} -> {result['placement']} "
          f"at round {result['moved_at_round']}; losses bitwise equal: {result['losses_bitwise_equal']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
