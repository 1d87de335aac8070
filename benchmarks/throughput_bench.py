"""Throughput vs baselines under one per-stage memory budget, and the fraction of ideal each reaches.

For each case (model, stages) one launch holds every system side by side (own layers,
schedule, optimizer and gloo group each; see ``vpipe_lab/runtime/variants.py``):

  GPipe (all R)           torch checkpoint on every layer, the reference micro-batch size
  1F1B (all D)            every activation kept, the largest micro-batch size that fits
  PipeDream (all D)       asynchronous, weight stashing, the largest micro-batch that fits
  GPipe / 1F1B / PipeDream + vpipe   the reference micro-batch size, vpipe enforcing the
                          budget (keep -> swap -> recompute as needed) and its online planner
                          rebalancing layers and policies from live statistics
  Interleaved 1F1B (all D), ZBV (all D)   two virtual stages per rank (torch's multi-stage
                          schedules), every activation kept, the largest micro-batch that fits
  Interleaved 1F1B / ZBV + vpipe   the same under vpipe, whose planner also moves layers
                          between virtual stages (within a rank on ZBV's V), at the reference
                          size or, where a stage's share of the rank's budget cannot hold
                          a recomputed block's working set at that size, the largest that fits
  1F1B, no budget         all kept at the reference size: what unlimited memory would give

The multi-stage rows run where the model has a layer for each of the 2 x stages virtual
stages (the 2-rank cases by default). The global batch (micro-batch size x micro-batches)
is the same for all. Every system starts on the time-balanced partition of the measured
layer costs (what a static partitioner gives a baseline; over the virtual stages for the
multi-stage rows). The budget is the same for every rank and system (a rank that runs two
virtual stages shares it between them, as vpipe does): the largest stage's fixed bytes
(weights, gradients, Adam state) plus ``--budget-fraction`` of the largest stage's saved
activations under 1F1B all-kept at the reference size, so plain 1F1B does not fit at that
size and must shrink its micro-batches, and at least what GPipe with every layer
recomputed needs, so that every baseline runs. "Fits" for a baseline means its footprint
by the tensor manager's accounting (fixed bytes + peak saved activations + a recomputed
layer's working set, each rank run in one process under its schedule's order,
``vpipe_lab/runtime/fit.py``) is within the budget; micro-batch sizes are divisors of the
global batch.

Timing: after ``--adapt`` steps that let vpipe's planner settle, ``--rounds`` rounds run
every system for a block of ``--block`` steps in order and then in reverse order
(A B ... B A), each vpipe system right after the same schedule without it; the first step
of each block is not counted (a PipeDream stream refills), and a round's time for a system
is the median of its counted steps (each averaged over the ranks). After each round, rank 0
profiles every layer of the model (one thread, the others wait) for the *ideal*: perfect
balance, no bubble, no recompute, unlimited memory = the model's forward + backward per
micro-batch / stages. With fewer cores than stages the ideal is
also given for min(stages, cores) (4 ranks on 2 cores cannot beat 2 cores). Reported per
system: median samples/s; per-round ratios (median, min-max) of each vpipe system to the
same schedule without vpipe and of every system to GPipe (all R); the fraction of the
same round's ideal.

    python benchmarks/throughput_bench.py [--cases transformer:2,cnn:4] [--rounds 12] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
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

BASELINE = "GPipe (all R)"
WITHOUT_VPIPE = {"GPipe + vpipe": "GPipe (all R)", "1F1B + vpipe": "1F1B (all D)",
                 "PipeDream + vpipe": "PipeDream (all D)",
                 "Interleaved 1F1B + vpipe": "Interleaved 1F1B (all D)",
                 "ZBV + vpipe": "ZBV (all D)"}
MULTI_STAGE = (("interleaved1f1b", "Interleaved 1F1B"), ("zbv", "ZBV"))  # two virtual stages per rank


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="transformer:2,transformer:4,cnn:2,cnn:4",
                   help="model:stages, comma-separated (models: transformer, cnn)")
    p.add_argument("--blocks", type=int, default=4, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=8, help="the reference micro-batch size")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="at the reference size (sets the global batch)")
    p.add_argument("--cnn-micro-batch-size", type=int, default=32,
                   help="the CNN's reference micro-batch size")
    p.add_argument("--budget-fraction", type=float, default=0.5,
                   help="of the largest stage's 1F1B all-kept activations, on top of its fixed bytes")
    p.add_argument("--adapt", type=int, default=4,
                   help="steps per system before timing (vpipe's planner settles)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--block", type=int, default=5,
                   help="steps per system per block (the first is not counted)")
    p.add_argument(
        "--systems",
        default=None,
        help="comma-separated system names to run (default: all), e.g. '1F1B (all D),1F1B + vpipe'",
    )
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="for the cores-capped ideal")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--work-dir", default=None, help="keep each launch's spec, rank results and logs here")
    p.add_argument("--rank-spec", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------- planning a case (parent)
def base_config(args: argparse.Namespace, model: str, stages: int) -> Any:
    from vpipe_lab.runtime.config import RunConfig

    mbs = args.cnn_micro_batch_size if model == "cnn" else args.micro_batch_size
    return RunConfig(model=model, blocks=args.blocks, d_model=args.d_model, seq_len=args.seq_len,
                     stages=stages,
                     schedule="1f1b", micro_batches=args.micro_batches, micro_batch_size=mbs, progress=False)


def plan_case(args: argparse.Namespace, model: str, stages: int) -> dict[str, Any]:
    """Budget, partition and each system's micro-batch size for one
    case, from measurements in this process."""
    from vpipe_lab.runtime.costs import balanced_counts, measure_model_costs
    from vpipe_lab.runtime.fit import pipeline_fit
    from vpipe_lab.runtime.variants import Variant

    base = base_config(args, model, stages)
    costs = measure_model_costs(base, repeats=3, rounds=1)
    base = dataclasses.replace(base, partition=balanced_counts(costs, stages))
    mbs, m = base.micro_batch_size, base.micro_batches
    batch = mbs * m
    kept = pipeline_fit(base, 1 << 62, managed=False, policy="D")
    recomputed = pipeline_fit(dataclasses.replace(base, schedule="gpipe"), 1 << 62, managed=False, policy="R")
    budget = max(max(s.fixed_bytes for s in kept.stages) + int(args.budget_fraction *
                                                               max(s.peak_saved_bytes for s in kept.stages)),
                 max(s.footprint_bytes for s in recomputed.stages))

    def config(schedule: str, size: int, partition: list[int] | None) -> Any:
        return dataclasses.replace(base, schedule=schedule, micro_batch_size=size,
                                   micro_batches=batch // size,
                                   partition=partition or base.partition)

    def fit(schedule: str, size: int, *, policy: str = "D", managed: bool = False,
            partition: list[int] | None = None) -> dict[str, Any]:
        return pipeline_fit(config(schedule, size, partition), budget, managed=managed,
                            policy=policy).to_dict()

    def largest(schedule: str, partition: list[int] | None = None, *, managed: bool = False,
                at_most: int = batch) -> tuple[int, dict[str, Any] | None]:
        for size in sorted((d for d in range(1, at_most + 1) if batch % d == 0 and batch // d >= stages),
                           reverse=True):
            try:
                config(schedule, size, partition)
            except ValueError:  # a micro-batch count the schedule does not take
                continue
            result = fit(schedule, size, managed=managed, partition=partition)
            if result["fits"]:
                return size, result
        return 0, None

    fits: dict[str, Any] = {}
    variants: list[Variant] = []
    fits[BASELINE] = fit("gpipe", mbs, policy="R")
    if fits[BASELINE]["fits"]:
        variants.append(Variant(BASELINE, "gpipe", mbs, m, policy="R"))
    for schedule, label in (("1f1b", "1F1B (all D)"), ("pipedream", "PipeDream (all D)")):
        size, result = largest(schedule)
        fits[label] = result or {"fits": False}
        if size:
            variants.append(Variant(label, schedule, size, batch // size))
    for schedule, label in (("gpipe", "GPipe + vpipe"), ("1f1b", "1F1B + vpipe"),
                            ("pipedream", "PipeDream + vpipe")):
        fits[label] = fit(schedule, mbs, managed=True)
        if fits[label]["fits"]:
            # a PipeDream stream cannot yet move a layer whose move changes a boundary shape (the CNN's):
            # that needs a flush, and the stream does not restart cleanly after one; policies only there
            moves = not (schedule == "pipedream" and model == "cnn")
            variants.append(Variant(label, schedule, mbs, m, vpipe=True, memory_budget=budget, moves=moves))
    virtual = balanced_counts(costs, 2 * stages) if 2 * stages <= len(costs.layers) else None
    if virtual is not None:
        for schedule, name in MULTI_STAGE:
            size, result = largest(schedule, virtual)
            fits[f"{name} (all D)"] = result or {"fits": False}
            if size:
                variants.append(Variant(f"{name} (all D)", schedule, size, batch // size, partition=virtual))
            # vpipe gives each of a rank's stages half its budget: where half cannot hold a recomputed block's
            # working set at the reference size, the largest size below it that fits
            size, result = largest(schedule, virtual, managed=True, at_most=mbs)
            fits[f"{name} + vpipe"] = result or {"fits": False}
            if size:
                variants.append(Variant(f"{name} + vpipe", schedule, size, batch // size, vpipe=True,
                                        memory_budget=budget, partition=virtual))
    variants.append(Variant("1F1B, no budget (all D)", "1f1b", mbs, m))
    variants = _pairs_adjacent(variants)
    if args.systems:
        wanted = {name.strip() for name in args.systems.split(",")}
        unknown = wanted - {v.name for v in variants}
        if unknown:
            raise SystemExit(f"throughput_bench: no system {sorted(unknown)} in {model} on "
                             f"{stages} stages; it has "
                             + ", ".join(v.name for v in variants))
        variants = [v for v in variants if v.name in wanted]
    return {"model": model, "stages": stages, "base": base.to_dict(), "budget_bytes": budget,
            "partition": base.partition, "virtual_partition": virtual, "global_batch": batch, "fits": fits,
            "variants": [v.to_dict() for v in variants], "profile_compute_s": costs.compute_s}


def _pairs_adjacent(variants: list[Any]) -> list[Any]:
    """Each vpipe system right after the same schedule without vpipe: the machine's speed drifts within
    seconds, and a ratio of neighbours in the A B ... B A order sees the least of it."""
    out = [v for v in variants if v.name not in WITHOUT_VPIPE]
    for v in variants:
        if v.name in WITHOUT_VPIPE:
            partner = WITHOUT_VPIPE[v.name]
            at = next((i for i, w in enumerate(out) if w.name == partner), len(out) - 1)
            out.insert(at + 1, v)
    return out


# ---------------------------------------------------------------------- one rank (worker)
def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from vpipe import VpipeConfig
    from vpipe.monitors.sampling import SampleSchedule
    from vpipe_lab.runtime.config import RunConfig
    from vpipe_lab.runtime.costs import measure_model_costs
    from vpipe_lab.runtime.launch import init_distributed, run_rank
    from vpipe_lab.runtime.variants import Variant, build_variant

    spec = json.loads(Path(args.rank_spec).read_text())
    out_dir = Path(spec["out_dir"])
    _quiet(out_dir / f"rank{os.environ['RANK']}.log")
    ctx = init_distributed()
    torch.set_num_threads(1)

    def main() -> None:
        base = RunConfig.from_dict(spec["base"])
        runs = [build_variant(Variant(**v), base, ctx, i) for i, v in enumerate(spec["variants"])]
        names = [r.variant.name for r in runs]
        for _ in range(spec["adapt"]):
            for r in runs:
                r.step()
        for r in runs:  # the planner has had its samples: monitor at vpipe's default rates from now on
            if r.vp is not None:
                defaults = VpipeConfig()
                schedule = SampleSchedule(defaults.sample_every, max_every=defaults.sampling_cap)
                schedule.restart(r.vp.iteration)
                for monitor in r.vp.session.monitors.values():
                    monitor.schedule = schedule
        times: dict[str, list[list[float]]] = {n: [] for n in names}
        ideal: list[float] = []
        for _ in range(spec["rounds"]):
            for n in names:
                times[n].append([])
            for r in runs + runs[::-1]:
                for i in range(spec["block"]):
                    start = time.perf_counter()
                    r.step()
                    if i:
                        times[r.variant.name][-1].append(time.perf_counter() - start)
            dist.barrier()
            if ctx.rank == 0:
                ideal.append(measure_model_costs(base, repeats=3, rounds=1).compute_s)
            dist.barrier()
        states = {r.variant.name: r.state() for r in runs}
        for r in runs:
            r.close()
        Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps({"times": times, "ideal_compute_s": ideal,
                                                                      "states": states}))

    run_rank(ctx, main)


def _quiet(path: Path) -> None:
    """Send this rank's stderr (and its planner daemon's) to a file: the parent prints it if the run fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def run_case(args: argparse.Namespace, case: dict[str, Any]) -> dict[str, Any]:
    from vpipe_lab.runtime.launch import spawn

    with tempfile.TemporaryDirectory(prefix="vpipe-throughput-") as scratch:
        tmp = scratch
        if args.work_dir:
            tmp = str(Path(args.work_dir, f"{case['model']}-{case['stages']}"))
            Path(tmp).mkdir(parents=True, exist_ok=True)
        spec_path = Path(tmp, "spec.json")
        spec_path.write_text(json.dumps({**case, "out_dir": tmp, "adapt": args.adapt, "rounds": args.rounds,
                                         "block": args.block}))
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1"}
        code = spawn([sys.executable, str(Path(__file__).resolve()), "--rank-spec", str(spec_path)],
                     case["stages"],
                     extra_env=env)
        if code != 0:
            logs = "\n".join(p.read_text()[-2000:] for p in sorted(Path(tmp).glob("rank*.log")))
            raise RuntimeError(f"{case['model']} on {case['stages']} stages failed (exit {code}):\n{logs}")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(case["stages"])]
    return summarise(args, case, ranks)


