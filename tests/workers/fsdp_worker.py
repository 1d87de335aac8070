"""Rank program for tests/integration/test_mesh_fsdp.py: FSDP2 pipelines on a 2x2 mesh, torchtitan's way.

Scenarios (``argv[1]``), 4 ranks each, launched by ``vpipe_lab.runtime.launch.spawn``:

- ``fsdp_1f1b``: the torch pipelining tutorial's model split 6,2 over 2 stages on a ``("dp",
  "pp")`` mesh, ``fully_shard`` on every block and on the stage module over the dp dimension
  (``reshard_after_forward=False``, as torchtitan shards pipeline stages), under 1F1B. Twice side
  by side: a plain copy on a mesh of its own and a copy with the one line
  ``vpipe.attach(schedule, optimizer=opt)``. Rank 0 writes every rank's losses, placements and
  full parameters (gathered with ``full_tensor``, by global key) to ``argv[2]``;
- ``fsdp_interleaved``: the same on a ``("pp", "dp")`` mesh under Interleaved 1F1B, the model
  split 3,3,1,1 into 4 stages, stages p and p + 2 on pipeline rank p, one optimizer per model
  part in a container (torchtitan's); a forced plan moves layer 2 to stage 1 and layer 5 to stage
  2 before step 3 (across ranks both ways), and each rank says whether every part's optimizer
  holds exactly its stage module's parameters at the end.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

# this directory is the script's: on the path
from mesh_worker import coordinates, everyone, train_side_by_side
from shape_worker import run_ranks, tut
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

STEPS, MICRO = int(os.environ.get("FSDP_STEPS", 40)), 4


class Optimizers:
    """torchtitan's one-optimizer-per-model-part container: ``step`` and ``zero_grad`` over all of them."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def shard(model: nn.Module, dp_mesh: Any) -> nn.Module:
    """torchtitan's ``apply_fsdp`` for a pipeline stage: every block, then the stage module, no reshard after
    forward (a pipeline runs several micro-batches' forwards before their backwards)."""
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    return model


def build(mesh: Any, stage_index: int, interleaved: bool) -> tuple[list[nn.Module], Any, Any]:
    torch.manual_seed(0)
    counts = [3, 3, 1, 1] if interleaved else [6, 2]
    indices = [stage_index, stage_index + 2] if interleaved else [stage_index]
    models = [shard(tut.split_model(tut.Transformer(tut.ModelArgs()), v, counts), mesh["dp"])
              for v in indices]
    stages = [PipelineStage(m, v, len(counts), torch.device("cpu"), group=mesh.get_group("pp"))
              for m, v in zip(models, indices)]
    if interleaved:
        optimizer: Any = Optimizers([torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models])
        schedule: Any = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=tut.tokenwise_loss_fn)
    else:
        optimizer = torch.optim.AdamW(models[0].parameters(), lr=1e-3)
        schedule = Schedule1F1B(stages[0], MICRO, loss_fn=tut.tokenwise_loss_fn)
    return models, schedule, optimizer


def full_state(models: list[nn.Module]) -> dict[str, list]:
    """Every parameter and buffer in full (``full_tensor`` is collective over dp: both dp ranks hold the same
    blocks in the same order, so they call it alike)."""
    out = {}
    for m in models:
        for k, v in m.state_dict().items():
            out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).tolist()
    return out


def side_by_side(order: tuple[str, str], interleaved: bool = False) -> dict:
    import vpipe

    coords = coordinates(order)
    meshes = {name: init_device_mesh("cpu", (2, 2), mesh_dim_names=order) for name in ("plain", "vpipe")}
    assert meshes["plain"].get_group("pp") is not meshes["vpipe"].get_group("pp")
    copies = {name: build(mesh, coords["pp"], interleaved) for name, mesh in meshes.items()}
    _, schedule, opt = copies["vpipe"]
    vp = vpipe.attach(schedule, optimizer=opt)
    if interleaved:
        vp.request_plan(vpipe.Plan(epoch=1, stages=((0, 1), (2, 3, 4), (5, 6), (7,))), at_step=3)
    # the tutorial's loop, one batch per replica; FSDP reduce-scatters the gradients inside the schedule
    losses, placements = train_side_by_side({name: (*copy, None) for name, copy in copies.items()}, vp,
                                            coords, STEPS,
                                            until_moved=not interleaved)
    states = {name: full_state(models) for name, (models, _, _) in copies.items()}
    return everyone(
        {
            "rank": dist.get_rank(),
            "coords": coords,
            "losses": losses,
            "placements": placements,
            "states": states,
            "parts_hold_their_stages": not interleaved
            or all(
                {id(p) for g in part.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
                for part, model in zip(opt.optimizers, copies["vpipe"][0])
            ),
        }
    )


def fsdp_1f1b() -> dict:
    return side_by_side(("dp", "pp"))


def fsdp_interleaved() -> dict:
    return side_by_side(("pp", "dp"), interleaved=True)


if __name__ == "__main__":
    run_ranks({"fsdp_1f1b": fsdp_1f1b, "fsdp_interleaved": fsdp_interleaved}[sys.argv[1]], sys.argv[2])
