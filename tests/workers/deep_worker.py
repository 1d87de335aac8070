"""Rank program for tests/integration/test_deep_stages.py: a stage of many blocks, trained on a small C stack.

``python deep_worker.py BLOCKS STACK_KIB OUT.json``: one rank, ``BLOCKS`` ``Linear(8, 8)`` blocks
under GPipe with vpipe attached (its tensor manager's saved-tensor hooks, and the monitor's
backward hooks on every step after the first), trained for three steps on a thread whose C
stack is ``STACK_KIB`` KiB. How deep vpipe makes torch free a step's graph is then a crash
(SIGSEGV) or not at a size a test can afford: freeing a graph whose nodes have Python objects
takes C stack frames per node, and vpipe used to give several nodes of every block one. The
graphs of the first two steps are freed on that thread, by the next step; the last step's,
which the schedule keeps after vpipe detached, on the main thread when the program ends.
"""

from __future__ import annotations

import json
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import vpipe


def train(blocks: int, result: dict) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(8, 8) for _ in range(blocks)])
    stage = PipelineStage(module, 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, 2, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    vp = vpipe.attach(schedule, optimizer=optimizer, sample_every=1)
    x = torch.randn(4, 4, 8)
    for _ in range(3):
        schedule.step(x, target=x)
        optimizer.step()
        optimizer.zero_grad()
    result["steps"] = vp.iteration
    vp.detach()
    result["schedule"] = schedule  # its last step's graph goes when the program ends


def main(blocks: int, stack_kib: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result: dict = {}
    threading.stack_size(stack_kib * 1024)
    worker = threading.Thread(target=train, args=(blocks, result))
    worker.start()
    worker.join()
    with open(out, "w") as f:
        json.dump({"steps": result["steps"]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
