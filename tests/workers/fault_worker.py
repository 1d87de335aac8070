"""One rank (of a 1-rank run) that attaches vpipe under conditions it cannot meet, and reports what happened.

``python fault_worker.py MODE OUT.json`` with MODE one of:

- ``pool``: every layer swaps (S) into a host pool smaller than one activation;
- ``budget``: a memory budget that holds the weights but not one layer's activations;
- ``api``: a schedule whose pipelining internals lack an attribute vpipe edits (another torch).

It records the error's type and message, whether the parameters and optimizer state are
unchanged, and whether the trainer still trains once the condition is lifted.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from vpipe_lab.runtime.launch import init_distributed, run_rank

WIDTH = 256
BATCH = 16  # two micro-batches of 8 rows: one activation is 8 KiB


def build() -> tuple[nn.Sequential, ScheduleGPipe, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = nn.Sequential(OrderedDict((str(i), nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()))
                                       for i in range(3)))
    stage = PipelineStage(module, 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, 2, loss_fn=F.mse_loss)
    return module, schedule, torch.optim.SGD(module.parameters(), lr=0.1)


def main(mode: str) -> dict:
    import vpipe
    from vpipe.tensor_manager.budget import stage_fixed_bytes

    module, schedule, optimizer = build()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    options: dict = {"planning": False, "sample_every": 1}
    if mode == "pool":
        options.update(policies={i: "S" for i in range(3)}, host_pool_bytes=4096, min_swap_bytes=0)
    elif mode == "budget":
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        options.update(memory_budget=stage_fixed_bytes(params, 0) + 1024)
    elif mode == "api":
        del schedule._stage_backward_initialized  # as if torch had renamed it
    result: dict = {"error": None}
    x = torch.randn(BATCH, WIDTH)
    vp = None
    try:
        vp = vpipe.attach(schedule, optimizer=optimizer, **options)
        schedule.step(x, target=x)
        optimizer.step()
    except Exception as e:  # noqa: BLE001 - the point is to see which error, and what it left behind
        result["error"] = f"{type(e).__name__}: {e}"
    result["params_unchanged"] = all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    result["optimizer_state_empty"] = not optimizer.state
    result["step_wrapped"] = "step" in schedule.__dict__
    if vp is not None:
        vp.detach()
    if mode != "api":  # without the impossible condition the same trainer trains
        optimizer.zero_grad()
        schedule.step(x, target=x)
        optimizer.step()
        result["trains_afterwards"] = not all(torch.equal(v, before[k])
                                              for k, v in module.state_dict().items())
    return result


if __name__ == "__main__":
    ctx = init_distributed()
    outcome = run_rank(ctx, main, sys.argv[1])
    with open(sys.argv[2], "w") as f:
        json.dump(outcome, f)
