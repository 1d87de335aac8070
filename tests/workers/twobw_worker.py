"""Rank program for tests/integration/test_pipedream_2bw.py:
``vpipe.SchedulePipeDream2BW`` on real gloo ranks.

In one launch (``argv[1]``: where each rank writes ``OUT.rankR.pt``) it trains the model of
:mod:`support.twobw` four times: SGD with a flush before period ``FLUSH_AFTER``, Adam, Adam again with
``vpipe.attach`` under it (planning off, every block recomputed), and Adam under vpipe from the 3,1 split with
two streamed moves (to 2,2 at step 2, back to 3,1 at step 5, the last: a block leaves stage 0, then the last
stage; under 2BW a move holds the stream for two steps, and the ranks start a move's round a step before it
takes effect). Each run writes the stage's parameters after the final flush, the weight versions the stage
held at the end of every step and at its peak, the last stage's losses, and under vpipe the engine it ran
under and why its layers cannot move (None: they can).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

import vpipe
from support.twobw import FLUSH_AFTER, LAYERS, MICRO_BATCHES, PERIODS, batch, make_optimizer, stage_module


def train(optimizer_name: str, *, flush_after: int | None = None, attach: bool = False,
          moves: bool = False) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    module = stage_module(rank, world, (3, 1) if moves else None)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    optimizer = make_optimizer(optimizer_name, module.parameters())
    schedule = vpipe.SchedulePipeDream2BW(stage, MICRO_BATCHES, F.mse_loss, optimizer)
    vp = None
    if attach:
        vp = vpipe.attach(schedule, optimizer=optimizer, planning=False,
                          policies=None if moves else dict.fromkeys(range(LAYERS), "R"))
    if vp is not None and moves:
        vp.request_plan(vpipe.Plan(epoch=1, stages=((0, 1), (2, 3))), at_step=2)
        vp.request_plan(vpipe.Plan(epoch=2, stages=((0, 1, 2), (3,))), at_step=5)
    held, losses, layers = [], [], []  # per step: versions held at its end, last stage's losses, blocks here
    for step in range(PERIODS):
        if step == flush_after:
            schedule.flush()
        x, y = batch(step)
        got: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=got)
        held.append(schedule.versions_held)
        layers.append([int(name) for name, _ in module.named_children()])
        losses.append([float(loss) for loss in got])
    schedule.flush()
    # pairs, not a dict: a later run's attach takes a dict of clones keyed by parameter names for a weight
    # average kept beside the stage (vpipe.stage.beside) and pins its blocks
    result: dict[str, Any] = {"state": [(k, v.detach().clone()) for k, v in module.state_dict().items()],
                              "held": held, "peak_versions": schedule.peak_versions,
                              "peak_stashed": schedule.peak_stashed, "losses": losses,
                              "layers": layers}
    if vp is not None:
        result.update(kind=vp.engine.kind.value, move_refusal=vp.move_refusal)
        vp.detach()
    return result


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    runs = {"sgd": train("sgd", flush_after=FLUSH_AFTER), "adam": train("adam"),
            "attached": train("adam", attach=True),
            "moved": train("adam", attach=True, moves=True)}
    torch.save(runs, f"{sys.argv[1]}.rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
