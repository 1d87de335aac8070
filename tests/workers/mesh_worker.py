"""Rank program for tests/integration/test_mesh.py: a pipeline that is one dimension of a 2x2 mesh.

Scenarios (``argv[1]``), 4 ranks each, launched by ``vpipe_lab.runtime.launch.spawn``:

- ``dp_pp`` / ``pp_dp``: the torch pipelining tutorial's model split 6,2 over 2 stages, 2 data-parallel
  replicas, on a mesh with the named dimension order, under GPipe; the trainer all-reduces gradients over
  its dp group after ``schedule.step()``, as people write it. Twice side by side: a plain copy on process
  groups of its own and a copy with the one line ``vpipe.attach(schedule, optimizer=opt)``. Rank 0 writes
  every rank's losses, placement and parameters (by global key) to ``argv[2]``;
- ``interleaved``: the same on a ``("pp", "dp")`` mesh under Interleaved 1F1B, the model split 3,3,1,1
  into 4 stages, stages p and p + 2 on pipeline rank p;
- ``fault``: GPipe on a ``("dp", "pp")`` mesh with the one line (planning off) and a forced move of layer 5 to
  stage 1 before step 2; run with ``VPIPE_FAULTS=migration_die@3`` the second replica's stage 1 (world rank 3)
  dies as that layer reaches it. Ranks start as the laboratory's do (``init_distributed``, its watchdog), so a
  dead rank ends every other naming it;
- ``refusals``: a DTensor parameter sharded across the pipeline's own ranks and ``replicate`` on the
  stage module, each error message; a block of ``ColwiseParallel`` alone, whose ``Shard(0)`` weights are
  not FSDP2's, is told apart as tensor-parallel and attaches (FSDP2 trains: ``fsdp_worker.py``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from shape_worker import run_ranks, tut  # this directory is the script's: on the path
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B

COUNTS, STEPS, MICRO = [6, 2], int(os.environ.get("MESH_STEPS", 40)), 4


def coordinates(order: tuple[str, str]) -> dict[str, int]:
    """This rank's (dp, pp) coordinates on a 2x2 mesh with
    dimensions in ``order`` (row-major, as DeviceMesh)."""
    rank = dist.get_rank()
    first, second = rank // 2, rank % 2
    return {order[0]: first, order[1]: second}


def manual_groups(order: tuple[str, str]) -> dict[str, Any]:
    """The mesh's pp and dp groups made by hand (collective: every
    rank makes every group, in the same order)."""
    ranks = {r: {order[0]: r // 2, order[1]: r % 2} for r in range(4)}
    mine = coordinates(order)
    groups: dict[str, Any] = {}
    for dim, other in (("pp", "dp"), ("dp", "pp")):
        for fixed in range(2):
            group = dist.new_group([r for r in range(4) if ranks[r][other] == fixed], backend="gloo")
            if mine[other] == fixed:
                groups[dim] = group
    return groups


def build(pp_group: Any, stage_index: int, interleaved: bool):
    """The trainer's stage modules, schedule and optimizer: GPipe over the 6,2 split, or Interleaved 1F1B over
    3,3,1,1 with stages p and p + 2 on pipeline rank p."""
    torch.manual_seed(0)
    counts = [3, 3, 1, 1] if interleaved else COUNTS
    indices = [stage_index, stage_index + 2] if interleaved else [stage_index]
    models = [tut.split_model(tut.Transformer(tut.ModelArgs()), v, counts) for v in indices]
    stages = [PipelineStage(m, v, len(counts), torch.device("cpu"), group=pp_group)
              for m, v in zip(models, indices)]
    optimizer = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=1e-3)
    schedule = (ScheduleInterleaved1F1B(stages, MICRO, loss_fn=tut.tokenwise_loss_fn) if interleaved
                else ScheduleGPipe(stages[0], MICRO, loss_fn=tut.tokenwise_loss_fn))
    return models, schedule, optimizer


def train_step(models: list[nn.Module], schedule: Any, optimizer: Any, dp_group: Any, coords: dict[str, int],
               step: int) -> list[float]:
    """The tutorial's loop, one batch per replica, gradients averaged over the dp group after the step (by the
    trainer; ``dp_group`` None: FSDP reduce-scatters them inside the schedule)."""
    x, y = tut.batch(2 * step + coords["dp"], 8, 32, 256)
    losses: list[torch.Tensor] = []
    if coords["pp"] == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    grads = [p.grad for m in models for p in m.parameters()
             if p.grad is not None] if dp_group is not None else []
    for grad in grads:
        dist.all_reduce(grad, group=dp_group)
        grad /= 2
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return [float(loss.detach()) for loss in losses]


def side_by_side(order: tuple[str, str], interleaved: bool = False) -> dict:
    import vpipe

    coords = coordinates(order)
    plain_groups = manual_groups(order)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=order)
    mesh_groups = {"pp": mesh.get_group("pp"), "dp": mesh.get_group("dp")}
    copies = {"plain": (*build(plain_groups["pp"], coords["pp"], interleaved), plain_groups["dp"]),
              "vpipe": (*build(mesh_groups["pp"], coords["pp"], interleaved), mesh_groups["dp"])}
    _, schedule, opt, _ = copies["vpipe"]
    vp = vpipe.attach(schedule, optimizer=opt)
    losses, placements = train_side_by_side(copies, vp, coords, STEPS, until_moved=not interleaved)
    states = {name: {k: v.tolist() for m in models for k, v in m.state_dict().items()}
              for name, (models, _, _, _) in copies.items()}
    return everyone({"rank": dist.get_rank(), "coords": coords, "losses": losses, "placements": placements,
                     "states": states})


def train_side_by_side(copies: dict[str, tuple], vp: Any, coords: dict[str, int], steps: int,
                       until_moved: bool = False) -> tuple[dict[str, list[float]], list]:
    """Train every copy ``(models, schedule, optimizer, dp group)`` step by step; each copy's losses, and
    vpipe's placement after every step. Detaches ``vp`` at the end.

    The planner's first plan lands a few steps before ``steps`` by default, later on a loaded machine: with
    ``until_moved`` the copies train on (up to twice ``steps``) until the placement has changed and trained
    for 3 steps since.
    Every rank applies a plan at the same step, so every rank stops at the same step.
    """
    losses: dict[str, list[float]] = {name: [] for name in copies}
    placements: list = []
    step = 0
    while step < steps or (until_moved and step < 2 * steps and _steps_since_a_move(placements) < 3):
        for name, (models, sched, o, dp) in copies.items():
            losses[name] += train_step(models, sched, o, dp, coords, step)
        placements.append([list(s) for s in vp.placement])
        step += 1
    vp.detach()
    return losses, placements


def _steps_since_a_move(placements: list) -> int:
    """Steps trained since the placement first changed (0 while it has not)."""
    moved = next((i for i, p in enumerate(placements) if p != placements[0]), None)
    return 0 if moved is None else len(placements) - moved


def everyone(mine: dict) -> dict:
    """Every rank's result, in rank order (collective)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {"ranks": gathered}


