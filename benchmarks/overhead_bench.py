"""What attaching vpipe costs when there is nothing to gain: a balanced pipeline that fits.

The trainer is the one of ``examples/train_sequential.py`` (each rank an ``nn.Sequential``
slice of residual MLP blocks, torch's ``PipelineStage`` and ``Schedule1F1B``, Adam) on 2 CPU
stages split 4,4, at two sizes:

- **small**: width 64, sequence 32, 4 micro-batches of 2 (about 10-30 ms steps on 2 cores),
  where a fixed cost per step or per layer call shows most;
- **medium**: width 256, sequence 64, 4 micro-batches of 4 (about 180 ms steps).

A shared machine's speed drifts within seconds (the same run's 50-step means range over
+-20%), so two separate launches cannot resolve a few per cent. Each launch therefore runs
the same trainer twice, side by side in the same processes: a **plain** copy (its own
layers, stage, schedule, optimizer and gloo group, no vpipe) and a copy with the one line,
``vpipe.attach(schedule, optimizer=opt)``, stepped in ABBA order (plain, vpipe, vpipe, plain,
...), each on the same batches from the same initial weights. Two kinds of launch:
**attached** (``planning=False``: tensor manager and monitor) and **planned** (the one
line's defaults: the planner daemon runs, the monitor samples every 10th step, less often
while nothing changes, and the planner finds nothing to change). A launch's ratio is the
mean step of the vpipe copy over the plain copy's, over the second half of each; rounds
alternate the two kinds of launch, and the table gives the median ratio over rounds and
their range. The planner daemon is its own process: it competes with both copies for the
cores, so its CPU seconds over the run are reported beside the ratio. Each launch also
checks that the two copies computed the same losses, bit for bit (nothing was moved: vpipe
must not change the training).

Where the attached run's time goes (``--profile``, on by default): one more attached run
of the small model (``examples/train_sequential.py --vpipe``), every rank under
``cProfile``; vpipe's own functions are grouped by what they run for: per saved tensor
(the pack and unpack hooks), per layer call (the tensor manager's forward hooks, the
monitor's on sampled steps), per micro-batch (the chunk wrappers and contexts), per step
(the step boundary, the monitor's records, the control plane). cProfile slows Python down
(each call pays for being counted), so the figures are upper bounds; their shares say
where the time goes.

Run: ``python benchmarks/overhead_bench.py [--json OUT]`` (about 10 minutes on 2 cores).
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
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_sequential.py"
SIZES = {  # the trainer's arguments, and the steps each copy runs in a launch
    "small": (["--width", "64", "--seq-len", "32", "--micro-batch-size", "2"], 600),
    "medium": (["--width", "256", "--seq-len", "64", "--micro-batch-size", "4"], 40),
}
MODES = ("attached", "planned")  # planning=False / the one line's defaults


def _env(log_file: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", VPIPE_LOG_FILE=str(log_file))
    env.pop("RANK", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# ---------------------------------------------------------------------- one rank of a launch
def _example() -> Any:
    """The example trainer's module (its model and batches), loaded from its file."""
    spec = importlib.util.spec_from_file_location("train_sequential", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_main(args: argparse.Namespace) -> int:
    """Build the trainer twice on this rank (plain, and with the one line) and step them in ABBA order."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import vpipe

    example = _example()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_stage = 4

    def build(group: Any) -> tuple[Any, torch.optim.Optimizer]:
        torch.manual_seed(0)
        layers = [example.ResidualMLP(args.width) for _ in range(per_stage * world)]
        module = nn.Sequential(*layers[rank * per_stage:(rank + 1) * per_stage])
        stage = PipelineStage(module, rank, world, torch.device("cpu"), group=group)
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
        return Schedule1F1B(stage, args.micro_batches, loss_fn=F.mse_loss), optimizer

    copies = {"plain": build(dist.new_group(backend="gloo")), "vpipe": build(None)}
    schedule, optimizer = copies["vpipe"]
    vpipe.attach(schedule, optimizer=optimizer, planning=args.mode == "planned")  # the one line
    steps = {name: 0 for name in copies}
    step_s: dict[str, list[float]] = {name: [] for name in copies}
    losses: dict[str, list[list[float]]] = {name: [] for name in copies}
    for i in range(2 * args.steps):
        name = "plain" if i % 4 in (0, 3) else "vpipe"
        schedule, optimizer = copies[name]
        started = time.perf_counter()
        x, y = example.batch(steps[name], args.micro_batches * args.micro_batch_size, args.seq_len,
                             args.width)
        step_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=step_losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s[name].append(time.perf_counter() - started)
        losses[name].append([float(loss.detach()) for loss in step_losses])
        steps[name] += 1
    if rank == world - 1:
        Path(args.out).write_text(json.dumps({"step_s": step_s, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------- launches
def run_launch(size: str, mode: str, tmp: Path) -> dict[str, Any]:
    """One torchrun launch of both copies; the vpipe copy's mean
    step over the plain copy's (second halves)."""
    args, steps = SIZES[size]
    out, log_file = tmp / f"{size}-{mode}.json", tmp / f"{size}-{mode}.log"
    log_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "--rank", "--mode", mode, "--steps", str(steps), "--out", str(out),
           *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(log_file), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{size} {mode} failed:\n{proc.stderr[-2000:]}")
    from vpipe.log import read_log

    log = read_log(log_file) if log_file.exists() else []
    data = json.loads(out.read_text())
    means = {name: statistics.fmean(s[len(s) // 2:]) for name, s in data["step_s"].items()}
    planner_cpu = [r["cpu_s"] for r in log if "cpu_s" in r and r.get("logger") == "vpipe.planner.daemon"]
    return {"plain_step_s": means["plain"], "vpipe_step_s": means["vpipe"],
            "ratio": means["vpipe"] / means["plain"],
            "plans": sum(1 for r in log if r.get("event") == "plan_applied"),
            "same_losses": data["losses"]["plain"] == data["losses"]["vpipe"],
            "planner_cpu_s": planner_cpu[-1] if planner_cpu else None,
            "run_s": sum(sum(s) for s in data["step_s"].values())}


# vpipe's functions by what they run for (the rest, set-up at attach, runs once)
_PER = {  # (first match wins: the micro-batch counts before the saved tensors' ledger)
    "micro-batch": ("tensor_manager/pipelining.py:", "tensor_manager/manager.py:micro_batch",
                    "tensor_manager/quiet.py:", "tensor_manager/in_flight.py:",
                    "tensor_manager/interception.py:count_unhooked",
                    "tensor_manager/accounting.py:add_micro_batch",
                    "tensor_manager/accounting.py:sub_micro_batch",
                    "tensor_manager/manager.py:backward", "tensor_manager/manager.py:_begin_forward",
                    "tensor_manager/interception.py:uncount", "tensor_manager/governor.py:comfortably_within",
                    "tensor_manager/prefetch.py:"),
    "saved tensor": ("tensor_manager/interception.py:pack", "tensor_manager/interception.py:unpack",
                     "tensor_manager/swap", "tensor_manager/handles.py:", "tensor_manager/accounting.py:",
                     "tensor_manager/layers.py:is_weight"),
    "layer call": ("tensor_manager/interception.py:pre_forward",
                   "tensor_manager/interception.py:post_forward",
                   "tensor_manager/interception.py:_frames", "tensor_manager/layers.py:__init__",
                   "monitors/stage.py:_forward", "monitors/stage.py:_backward", "monitors/stage.py:_counts"),
    "step": ("rank/", "control/", "monitors/", "log.py:"),
}


def profile_breakdown(steps: int, tmp: Path) -> dict:
    """Per-step seconds of vpipe's own functions on each rank of an attached small run, under cProfile."""
    import pstats

    args, _ = SIZES["small"]
    out, log_file = tmp / "profiled.json", tmp / "profiled.log"
    script = str(ROOT / "examples" / "train_sequential.py")
    wrapper = f'exec "{sys.executable}" -m cProfile -o "{tmp}/rank$RANK.prof" "{script}" "$@"'
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--no-python",
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
            if where is None or where.startswith(("_attach.py", "rank/build.py", "rank/agreement.py",
                                                  "stage/pipeline.py")):
                continue
            group = next((g for g, prefixes in _PER.items() if where.startswith(prefixes)), None)
            if group is not None:
                groups[group] += tottime
            if where == "tensor_manager/interception.py:pack":
                calls["saved tensor"] = ncalls
            elif where == "tensor_manager/interception.py:pre_forward":
                calls["layer call"] = ncalls
            elif where == "tensor_manager/quiet.py:begin_forward":  # (every forward asks it first)
                calls["micro-batch"] = ncalls
        step_s = json.loads(out.read_text())["step_s"]
        ranks.append({"rank": rank, "per_step_s": {g: t / steps for g, t in groups.items()},
                      "calls_per_step": {g: n / steps for g, n in calls.items()},
                      "step_s": statistics.median(step_s[len(step_s) // 2:])})
    return {"steps": steps, "ranks": ranks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ", ".join(SIZES))
    parser.add_argument("--rounds", type=int, default=3, help="launches of each kind per size")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile breakdown")
    parser.add_argument("--json", default=None, help="write the results here")
    # one rank of a launch (what the launches run under torchrun)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="attached", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--micro-batches", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--micro-batch-size", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        return rank_main(args)
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
            launches: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
            for r in range(args.rounds):
                for mode in (MODES if r % 2 == 0 else tuple(reversed(MODES))):
                    print(f"overhead: {size} round {r + 1}/{args.rounds}: {mode} ...", flush=True)
                    launches[mode].append(run_launch(size, mode, Path(tmp)))
            every = [launch for mode in MODES for launch in launches[mode]]
            row: dict[str, Any] = {
                "size": size, "steps": SIZES[size][1],
                "plain_step_s": statistics.median(launch["plain_step_s"] for launch in every),
                "plans_applied": sum(launch["plans"] for launch in every),
                "same_losses": all(launch["same_losses"] for launch in every),
            }
            for mode in MODES:
                ratios = [launch["ratio"] for launch in launches[mode]]
                row[f"{mode}_step_s"] = statistics.median(launch["vpipe_step_s"] for launch in launches[mode])
                row[f"{mode}_over_plain"] = statistics.median(ratios)
                row[f"{mode}_range"] = [min(ratios), max(ratios)]
            cpu = [(launch["planner_cpu_s"], launch["run_s"]) for launch in launches["planned"]
                   if launch["planner_cpu_s"] is not None]
            row["planner_cpu_share"] = statistics.median(c / s for c, s in cpu) if cpu else None
            rows.append(row)
        breakdown = None if args.no_profile else profile_breakdown(600, Path(tmp))
    table = Table(title="attaching vpipe to a balanced 2-stage pipeline that fits (the trainer of "
                        "examples/train_sequential.py, 4,4, plain and attached copies side by side)")
    for col in ("size", "plain", "attached", "attached / plain", "planned", "planned / plain", "planner CPU",
                "plans applied", "same losses"):
        table.add_column(col, justify="left" if col == "size" else "right")
    for row in rows:
        cells = [row["size"], f"{row['plain_step_s'] * 1e3:.1f} ms"]
        for mode in MODES:
            lo, hi = row[f"{mode}_range"]
            cells += [f"{row[f'{mode}_step_s'] * 1e3:.1f} ms",
                      f"{row[f'{mode}_over_plain']:.3f}x ({lo:.3f}-{hi:.3f})"]
        share = row["planner_cpu_share"]
        cells += ["-" if share is None else f"{share:.1%} of a core", str(row["plans_applied"]),
                  "yes" if row["same_losses"] else "NO"]
        table.add_row(*cells)
    Console().print(table)
    if breakdown is not None:
        parts = (Table(title="vpipe's own time per step of the small attached run, under "
                             "cProfile (upper bounds)"))
        for col in ("rank", "step", "per step", "per micro-batch", "per layer call", "per saved tensor"):
            parts.add_column(col, justify="right")
        for r in breakdown["ranks"]:
            per, calls = r["per_step_s"], r["calls_per_step"]
            parts.add_row(str(r["rank"]), f"{r['step_s'] * 1e3:.1f} ms", f"{per['step'] * 1e6:.0f} us",
                          *(f"{per[g] * 1e6:.0f} us ({calls[g]:.0f} calls)" for g in
                            ("micro-batch", "layer call", "saved tensor")))
        Console().print(parts)
    result = {"benchmark": "overhead", "rounds": args.rounds, "method": "side by side", "rows": rows,
              "breakdown": breakdown}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    failed = [row["size"] for row in rows if not row["same_losses"] and not row["plans_applied"]]
    if failed:  # nothing moved, so the two copies must have computed the same thing
        print(f"overhead: with no plan applied, vpipe changed the losses of the {', '.join(failed)} model",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
