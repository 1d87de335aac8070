"""One rank of a 2-rank GPipe pipeline with vpipe attached whose trainer raises, uncaught, on the last stage.

``python crash_worker.py OUT`` trains until step 3, where the last stage raises a ``RuntimeError``
of the trainer's own (no ``run_rank``: the exception ends the interpreter as a plain script's
would, and vpipe's exit handler detaches). The first stage is then blocked in the step's receive
until the last stage's process is gone. Each rank writes ``OUT.rank{r}.json``: when it raised (the
last stage) and when vpipe's exit handler had finished (an exit handler registered before attach
runs after it).
"""

from __future__ import annotations

import atexit
import json
import sys
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import vpipe


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    times: dict[str, float] = {}

    def record() -> None:  # registered first, so it runs after vpipe's own exit handler
        times["vpipe_gone"] = time.monotonic()
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(times, f)

    atexit.register(record)
    torch.manual_seed(0)
    layers = range(2 * rank, 2 * rank + 2)
    module = nn.Sequential(OrderedDict((str(i), nn.Sequential(nn.Linear(16, 16), nn.GELU())) for i in layers))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    schedule = ScheduleGPipe(stage, 2, loss_fn=F.mse_loss)
    vpipe.attach(schedule, optimizer=optimizer, planning=False)
    x = torch.randn(4, 16)
    for step in range(5):
        if step == 3 and rank == world - 1:
            times["raised"] = time.monotonic()
            raise RuntimeError(f"rank {rank}: the trainer's own bug")
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=x)
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main(sys.argv[1])
