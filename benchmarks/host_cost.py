"""What the tensor manager's policies cost the host per step, counted instead of timed.

A launch-bound stage's step is the host's time to issue it, and a shared machine's clock
drifts by more than the few percent a change to the swap path makes. Two counts do not
drift: Python bytecodes executed (``sys.settrace`` with per-opcode events) and tensor
operations dispatched (a ``TorchDispatchMode``), each over one unmetered step of the
model of ``tensor_manager_bench.py`` (same variants, same arguments), after a warm-up.
Both are what a GPU's host pays too: every bytecode, and every operation's dispatch and
(on CUDA) its launch or allocation.

Per variant: bytecodes in all and in vpipe's own modules; tensor operations in all and
beyond plain, the most frequent of those named. ``--against REV`` counts ``vpipe D/S/R``
as at another revision (``revision.py``) beside this checkout's.

    python benchmarks/host_cost.py --d-model 32 --heads 2 --seq-len 8 --micro-batch-size 1 \
        --min-swap-bytes 0 --only "vpipe S,save_on_cpu" --against 5912d1a
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tensor_manager_bench import (  # noqa: E402
    VARIANTS,
    Bench,
    _against,
    add_bench_arguments,
    parse_bench_arguments,
)

COUNTED = tuple(v for v in VARIANTS if v != "vpipe 40%")  # (a budget's escalations are not one step's cost)


class _OperationCounter(TorchDispatchMode):
    """Counts the tensor operations dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_bytecodes(step: Callable[[], None]) -> tuple[int, int]:
    """Bytecodes ``step`` executes: in all, and in modules of a
    vpipe package (this one or another revision's)."""
    total = own = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal total, own
        frame.f_trace_opcodes = True
        if event == "opcode":
            total += 1
            name = frame.f_globals.get("__name__", "")
            if name == "vpipe" or name.startswith(("vpipe.", "vpipe_at_")):
                own += 1
        return trace

    sys.settrace(trace)
    try:
        step()
    finally:
        sys.settrace(None)
    return total, own


def count_operations(step: Callable[[], None]) -> collections.Counter[str]:
    with _OperationCounter() as counter:
        step()
    return counter.counts


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    variants = ("plain",) + tuple(v for v in COUNTED[1:] if not args.only or v in args.only)
    against = _against(args.against, variants) if args.against else {}
    variants += tuple(against)
    bench = Bench(args, against)
    for _ in range(3):  # the allocator, the pool, the managers' measurements and the learned step order
        for variant in variants:
            bench.step(variant)
    for variant, manager in bench.managers.items():
        # as attach runs the steps its monitor does not sample
        manager.metering = variant == "vpipe D metered"
    rows, plain_ops = [], None
    for variant in variants:
        bench.step(variant)
        total, own = count_bytecodes(lambda: bench.step(variant))  # noqa: B023 - called at once
        ops = count_operations(lambda: bench.step(variant))  # noqa: B023
        if plain_ops is None:
            plain_ops = ops
        beyond = ops - plain_ops
        rows.append({"variant": variant, "bytecodes": total, "vpipe_bytecodes": own,
                     "operations": sum(ops.values()),
                     "operations_beyond_plain": sum(beyond.values()),
                     "most_beyond_plain": beyond.most_common(6)})
    return {"config": {k: v for k, v in vars(args).items() if k != "json"}, "torch": torch.__version__,
            "rows": rows}


def print_table(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(f"host cost per unmetered step: {cfg['blocks']} blocks d={cfg['d_model']} T={cfg['seq_len']}, "
          f"{cfg['micro_batches']} x {cfg['micro_batch_size']} micro-batches, {cfg['device']}, "
          f"torch {result['torch']}")
    header = f"{'variant':<20} {'bytecodes':>10} {'of vpipe':>10} {'tensor ops':>11} {'beyond plain':>13}"
    print(header + "  most beyond plain")
    for row in result["rows"]:
        most = ", ".join(f"{name.removeprefix('aten.')} {n}" for name, n in row["most_beyond_plain"])
        print(f"{row['variant']:<20} {row['bytecodes']:>10,} {row['vpipe_bytecodes']:>10,} "
              f"{row['operations']:>11,} {row['operations_beyond_plain']:>13,}  {most}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # (the launch-bound model at the size of this machine's measurements: every call shows)
    add_bench_arguments(p, COUNTED, device="cpu", d_model=32, heads=2, seq_len=8, micro_batch_size=1,
                        min_swap_bytes=0)
    args = parse_bench_arguments(p, COUNTED, argv)
    result = run(args)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
