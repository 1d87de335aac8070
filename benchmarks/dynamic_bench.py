"""Dynamic workloads: does vpipe move blocks soon, and how close does
it get to the best static split in hindsight?

The trainer is the torch pipelining tutorial's (``examples/train_tutorial.py``: embedding, 8
``TransformerDecoderLayer`` blocks, norm and head) on 2 CPU ranks (gloo, one thread each),
``Schedule1F1B``, 4 micro-batches, split 4,4. Each scenario is one launch in which several
copies of the trainer train side by side in the same 2 processes, each with its own gloo
group, from the same initial weights on the same batches: the copy with the one line
(``vpipe.attach(schedule, optimizer=opt, log_file=...)``, split 4,4) and plain copies at
4,4 (the same split) and at the other candidate splits. Every round each copy runs one step,
the order rotating, after a barrier; a step's time is the longest of the two ranks'. So the
machine's drift falls on all copies alike, and every ratio is a median of per-step ratios.

Scenarios (a change at a step applies to every copy at once):

- **uneven 1.5x / 2x**: rank 1 is a slower device for the whole run
  (:class:`vpipe_lab.runtime.slowdown.SlowDevice`: it waits, so the other rank keeps its core);
- **straggler**: rank 1 becomes 2x slower at one step and recovers at a later one;
- **freezing**: at a step the embedding and the first 3 blocks stop training
  (``requires_grad_(False)``): stage 0's backward shrinks, so blocks should move to stage 0;
- **seq length**: the sequence grows 32 -> 64 -> 128; torch infers p2p shapes once, so at each
  change every copy redoes shape inference (plain: ``vpipe.stage.pipeline.reset_shape_inference``,
  attached: ``vp.engine.reset_shapes()``);
- **nas**: as ``benchmarks/nas_rebalance.py``'s edit, blocks are added to stage 0 mid-run (4 at
  model position 1: ``vp.add_layers`` with a ``layer_factory`` in the attached copy, the same
  blocks inserted by hand into the plain copies' ``model.layers`` and optimizers); here in one
  launch beside plain copies started at 4,4 / 3,5 / 2,6, which the edit turns into 8,4 / 7,5 /
  6,6 (so the grown model's best split has a plain copy; ``nas_rebalance.py`` instead compares
  separate launches).

Reported per scenario and phase: the vpipe copy's step over the plain copy's at the same split
and over the best static split of that phase (the plain split with the smallest median step);
steps to react (change -> the step at which vpipe's first plan after it took effect, from the run
log's ``plan_applied``); the moves (blocks, the step boundary's stall from ``vp.boundary_s``,
bytes per block from ``migration_done``); whether the losses of the vpipe copy and the plain copy
at its split are bitwise equal (before a move they must be; after one, equal to rounding).
Targets (PASS/FAIL): uneven 2x within 1.05x of the best static split; the straggler within 1.05x
of its best split from 15 steps after the slowdown, and back on the even split 15 steps after it
recovers; freezing within 1.05x of the best static split from 15 steps after the freeze.

Run: ``python benchmarks/dynamic_bench.py [--json OUT] [--quick] [--scenarios a,b] [--log-dir DIR]``
(about 13 minutes on 2 cores; ``--quick`` about 4).
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
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
REACT = 15  # steps after a change from which the targets are judged
SLOW_RANK = 1
TARGET = 1.05
DISTURBED_CORES = 0.25  # other processes' CPU use during a launch beyond which its ratios are flagged
MODEL = {"dim": 96, "micro_batch_size": 4, "seq_len": 64, "micro_batches": 4}
QUICK_MODEL = {"dim": 64, "micro_batch_size": 2, "seq_len": 32, "micro_batches": 4}
SLOWER, LIGHTER = [[4, 4], [5, 3], [6, 2], [7, 1]], [[3, 5], [4, 4], [5, 3]]
ADDED, GROWN = 4, [[4, 4], [3, 5], [2, 6]]  # 4 blocks added at position 1: 8,4 / 7,5 / 6,6 after the edit


def scenarios(quick: bool) -> dict[str, dict[str, Any]]:
    """Each scenario: steps, candidate splits, the changes per step, its phases [start, end) and targets."""
    uneven, settle = (40, 20) if quick else (100, 40)
    slow_at, recover_at, straggler_end = (20, 50, 80) if quick else (40, 120, 180)
    freeze_at, freeze_end = (20, 55) if quick else (40, 120)
    s1, s2, seq_end = (15, 30, 45) if quick else (40, 80, 120)
    out: dict[str, dict[str, Any]] = {}
    for factor in (1.5, 2.0):
        out[f"uneven-{factor:g}x"] = {"steps": uneven, "splits": SLOWER, "factor": {"0": factor},
                                      "changes": [0],
                                      "phases": [["settling", 2, settle], ["after", settle, uneven]],
                                      "targets": [["after", "best"]] if factor == 2.0 else []}
    c, b, end = slow_at, recover_at, straggler_end
    out["straggler"] = {"steps": end, "splits": SLOWER, "factor": {str(c): 2.0, str(b): 1.0},
                        "changes": [c, b],
                        "phases": [["before", 2, c], ["slow: reacting", c, c + REACT], ["slow", c + REACT, b],
                                   ["recovering", b, b + REACT], ["recovered", b + REACT, end]],
                        "targets": [["slow", "best"], ["recovered", "even"]]}
    f, fe = freeze_at, freeze_end
    out["freezing"] = {"steps": fe, "splits": SLOWER[:3], "freeze": {"step": f, "blocks": 3}, "changes": [f],
                       "phases": [["before", 2, f], ["reacting", f, f + REACT], ["after", f + REACT, fe]],
                       "targets": [["after", "best"]]}
    out["seq-length"] = {"steps": seq_end, "splits": LIGHTER, "seq": {"0": 32, str(s1): 64, str(s2): 128},
                         "changes": [s1, s2], "phases": [["seq 32", 2, s1], ["seq 64", s1 + 3, s2],
                                                         ["seq 128", s2 + 3, seq_end]], "targets": []}
    a, ae = (15, 50) if quick else (30, 100)
    out["nas"] = {"steps": ae, "splits": GROWN, "add": {"step": a, "position": 1, "blocks": ADDED},
                  "changes": [a],
                  "phases": [["before", 2, a], ["reacting", a, a + REACT], ["after", a + REACT, ae]],
                  "targets": []}
    return out


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("train_tutorial", ROOT / "examples" / "train_tutorial.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------- one rank of a launch
def rank_main(spec_file: str) -> int:
    """Build every copy on this rank, attach vpipe to one, and step
    them in rotating order through the changes."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import vpipe
    from vpipe.stage.pipeline import reset_shape_inference
    from vpipe_lab.runtime.slowdown import SlowDevice, of_class

    spec = json.loads(Path(spec_file).read_text())
    model_spec, example = spec["model"], _example()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args = example.ModelArgs(dim=model_spec["dim"], n_layers=8)

    def build(split: list[int], group: Any) -> tuple[Any, Any, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = example.split_model(example.Transformer(args), rank, split)
        stage = PipelineStage(model, rank, world, torch.device("cpu"), group=group)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, Schedule1F1B(stage, model_spec["micro_batches"],
                                   loss_fn=example.tokenwise_loss_fn), optimizer

    def make_block(layer_id: int, _spec: Any = None) -> nn.Module:
        """A new block (NAS): the same weights in every copy, whoever builds it (seeded by its id)."""
        with torch.random.fork_rng():
            torch.manual_seed(1000 + layer_id)
            return nn.TransformerDecoderLayer(args.dim, args.n_heads, dim_feedforward=4 * args.dim,
                                              dropout=0.0)

    copies = {"vpipe": build([4, 4], None)}
    for split in spec["splits"]:
        copies[",".join(map(str, split))] = build(split, dist.new_group(backend="gloo"))
    options = {**spec["options"], **({"layer_factory": make_block} if spec.get("add") else {})}
    vp = vpipe.attach(copies["vpipe"][1], optimizer=copies["vpipe"][2], log_file=spec["log"], **options)
    # the slower device: every module of its stage (blocks, norm, head), the outermost of a nest waiting once
    slow = SlowDevice(1.0, modules=of_class(nn.TransformerDecoderLayer, nn.LayerNorm, nn.Linear,
                                            nn.Embedding)) \
        if rank == SLOW_RANK else None
    names = list(copies)
    step_s: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[list[float]]] = {name: [] for name in names}
    placement, seq_len = [], model_spec["seq_len"]
    for step in range(spec["steps"]):
        if slow is not None and str(step) in spec.get("factor", {}):
            slow.set_factor(spec["factor"][str(step)])
        if spec.get("freeze") and step == spec["freeze"]["step"]:
            for model, _, _ in copies.values():
                for module in [model.tok_embeddings] + [b for k, b in model.layers.items()
                                                        if int(k) < spec["freeze"]["blocks"]]:
                    if module is not None:
                        module.requires_grad_(False)
        if spec.get("add") and step == spec["add"]["step"]:  # a NAS edit: blocks inserted into stage 0
            new_ids = vp.add_layers(spec["add"]["position"], [{"kind": "block"}] * spec["add"]["blocks"])
            for name in names[1:] if rank == 0 else []:
                model, _, optimizer = copies[name]
                items = list(model.layers.items())
                at = spec["add"]["position"]
                added = [(str(lid), make_block(lid)) for lid in new_ids]
                model.layers = nn.ModuleDict(dict(items[:at] + added + items[at:]))  # as vpipe inserts them
                optimizer.param_groups[0]["params"].extend(p for _, b in added for p in b.parameters())
        if str(step) in spec.get("seq", {}):
            seq_len = spec["seq"][str(step)]
            if step > 0:  # every rank at the same step: torch sized its p2p buffers for the old length
                vp.engine.reset_shapes()
                for name in names[1:]:
                    reset_shape_inference(copies[name][1])
        x, y = example.batch(step, model_spec["micro_batches"] * model_spec["micro_batch_size"], seq_len,
                             args.vocab_size)
        for name in names[step % len(names):] + names[:step % len(names)]:
            _, schedule, optimizer = copies[name]
            out: list[torch.Tensor] = []
            dist.barrier()
            started = time.perf_counter()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=out)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_s[name].append(time.perf_counter() - started)
            if out:
                losses[name].append([float(loss.detach()) for loss in out])
        placement.append([len(s) for s in vp.placement])
    times = torch.tensor([step_s[name] for name in names] + [vp.boundary_s[:spec["steps"]]],
                         dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts until its last rank is done
    vp.detach()
    if slow is not None:
        slow.remove()
    if rank == world - 1:
        rows = times.tolist()
        Path(spec["out"]).write_text(json.dumps({"step_s": dict(zip(names, rows)), "boundary_s": rows[-1],
                                                 "losses": losses, "placement": placement}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------- the parent: launches and analysis
def launch(name: str, scenario: dict[str, Any], model: dict[str, Any], options: dict[str, Any],
           log_dir: Path) -> dict[str, Any]:
    """One launch of a scenario's copies; its per-step results and its run log's records."""
    from vpipe.log import read_log
    from vpipe_lab.runtime.launch import spawn
    from vpipe_lab.runtime.measure import CpuWindow, RunnableSampler

    log, out, spec_file = (log_dir / f"{name}.{suffix}" for suffix in ("log", "out.json", "spec.json"))
    for path in (log, out):
        path.unlink(missing_ok=True)  # logs append: a rerun must not mix with an old one
    spec_file.write_text(json.dumps({**scenario, "model": model, "options": options, "log": str(log),
                                     "out": str(out)}))
    # a shared machine's other work makes a 2-core comparison meaningless: say so
    window = CpuWindow().start()
    sampler = RunnableSampler(os.getpid()).start() if RunnableSampler.available() else None
    try:
        code = spawn([sys.executable, __file__, "--rank-main", str(spec_file)], 2,
                     extra_env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout_s=1200)
    finally:
        outside = sampler.stop() if sampler else None
    external = window.stop()
    if code != 0 or not out.exists():
        raise RuntimeError(f"dynamic: scenario {name}: the ranks failed (exit code {code})")
    return {**json.loads(out.read_text()), "log": read_log(log) if log.exists() else [],
            "load": {"external_cores": external, "outside_threads": outside}}


def _median_ratio(a: list[float], b: list[float], start: int, end: int) -> float:
    return statistics.median(a[i] / b[i] for i in range(start, min(end, len(a))))


def moves(records: list[dict[str, Any]], boundary_s: list[float]) -> list[dict[str, Any]]:
    """Each plan that took effect: its step, the blocks moved, the
    boundary's stall and the bytes per block."""
    applied: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("event") == "plan_applied":
            applied.setdefault(r["epoch"], {"epoch": r["epoch"], "step": r["step"], "layers": {}})
            applied[r["epoch"]]["layers"][r["stage"]] = len(r.get("layers", []))
    done = [r for r in records if r.get("event") == "migration_done"]
    out = []
    for epoch, move in sorted(applied.items()):
        mine = [r for r in done if r.get("epoch") == epoch]
        blocks = sum(len(ids) for r in mine if r.get("bytes_sent") for ids in r.get("moved", []))
        sent = sum(r.get("bytes_sent") or 0 for r in mine)
        step = move["step"]
        out.append({**move, "blocks": blocks, "bytes_per_block": sent / blocks if blocks else None,
                    "move_s": max((r.get("seconds") or 0.0 for r in mine), default=0.0),
                    "stall_ms": 1e3 * boundary_s[step] if step < len(boundary_s) else None,
                    "split": [move["layers"][s] for s in sorted(move["layers"])]})
    return out


def compare_losses(a: list[list[float]], b: list[list[float]]) -> dict[str, Any]:
    """Bitwise equal throughout, or the first step that differs and the largest difference."""
    diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return {"bitwise_equal": not diffs and len(a) == len(b), "first_differing_step": diffs[0] if diffs
            else None,
            "max_abs_diff": max((abs(p - q) for x, y in zip(a, b) for p, q in zip(x, y)), default=0.0)}


def split_at(scenario: dict[str, Any], name: str, step: int) -> str:
    """A plain copy's split at ``step`` (a NAS edit grows its stage
    0); copies are named by their first split."""
    first, second = (int(c) for c in name.split(","))
    add = scenario.get("add")
    return f"{first + add['blocks']},{second}" if add and step >= add["step"] else name


def analyse(name: str, scenario: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Per phase the ratios to the same split and to the best static one; reaction, moves, losses, targets."""
    times, splits = run["step_s"], [",".join(map(str, s)) for s in scenario["splits"]]
    vp, same = times["vpipe"], times["4,4"]
    phases = []
    for label, start, end in scenario["phases"]:
        medians = {s: statistics.median(times[s][start:end]) for s in splits}
        best_copy = min(medians, key=medians.__getitem__)
        best = split_at(scenario, best_copy, start)
        phases.append({"phase": label, "steps": [start, end],
                       "vpipe_ms": 1e3 * statistics.median(vp[start:end]),
                       "plain_ms": {split_at(scenario, s, start): 1e3 * m for s, m in medians.items()},
                       "best_split": best, "vs_same": _median_ratio(vp, same, start, end),
                       "vs_best": _median_ratio(vp, times[best_copy], start, end),
                       "placement_at_end": run["placement"][min(end, len(run["placement"])) - 1]})
    applied = moves(run["log"], run["boundary_s"])
    reactions = []
    for i, change in enumerate(scenario["changes"]):
        nxt = scenario["changes"][i + 1] if i + 1 < len(scenario["changes"]) else scenario["steps"]
        first = next((m["step"] for m in applied if change <= m["step"] < nxt and m["blocks"]), None)
        reactions.append({"change_step": change, "first_move_step": first,
                          "steps": None if first is None else first - change})
    targets = []
    for phase_name, kind in scenario["targets"]:
        phase = next(p for p in phases if p["phase"] == phase_name)
        if kind == "best":
            ok = phase["vs_best"] <= TARGET
            what = (f"{phase_name}: vpipe / best static ({phase['best_split']}) = "
                    f"{phase['vs_best']:.2f}x <= {TARGET}")
        else:
            start, end = phase["steps"]
            held = run["placement"][start:end]
            ok = all(p == [4, 4] for p in held)
            what = f"{phase_name}: on 4,4 from step {start} to {end} (placements then: " \
                   f"{sorted({','.join(map(str, p)) for p in held})})"
        targets.append({"target": what, "pass": ok})
    losses = {"vpipe_vs_plain_4,4": compare_losses(run["losses"]["vpipe"], run["losses"]["4,4"]),
              "plain_splits_vs_4,4": {s: compare_losses(run["losses"][s], run["losses"]["4,4"])
                                                      for s in splits if s != "4,4"}}
    events = Counter(r["event"] for r in run["log"] if r.get("event"))
    return {"scenario": name, "phases": phases, "reactions": reactions, "moves": applied, "losses": losses,
            "targets": targets, "final_placement": run["placement"][-1],
            "events": dict(sorted(events.items())),
            "load": run["load"], "disturbed": run["load"]["external_cores"] > DISTURBED_CORES,
            "per_step": {"step_s": run["step_s"], "placement": run["placement"],
                         "boundary_s": run["boundary_s"]}}


def report(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = (Table(title="dynamic workloads, 2 CPU ranks, 1F1B: vpipe (from 4,4) vs plain "
                         "copies in the same launch"))
    for col in ("scenario", "phase", "vpipe ms", "vs same split", "vs best static", "best", "vpipe split",
                "react (steps)", "moves (stall ms, MB/block)", "losses vs same split"):
        table.add_column(col, justify="left" if col in ("scenario", "phase") else "right")
    for res in results:
        react = ", ".join(f"{r['change_step']}->{r['first_move_step']}" if r["first_move_step"] is not None
                          else f"{r['change_step']}->none" for r in res["reactions"])
        mv = ("; ".join(f"{m['blocks']}@{m['step']} ({m['stall_ms'] or 0:.0f}, "
                        f"{(m['bytes_per_block'] or 0) / 1e6:.2f})"
                       for m in res["moves"] if m["blocks"]) or "none")
        loss = next(iter(res["losses"].values()))
        loss_text = "bitwise" if loss["bitwise_equal"] else \
            f"from step {loss['first_differing_step']}: max {loss['max_abs_diff']:.1e}"
        for i, ph in enumerate(res["phases"]):
            first = i == 0
            table.add_row(res["scenario"] if first else "", ph["phase"], f"{ph['vpipe_ms']:.0f}",
                          f"{ph['vs_same']:.2f}x", f"{ph['vs_best']:.2f}x", ph["best_split"],
                          ",".join(map(str, ph["placement_at_end"] or [])), react if first else "",
                          mv if first else "", loss_text if first else "")
    console = Console(width=200)
    console.print(table)
    for res in results:
        load = res["load"]
        threads = ("" if load["outside_threads"] is None
                   else f", {load['outside_threads']:.1f} runnable threads")
        console.print(f"{res['scenario']}: other processes used {load['external_cores']:.2f} cores{threads}"
                      + ("  DISTURBED: the machine was busy, these ratios measure contention"
                         if res["disturbed"]
                         else ""))
    for res in results:
        for t in res["targets"]:
            console.print(f"{'PASS' if t['pass'] else 'FAIL'}  {res['scenario']}: {t['target']}"
                          + ("  (disturbed run)" if res["disturbed"] else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer steps, a smaller model")
    p.add_argument("--scenarios", default=None,
                   help="comma-separated (default: all): uneven-1.5x, uneven-2x, "
                   "straggler, freezing, seq-length, nas")
    p.add_argument("--vpipe-options", default="{}",
                   help="JSON of vpipe.attach options (default: the one line's)")
    p.add_argument("--log-dir", default=None, help="keep the run logs here (default: a temporary folder)")
    p.add_argument("--rank-main", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        return rank_main(args.rank_main)
    table = scenarios(args.quick)
    names = args.scenarios.split(",") if args.scenarios else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(table)}")
    model, options = (QUICK_MODEL if args.quick else MODEL), json.loads(args.vpipe_options)
    results, started = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vpipe-dynamic-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for name in names:
            t0 = time.perf_counter()
            print(f"dynamic: {name} ...", flush=True)
            scenario = table[name]
            results.append(analyse(name, scenario, launch(name, scenario, model, options, log_dir)))
            print(f"dynamic: {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "dynamic", "quick": args.quick, "model": model,
                                               "vpipe_options": options, "scenarios": results,
                                               "wall_s": time.perf_counter() - started}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
