"""Rank program for tests/integration/test_tensor_parallel.py: tensor-parallel blocks in a pipeline on a mesh.

The model is examples/train_3d.py's (Llama-style blocks, torchtitan's tensor-parallel plan on
every block). Scenarios (``argv[1]``), launched by ``vpipe_lab.runtime.launch.spawn``:

- ``pp_tp-1f1b``, ``tp_pp-gpipe``, ...: 2 stages x 2 tp ranks on a mesh of that dimension order, the 6,2
  split, side by side: a plain copy and a copy with the one line ``vpipe.attach(schedule, optimizer=opt)``,
  trained until the planner moved blocks and 3 steps more. Rank 0 writes every rank's losses, placements and
  whole (gathered) parameters;
- ``interleaved``: Interleaved 1F1B over 3,3,1,1 (stages p and p + 2 on pipeline rank p) on a pp x tp mesh,
  planning off, a forced move of layer 2 from stage 0 (rank 0) to stage 1 (rank 1) before step 2;
- ``policies``: 1F1B on pp x tp with blocks 0 and 1 swapped, 2 and 6 recomputed (planning off): saved
  DTensors and local shards go through the tensor manager; losses equal the plain copy's;
- ``fault``: a forced move on pp x tp with ``VPIPE_FAULTS=migration_die@3``: world rank 3 (stage 1, tp 1) dies
  as the layer reaches it. Ranks start as the laboratory's do, so a dead rank ends every other naming it;
- ``pp_dp_tp``: 8 ranks, FSDP2 over dp on top of tensor parallelism over tp in each block, planning off, a
  forced move of layer 5 before step 2; 4 steps.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mesh_worker import everyone, run_with_watchdog  # this directory is the script's: on the path
from shape_worker import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

STEPS, MICRO = int(os.environ.get("TP_STEPS", 40)), 4
_spec = importlib.util.spec_from_file_location("train_3d",
                                               Path(__file__).parents[2] / "examples" / "train_3d.py")
example = importlib.util.module_from_spec(_spec)
sys.modules["train_3d"] = example  # (its dataclass looks its module up)
_spec.loader.exec_module(example)  # type: ignore[union-attr]


def build(mesh: Any, counts: list[int], schedule: str) -> tuple[list[nn.Module], Any, Any]:
    """The example's stage modules (parallelised over the mesh), schedule and optimizer for this rank."""
    pp = mesh["pp"].size()
    pp_rank = mesh["pp"].get_local_rank()
    interleaved = schedule == "interleaved"
    indices = [pp_rank, pp_rank + pp] if interleaved else [pp_rank]
    models = []
    for index in indices:
        torch.manual_seed(0)
        model = example.split_model(example.Transformer(example.ModelArgs(n_layers=sum(counts))), index,
                                    counts)
        example.parallelize(model, mesh)
        models.append(model)
    from torch.distributed.pipelining import PipelineStage

    stages = [PipelineStage(m, v, len(counts), torch.device("cpu"), group=mesh.get_group("pp"))
              for m, v in zip(models, indices)]
    optimizer = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=1e-3)
    kind = example.SCHEDULES[schedule]
    sched = kind(stages if interleaved else stages[0], MICRO, loss_fn=example.tokenwise_loss_fn)
    return models, sched, optimizer


def train_step(mesh: Any, schedule: Any, optimizer: Any, step: int) -> list[float]:
    """The example's step on this rank, with its batch for this step (and dp replica)."""
    replica = mesh["dp"].get_local_rank() if "dp" in (mesh.mesh_dim_names or ()) else 0
    x, y = example.batch(step, replica, 2 * MICRO, 32, 256)
    return example.train_step(schedule, optimizer, mesh["pp"].get_local_rank(), mesh["pp"].size(), x, y)