# ---------------------------------------------------------------------- report
def summarise(args: argparse.Namespace, case: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    batch, stages = case["global_batch"], case["stages"]
    m = case["base"]["micro_batches"]
    names = [v["name"] for v in case["variants"]]
    ideal = [m * c / stages for c in ranks[0]["ideal_compute_s"]]  # seconds per step
    capped = [m * c / min(stages, args.cores) for c in ranks[0]["ideal_compute_s"]]
    per_round: dict[str, list[float]] = {}
    for n in names:
        # a step lasts one pipeline period on every rank: average the ranks, then the median of the round's
        # steps (one step the machine stalled does not make the round)
        rounds = []
        for r in range(len(ideal)):
            step = statistics.median(map(statistics.fmean, zip(*(rank["times"][n][r] for rank in ranks))))
            rounds.append(batch / step)
        per_round[n] = rounds
    def paired(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(per_round[a],
                                      per_round[b])] if a in per_round and b in per_round else []

    rows = []
    for v in case["variants"]:
        n = v["name"]
        thr = per_round[n]
        rows.append({
            "system": n, "schedule": v["schedule"], "vpipe": v["vpipe"],
                     "micro_batch_size": v["micro_batch_size"],
            "micro_batches": v["micro_batches"], "samples_per_s": statistics.median(thr),
                     "samples_per_s_rounds": thr,
            "vs_gpipe": _spread(paired(n, BASELINE)),
            "vs_without_vpipe": _spread(paired(n, WITHOUT_VPIPE[n])) if n in WITHOUT_VPIPE else None,
            "of_ideal": statistics.median(t * i / batch for t, i in zip(thr, ideal)),
            "of_ideal_cores": statistics.median(t * c / batch for t, c in zip(thr, capped)),
            "vpipe_state": ranks_state(ranks, n),
        })
    for label, fit in case["fits"].items():
        if not fit.get("fits"):
            rows.append({"system": label, "fits": False, "samples_per_s": None})
    return {"model": case["model"], "stages": stages, "budget_bytes": case["budget_bytes"],
            "partition": case["partition"], "virtual_partition": case.get("virtual_partition"),
            "global_batch": batch, "micro_batches_ref": m,
            "ideal_samples_per_s": statistics.median(batch / i for i in ideal),
            "ideal_cores_samples_per_s": statistics.median(batch / c for c in capped),
            "rows": rows, "fits": case["fits"], "config": case["base"]}


def _spread(ratios: list[float]) -> dict[str, float] | None:
    """Median and range over rounds of a per-round ratio (None when one side did not run)."""
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}


