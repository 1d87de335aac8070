"""Rank program for tests/integration/test_wpipe_moves.py: blocks moved under ``vpipe.ScheduleWPipe``.

In one launch (``argv[1]``: where each rank writes ``OUT.rankR.pt``) it trains the model of
:mod:`support.wpipe` (two stages a rank, G0's and G1's, two layers each) with Adam three
times: the schedule alone; under ``vpipe.attach`` with two forced plans (at step
``MOVE_AT`` a block of G0's stage 1 to stage 0 and one of G1's stage 2 to stage 3, at step
``BACK_AT``, the last, both back), after a plan that crosses the boundary between the groups
was refused; and under vpipe with the planner running. Each run writes the rank's parameters
after the final flush, the last rank's losses, the layers each local stage held after every
step, and under vpipe the refusal and the copies the engine names as its own.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

import vpipe
from support.twobw import feed_step, make_optimizer
from support.wpipe import MICRO_BATCHES, PERIODS, layers, stage_module

MOVE_AT, BACK_AT = 2, 5
MOVED = ((0, 1, 2), (3,), (4,), (5, 6, 7))  # G0: layer 2 to stage 0; G1: layer 5 to stage 3
HOME = ((0, 1), (2, 3), (4, 5), (6, 7))
CROSSING = ((0, 1), (2, 3, 4), (5,), (6, 7))  # layer 4 from G1 to G0


def train(*, attach: bool = False, moves: bool = False, planning: bool = False) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    modules = [stage_module(rank), stage_module(world + rank)]
    stages = [PipelineStage(m, v, 2 * world, torch.device("cpu"))
              for m, v in zip(modules, (rank, world + rank))]
    optimizer = make_optimizer("adam", [p for m in modules for p in m.parameters()])
    schedule = vpipe.ScheduleWPipe(stages, MICRO_BATCHES, F.mse_loss, optimizer)
    vp, result = None, {}
    if attach:
        vp = vpipe.attach(schedule, optimizer=optimizer, planning=planning,
                          policies=dict.fromkeys(range(layers(world)), "D"))
        result.update(move_refusal=vp.move_refusal)
    if vp is not None and moves:
        try:
            vp.request_plan(vpipe.Plan(epoch=1, stages=CROSSING), at_step=MOVE_AT)
        except ValueError as e:
            result["crossing"] = str(e)
        vp.request_plan(vpipe.Plan(epoch=2, stages=MOVED), at_step=MOVE_AT)
        vp.request_plan(vpipe.Plan(epoch=3, stages=HOME), at_step=BACK_AT)
    losses, held, copies = [], [], []
    for step in range(PERIODS):
        got = feed_step(schedule, step)
        held.append([[int(name) for name, _ in m.named_children()] for m in modules])
        losses.append(got)
        if vp is not None:
            copies.append(sorted(name for copy in vp.engine.own_copies() for name in copy))
    schedule.flush()
    state = [(k, v.detach().clone()) for m in modules for k, v in m.state_dict().items()]
    result.update(state=state, losses=losses, layers=held, copies=copies,
                  peak_versions=schedule.peak_versions)
    if vp is not None:
        vp.detach()
    return result


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    runs = {"plain": train(), "moved": train(attach=True, moves=True),
            "planned": train(attach=True, planning=True)}
    torch.save(runs, f"{sys.argv[1]}.rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