def side_by_side(names: tuple[str, ...], schedule: str, counts: list[int], *, planning: bool = True,
                 forced: Any = None, policies: dict[int, str] | None = None, steps: int = STEPS,
                 **options: Any) -> dict:
    """A plain copy and a copy with vpipe, each on a mesh of its own, trained step by step."""
    import vpipe

    sizes = {"pp": len(counts) // (2 if schedule == "interleaved" else 1), "tp": 2, "dp": 2}
    shape = tuple(sizes[n] for n in names)
    assert math.prod(shape) == dist.get_world_size()
    meshes = {name: init_device_mesh("cpu", shape, mesh_dim_names=names) for name in ("plain", "vpipe")}
    copies = {name: (mesh, *build(mesh, counts, schedule)) for name, mesh in meshes.items()}
    _, _, sched, opt = copies["vpipe"]
    vp = vpipe.attach(sched, optimizer=opt, planning=planning, policies=policies or {}, **options)
    if forced is not None:
        vp.request_plan(forced, at_step=2)
    losses: dict[str, list[float]] = {name: [] for name in copies}
    placements: list = []
    step = 0
    while step < steps or (planning and step < 2 * steps and _steps_since_a_move(placements) < 3):
        for name, (mesh, _, s, o) in copies.items():
            losses[name] += train_step(mesh, s, o, step)
        placements.append([list(p) for p in vp.placement])
        step += 1
    managed = [tm.stats() for tm in vp.tensor_managers.values()]
    vp.detach()
    states = {name: {k: v.tolist() for k, v in example.full_state(models).items()}
              for name, (_, models, _, _) in copies.items()}
    coords = {n: meshes["vpipe"][n].get_local_rank() for n in names}
    swapped = {"d2h_bytes": sum(s.d2h_bytes for s in managed), "h2d_bytes": sum(s.h2d_bytes for s in managed),
               "dtensors": sum(s.dtensors_swapped for s in managed),
               "recomputes": {lid: layer.recomputes for s in managed for lid, layer in s.layers.items()}}
    return everyone({"rank": dist.get_rank(), "coords": coords, "losses": losses, "placements": placements,
                     "states": states, "swapped": swapped})


def _steps_since_a_move(placements: list) -> int:
    moved = next((i for i, p in enumerate(placements) if p != placements[0]), None)
    return 0 if moved is None else len(placements) - moved


def moves(order: str, schedule: str) -> dict:
    return side_by_side(tuple(order.split("_")), schedule, [6, 2])


def interleaved() -> dict:
    import vpipe

    forced = vpipe.Plan(epoch=1, stages=((0, 1), (2, 3, 4, 5), (6,), (7,)))
    return side_by_side(("pp", "tp"), "interleaved", [3, 3, 1, 1], planning=False, forced=forced, steps=6)


def policies() -> dict:
    chosen = {0: "S", 1: "S", 2: "R", 6: "R"}
    return side_by_side(("pp", "tp"), "1f1b", [6, 2], planning=False, policies=chosen, steps=6,
                        min_swap_bytes=0)  # the tiny model's tensors are all small


def pp_dp_tp() -> dict:
    import vpipe

    forced = vpipe.Plan(epoch=1, stages=((0, 1, 2, 3, 4), (5, 6, 7)))
    return side_by_side(("pp", "dp", "tp"), "1f1b", [6, 2], planning=False, forced=forced, steps=4)


def fault() -> dict:
    import vpipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    _, schedule, optimizer = build(mesh, [6, 2], "1f1b")
    vp = vpipe.attach(schedule, optimizer=optimizer, planning=False)
    vp.request_plan(vpipe.Plan(epoch=1, stages=((0, 1, 2, 3, 4), (5, 6, 7))), at_step=2)
    for step in range(4):
        train_step(mesh, schedule, optimizer, step)
    vp.detach()
    return {"placement": [list(s) for s in vp.placement]}


if __name__ == "__main__":
    if sys.argv[1] == "fault":
        run_with_watchdog(fault)
        sys.exit(0)
    scenario = sys.argv[1]
    if "-" in scenario:
        order, schedule = scenario.split("-")
        run_ranks(lambda: moves(order, schedule), sys.argv[2])
    else:
        run_ranks({"interleaved": interleaved, "policies": policies, "pp_dp_tp": pp_dp_tp}[scenario],
                  sys.argv[2])