def _ratio_text(spread: dict[str, float] | None) -> str:
    return "-" if spread is None else f"{spread['median']:.2f} ({spread['min']:.2f}-{spread['max']:.2f})"


def ranks_state(ranks: list[dict[str, Any]], name: str) -> dict[str, Any]:
    states = [r["states"].get(name) or {} for r in ranks]
    if not any(states):
        return {}
    return {"stages": states[0].get("stages"), "policies": [s.get("policies") for s in states],
            "escalations": sum(s.get("escalations", 0) for s in states),
            "peak_saved_bytes": [s.get("peak_saved_bytes") for s in states],
            "fixed_bytes": [s.get("fixed_bytes") for s in states], "epoch": states[0].get("epoch"),
            "hooked": [s.get("hooked") for s in states]}


def print_case(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from vpipe.tensor_manager.accounting import format_bytes

    virtual = f" ({result['virtual_partition']} on virtual stages)" if result.get("virtual_partition") else ""
    table = Table(title=(f"{result['model']} on {result['stages']} stages: budget "
                         f"{format_bytes(result['budget_bytes'])} per rank, global batch "
                         f"{result['global_batch']}, partition {result['partition']}{virtual}; ideal "
                         f"{result['ideal_samples_per_s']:.0f} samples/s "
                         f"({result['ideal_cores_samples_per_s']:.0f} on the cores)"))
    for col in ("system", "mb x n", "samples/s", "vs without vpipe", f"vs {BASELINE}", "of ideal",
                "of ideal (cores)",
                "vpipe ended"):
        table.add_column(col, justify="left" if col in ("system", "vpipe ended") else "right",
                         no_wrap=col != "vpipe ended")
    for r in result["rows"]:
        if r["samples_per_s"] is None:
            table.add_row(r["system"], "-", "does not fit", "", "", "", "", "")
            continue
        state = r["vpipe_state"]
        ended = (f"layers {[len(s) for s in state['stages']]}, {' | '.join(state['policies'])}" if state
                 else "")
        table.add_row(r["system"], f"{r['micro_batch_size']} x {r['micro_batches']}",
                      f"{r['samples_per_s']:.1f}",
                      _ratio_text(r["vs_without_vpipe"]), _ratio_text(r["vs_gpipe"]), f"{r['of_ideal']:.0%}",
                      f"{r['of_ideal_cores']:.0%}", ended)
    Console(width=170).print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_spec:
        rank_main(args)
        from vpipe_lab.runtime.launch import exit_now

        exit_now(0)  # a finished rank skips torch's slow interpreter shutdown
    cases = []
    for item in args.cases.split(","):
        model, _, stages = item.partition(":")
        if model not in ("transformer", "cnn") or not stages.isdigit():
            raise SystemExit(f"throughput_bench: cases look like transformer:2,cnn:4, got {item!r}")
        cases.append((model, int(stages)))
    results = []
    started = time.perf_counter()
    for model, stages in cases:
        case = plan_case(args, model, stages)
        result = run_case(args, case)
        print_case(result)
        results.append(result)
    out = {"benchmark": "throughput", "cases": results, "seconds": time.perf_counter() - started,
           "config": {k: v for k, v in vars(args).items() if k not in ("json", "rank_spec")}}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
