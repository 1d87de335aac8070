"""Rank program for tests/integration/test_stream_traces.py: a trace window under the streamed
schedules vpipe brings, ``vpipe.SchedulePipeDream2BW`` (one stage a rank) or ``vpipe.ScheduleWPipe``
(G0's and G1's stage a rank), with every block of stage 0 recomputed so that vpipe has work of its own.

    stream_trace_worker.py DIR 2bw|wpipe
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

import vpipe
from support import twobw, wpipe

STEPS, WINDOW = 5, (1, 3)  # the window: steps 1, 2 and 3


def build(schedule_name: str) -> tuple[object, torch.optim.Optimizer]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cpu = torch.device("cpu")
    if schedule_name == "2bw":
        module = twobw.stage_module(rank, world)
        optimizer = twobw.make_optimizer("adam", module.parameters())
        stage = PipelineStage(module, rank, world, cpu)
        return vpipe.SchedulePipeDream2BW(stage, twobw.MICRO_BATCHES, F.mse_loss, optimizer), optimizer
    modules = [wpipe.stage_module(rank), wpipe.stage_module(world + rank)]
    stages = [PipelineStage(m, v, 2 * world, cpu) for m, v in zip(modules, (rank, world + rank))]
    optimizer = twobw.make_optimizer("adam", [p for m in modules for p in m.parameters()])
    return vpipe.ScheduleWPipe(stages, wpipe.MICRO_BATCHES, F.mse_loss, optimizer), optimizer


def main() -> None:
    trace_dir, schedule_name = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    schedule, optimizer = build(schedule_name)
    first_stage = twobw.stage_layers(0, world) if schedule_name == "2bw" else wpipe.stage_layers(0)
    vp = vpipe.attach(schedule, optimizer=optimizer, trace_steps=WINDOW, trace_dir=trace_dir,
                      policies=dict.fromkeys(first_stage, "R"))
    for step in range(STEPS):
        twobw.feed_step(schedule, step)
    schedule.flush()
    vp.detach()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
