"""Time per step and memory per rank of GPipe, 1F1B, PipeDream, 2BW and WPipe, side by side in one launch.

The schedules of the design's papers on the lab's 4-stage transformer, without vpipe: GPipe and
1F1B (a flush every step), PipeDream (weight stashing, an update per micro-batch), PipeDream-2BW
(two weight versions, an update per step) and WPipe where the lab has it. One launch holds them
all (``vpipe_lab/runtime/variants.py``: own layers, schedule, optimizer and gloo group each),
so the machine's drift between launches does not enter the comparison.

Timing: ``--warmup`` steps of each, then ``--rounds`` rounds that run every schedule for a
block of ``--block`` steps in order and then in reverse order (A B C C B A); a block's first
step is not counted (a stream refills after another schedule ran), each step is averaged
over the ranks, and a round's time is the median of its steps. Reported: the median over
rounds, and each schedule's per-round ratio to GPipe (median, min-max).

Memory per rank (a stage, or WPipe's two) is measured in the same launch, after the timed
rounds, over a block of steps of each schedule: *fixed* is weights, gradients, the optimizer's
state and the extra weight copies the schedule kept at its peak (PipeDream's stashes, 2BW's
and WPipe's G0's second version); *saved* is the peak of the activations its autograd graphs
hold, counted by a saved-tensor hook (each tensor once; weights and their stashed copies are
fixed bytes, not activations). On a CPU the devices are the host's cores: 4 ranks on 2 cores
share them, so a schedule that removes the bubble cannot gain what it gains on 4 GPUs (the
ranks never idle); the table says what this machine measures.

    python benchmarks/schedule_bench.py [--rounds 4] [--block 6] [--json OUT]
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
sys.path.insert(0, str(ROOT))

WANTED = ("gpipe", "1f1b", "pipedream", "pipedream2bw", "wpipe")  # those the lab knows are run, in this order


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--blocks", type=int, default=8, help="transformer blocks (default 8: 10 layers in all)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--block", type=int, default=6)
    p.add_argument("--json", default=None, metavar="OUT")
    p.add_argument("--rank-spec", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("stages", "blocks", "micro_batches", "micro_batch_size", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.block < 2:
        p.error("--block must be >= 2 (its first step is not counted)")
    if args.micro_batches < args.stages:
        p.error("--micro-batches must be >= --stages (1F1B and the streams need one in flight per stage)")
    return args


def schedules() -> list[str]:
    from vpipe_lab.runtime.layout import SCHEDULES

    return [s for s in WANTED if s in SCHEDULES]


def base_config(args: argparse.Namespace) -> Any:
    from vpipe_lab.runtime.config import RunConfig

    return RunConfig(model="transformer", blocks=args.blocks, d_model=args.d_model, seq_len=args.seq_len,
                     stages=args.stages, micro_batches=args.micro_batches,
                     micro_batch_size=args.micro_batch_size,
                     dropout=0.0, progress=False)


class SavedBytes:
    """The activations a rank's autograd graphs hold now and at their peak, as a saved-tensor hook sees them:
    each tensor once, while any graph holds it; weights (parameters, and their stashed copies: leaves that
    require grad shaped as a parameter) are not activations."""

    def __init__(self, modules: list[Any]) -> None:
        self.weight_shapes = {tuple(p.shape) for m in modules for p in m.parameters()}
        # (address, elements, element size) -> graphs holding it
        self.held: dict[tuple[int, int, int], int] = {}
        self.now = self.peak = 0

    def pack(self, t: Any) -> Any:
        import torch

        weight = t.is_leaf and t.requires_grad and tuple(t.shape) in self.weight_shapes
        if isinstance(t, torch.nn.Parameter) or weight:
            return t
        key = (t.data_ptr(), t.numel(), t.element_size())
        if key not in self.held:
            self.now += t.numel() * t.element_size()
            self.peak = max(self.peak, self.now)
        self.held[key] = self.held.get(key, 0) + 1
        return _Held(t, self, key)

    def unpack(self, packed: Any) -> Any:
        return packed.t if isinstance(packed, _Held) else packed

    def release(self, key: tuple[int, int, int]) -> None:
        self.held[key] -= 1
        if not self.held[key]:
            del self.held[key]
            self.now -= key[1] * key[2]


class _Held:
    __slots__ = ("t", "owner", "key")

    def __init__(self, t: Any, owner: SavedBytes, key: tuple[int, int, int]) -> None:
        self.t, self.owner, self.key = t, owner, key

    def __del__(self) -> None:
        self.owner.release(self.key)


def fixed_bytes(run: Any) -> int:
    """Weights and gradients, the optimizer's state, and the extra
    weight copies the schedule kept at its peak."""
    import torch

    params = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in run.modules]
    state = sum(t.numel() * t.element_size() for st in run.optimizer.state.values() for t in st.values()
                if isinstance(t, torch.Tensor))
    stashed = getattr(run.schedule, "peak_stashed", 0)
    copies = stashed[0] if isinstance(stashed, list) else stashed  # WPipe: G0's copies (its first stage's)
    return 2 * sum(params) + state + copies * params[0]


# ---------------------------------------------------------------------- one rank (worker)
def rank_main(args: argparse.Namespace) -> None:
    import torch

    from vpipe_lab.runtime.launch import init_distributed, run_rank
    from vpipe_lab.runtime.variants import Variant, build_variant

    spec = json.loads(Path(args.rank_spec).read_text())
    out_dir = Path(spec["out_dir"])
    fd = os.open(out_dir / f"rank{os.environ['RANK']}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    ctx = init_distributed()
    torch.set_num_threads(1)

    def main() -> None:
        base = base_config(args)
        runs = [build_variant(Variant(name=s, schedule=s, micro_batch_size=args.micro_batch_size,
                                      micro_batches=args.micro_batches), base, ctx, i)
                for i, s in enumerate(spec["schedules"])]
        for _ in range(args.warmup):
            for r in runs:
                r.step()
        times: dict[str, list[list[float]]] = {r.variant.name: [] for r in runs}
        for _ in range(args.rounds):
            for name in times:
                times[name].append([])
            for r in runs + runs[::-1]:
                for i in range(args.block):
                    start = time.perf_counter()
                    r.step()
                    if i:
                        times[r.variant.name][-1].append(time.perf_counter() - start)
        memory = {}
        for r in runs:  # after the timing: the hook costs time
            counter = SavedBytes(r.run.modules)
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                for _ in range(args.block):
                    r.step()
            memory[r.variant.name] = {"fixed_bytes": fixed_bytes(r.run), "peak_saved_bytes": counter.peak}
        for r in runs:
            r.close()
        Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps({"times": times, "memory": memory}))

    run_rank(ctx, main)


# ---------------------------------------------------------------------- the launch and the report
def launch(args: argparse.Namespace, names: list[str]) -> list[dict[str, Any]]:
    from vpipe_lab.runtime.launch import spawn

    with tempfile.TemporaryDirectory(prefix="vpipe-schedules-") as tmp:
        spec_path = Path(tmp, "spec.json")
        spec_path.write_text(json.dumps({"schedules": names, "out_dir": tmp}))
        argv = sys.argv[1:] if __name__ == "__main__" else []
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1"}
        code = spawn([sys.executable, str(Path(__file__).resolve()), *argv, "--rank-spec", str(spec_path)],
                     args.stages, extra_env=env)
        if code != 0:
            logs = "\n".join(p.read_text()[-2000:] for p in sorted(Path(tmp).glob("rank*.log")))
            raise RuntimeError(f"the launch failed (exit {code}):\n{logs}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.stages)]


def summarise(names: list[str], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    per_round: dict[str, list[float]] = {}
    for name in names:
        rounds = len(ranks[0]["times"][name])
        per_round[name] = [statistics.median(map(statistics.fmean,
                                                 zip(*(rank["times"][name][r] for rank in ranks))))
                           for r in range(rounds)]
    out = {}
    for name in names:
        ratios = [a / b for a, b in zip(per_round[name], per_round[names[0]])]
        out[name] = {"step_s": statistics.median(per_round[name]), "per_round_s": per_round[name],
                     "vs_gpipe": {"median": statistics.median(ratios), "min": min(ratios),
                                  "max": max(ratios)}}
    return out


def print_table(timing: dict[str, Any], mem: dict[str, list[dict[str, int]]]) -> None:
    mib = 1 << 20
    print(f"{'schedule':<14}{'ms/step':>9}  {'vs GPipe (min-max)':<20} per rank: fixed + peak saved (MiB)")
    for name, t in timing.items():
        r = t["vs_gpipe"]
        stages = "  ".join(f"{s['fixed_bytes'] / mib:.2f}+{s['peak_saved_bytes'] / mib:.2f}"
                           for s in mem[name])
        ratio = f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"
        print(f"{name:<14}{t['step_s'] * 1e3:>9.1f}  {ratio:<20} {stages}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_spec:
        rank_main(args)
        from vpipe_lab.runtime.launch import exit_now

        exit_now(0)
    started = time.perf_counter()
    names = schedules()
    ranks = launch(args, names)
    timing = summarise(names, ranks)
    mem = {name: [rank["memory"][name] for rank in ranks] for name in names}
    print_table(timing, mem)
    out = {"benchmark": "schedules", "settings": {k: v for k, v in vars(args).items() if k != "rank_spec"},
           "schedules": names, "timing": timing, "memory": mem, "seconds": time.perf_counter() - started}
    if args.json:
        from vpipe.files import write_output

        write_output(args.json, json.dumps(out, indent=2).encode(), "--json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
