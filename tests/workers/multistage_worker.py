"""One rank of the multi-stage trainer (examples/train_multistage.py) under a scenario; torchrun runs it.

``python -m torch.distributed.run ... tests/workers/multistage_worker.py
SCHEDULE PARTITION SCENARIO OUT STEPS``

SCHEDULE is one of examples/train_multistage.py's, or ``custom``: Interleaved 1F1B's action
lists written to a CSV file and run by torch's ``_PipelineScheduleRuntime``. Scenarios:
``plain`` (no vpipe), ``keep`` (vpipe attached, planning off, everything kept),
``swap`` / ``recompute`` (every block swapped / recomputed from the start), ``forced``
(policies and moves forced mid-run: swaps and recomputes at step 2, a move across ranks at
step 4, a move between two stages of one rank at step 6 where the schedule has such
neighbours), ``planned`` (the one line with its defaults). The last rank writes the
losses, every rank its chunks' state and what vpipe logged about them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from train_multistage import build, stages_of_rank, train_step  # noqa: E402
from train_tutorial import ModelArgs, batch  # noqa: E402


def _forced_plans(vp, counts: list[int]):
    """(step, plan) pairs: policies first, then a move across ranks, then one inside a rank."""
    from vpipe.plan import Plan, Policy

    order = vp.plan_in_force.order
    ranks = vp.layer_manager.stage_ranks
    policies = {lid: (Policy.SWAP if i % 2 else Policy.RECOMPUTE) for i, lid in enumerate(order) if i % 3}
    plans = [(2, Plan(epoch=1, stages=Plan.from_counts(order, counts).stages, policies=policies))]
    across = next(v for v in range(len(counts) - 1) if ranks[v] != ranks[v + 1] and counts[v] > 1)
    moved = list(counts)
    moved[across] -= 1
    moved[across + 1] += 1
    plans.append((4, Plan(epoch=2, stages=Plan.from_counts(order, moved).stages, policies=policies)))
    inside = next((v for v in range(len(counts) - 1) if ranks[v] == ranks[v + 1] and moved[v + 1] > 1), None)
    if inside is not None:
        again = list(moved)
        again[inside + 1] -= 1
        again[inside] += 1
        plans.append((6, Plan(epoch=3, stages=Plan.from_counts(order, again).stages, policies=policies)))
    return plans


def _from_csv(schedule, stages, path: Path):
    """A _PipelineScheduleRuntime that runs ``schedule``'s
    compute-only action lists, loaded from a CSV file."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineScheduleRuntime

    from train_tutorial import tokenwise_loss_fn

    # the compute-only actions (the runtime's own adds comms)
    PipelineScheduleMulti._dump_csv(schedule, str(path))
    runtime = _PipelineScheduleRuntime(stages, 4, loss_fn=tokenwise_loss_fn)
    runtime._load_csv(str(path))
    return runtime


def main() -> None:
    schedule_name, partition, scenario, out, steps = sys.argv[1:5] + [int(sys.argv[5])]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [int(c) for c in partition.split(",")]
    model_args = ModelArgs(dim=32, n_layers=sum(counts), n_heads=2, vocab_size=64)
    custom = schedule_name == "custom"  # Interleaved 1F1B's action lists, written to a CSV and run from it
    built = "interleaved1f1b" if custom else schedule_name
    chunks, stages, optimizer, schedule = build(built, counts, rank, world, model_args, micro_batches=4)
    if custom:
        schedule = _from_csv(schedule, stages, Path(f"{out}.schedule.rank{rank}.csv"))
    mine = stages_of_rank(built, rank, world, len(counts) // world)
    vp = None
    if scenario != "plain":
        import vpipe

        options: dict = {} if scenario == "planned" else {"planning": False, "min_swap_bytes": 0}
        if scenario in ("swap", "recompute"):
            options["policies"] = {lid: "S" if scenario == "swap" else "R" for lid in range(sum(counts))}
        vp = vpipe.attach(schedule, optimizer=optimizer, **options)
        if scenario == "forced":
            for step, plan in _forced_plans(vp, counts):
                vp.request_plan(plan, at_step=step)
    losses_per_step = []
    for step in range(steps):
        x, y = batch(step, 8, 16, model_args.vocab_size)
        losses = train_step(schedule, optimizer, x, y, first=0 in mine, last=len(counts) - 1 in mine)
        if losses:
            losses_per_step.append(losses)
    result = {"rank": rank, "stages": mine, "losses": losses_per_step,
              "layers": {str(v): list(chunk.layers.keys()) for v, chunk in zip(mine, chunks)}}
    if vp is not None:
        result["placement"] = [list(s) for s in vp.placement]
        result["policies"] = {str(v): {str(k): p.value for k, p in tm.policies().items()}
                              for v, tm in vp.tensor_managers.items()}
        result["stats"] = {str(v): {"d2h": tm.stats().d2h_bytes, "recompute_s": tm.stats().recompute_s,
                                    "live": tm.stats().live_saved_storages}
                           for v, tm in vp.tensor_managers.items()}
        vp.detach()
    torch.save({v: chunk.state_dict() for v, chunk in zip(mine, chunks)}, f"{out}.rank{rank}.pt")
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