def dp_pp() -> dict:
    return side_by_side(("dp", "pp"))


def pp_dp() -> dict:
    return side_by_side(("pp", "dp"))


def interleaved() -> dict:
    return side_by_side(("pp", "dp"), interleaved=True)


def fault() -> dict:
    import vpipe

    coords = coordinates(("dp", "pp"))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    models, schedule, optimizer = build(mesh.get_group("pp"), coords["pp"], interleaved=False)
    vp = vpipe.attach(schedule, optimizer=optimizer, planning=False)
    vp.request_plan(vpipe.Plan(epoch=1, stages=((0, 1, 2, 3, 4), (5, 6, 7))), at_step=2)
    for step in range(4):
        train_step(models, schedule, optimizer, mesh.get_group("dp"), coords, step)
    vp.detach()
    return {"placement": [list(s) for s in vp.placement]}


def run_with_watchdog(scenario: Any) -> None:
    """Run ``scenario`` on this rank as the laboratory's ranks run:
    a failure names the rank that caused it."""
    from vpipe_lab.runtime.launch import init_distributed, run_rank

    torch.set_num_threads(1)
    run_rank(init_distributed("gloo"), scenario)


def _error(attach: Any) -> str:
    try:
        vp = attach()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    vp.detach()
    return "attached"


def refusals() -> dict:
    """A DTensor sharded across the pipeline's own ranks and replicate() on the stage
    module: refused at attach, before anything is installed. A block of ColwiseParallel
    layers alone (every weight Shard(0), like FSDP2's shards, but no FSDP2 state holds them)
    is tensor parallelism over the other dimension: it attaches."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import vpipe
    from vpipe.stage.tensor_parallel import tensor_parallel_names

    coords = coordinates(("dp", "pp"))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    found: dict[str, list[str]] = {}

    def attach(wrap: Any) -> str:
        model = tut.split_model(tut.Transformer(tut.ModelArgs(n_layers=2)), coords["pp"], [1, 1])
        wrap(model)
        stage = PipelineStage(model, coords["pp"], 2, torch.device("cpu"), group=mesh.get_group("pp"))
        schedule = ScheduleGPipe(stage, 2, loss_fn=tut.tokenwise_loss_fn)
        return _error(lambda: vpipe.attach(schedule, optimizer=torch.optim.SGD(model.parameters()),
                                           planning=False))

    def across_stages(model: nn.Module) -> None:  # a linear layer sharded over the pipeline's own two ranks
        linear = next(iter(model.layers.values())).linear1
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh["pp"], [Shard(1)]))

    # torchtitan's ColwiseParallel alone over dp: every weight Shard(0)
    def colwise_only(model: nn.Module) -> None:
        block = next(iter(model.layers.values()))
        parallelize_module(block, mesh["dp"], {"linear1": ColwiseParallel()})
        found["colwise"] = tensor_parallel_names(block)

    return {"across": attach(across_stages), "colwise": attach(colwise_only), "found": found,
            "replicate": attach(lambda m: replicate(m, process_group=mesh.get_group("dp")))}


if __name__ == "__main__":
    if sys.argv[1] == "fault":
        run_with_watchdog(fault)
        sys.exit(0)
    scenarios = {"dp_pp": dp_pp, "pp_dp": pp_dp, "interleaved": interleaved, "refusals": refusals}
    run_ranks(scenarios[sys.argv[1]], sys.argv[2])
