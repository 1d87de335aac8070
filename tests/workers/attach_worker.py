"""One rank (of a 1-rank run): attach vpipe to a schedule, train, detach, and check nothing is left behind."""

from __future__ import annotations

import json
import sys
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from vpipe_lab.runtime.launch import init_distributed, run_rank


def snapshot(schedule, stage, module, optimizer) -> dict:
    """Everything vpipe may touch, in comparable form."""
    children = {name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                       "forward" in m.__dict__) for name, m in module.named_modules()}
    return {
        "schedule_attrs": sorted(k for k in schedule.__dict__ if k in ("step",)),
        "stage_attrs": sorted(k for k in stage.__dict__ if "chunk" in k or k.startswith("_prepare")
                              or "vpipe" in k),
        "hooks": children,
        "params": [id(p) for g in optimizer.param_groups for p in g["params"]],
        "optimizer_hooks": len(getattr(optimizer, "_optimizer_step_post_hooks", {})),
    }


def main() -> dict:
    import vpipe

    torch.manual_seed(0)
    module = nn.Sequential(OrderedDict((str(i), nn.Sequential(nn.Linear(16, 16), nn.GELU()))
                                       for i in range(3)))
    stage = PipelineStage(module, 0, 1, torch.device("cpu"))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    schedule = ScheduleGPipe(stage, 2, loss_fn=F.mse_loss)
    before = snapshot(schedule, stage, module, optimizer)
    vp = vpipe.attach(schedule, optimizer=optimizer, planning=False, sample_every=1, policies={1: "R"})
    during = snapshot(schedule, stage, module, optimizer)
    x = torch.randn(4, 16)
    for _ in range(3):
        schedule.step(x, target=x)
        optimizer.step()
        optimizer.zero_grad()
    vp.detach()
    after = snapshot(schedule, stage, module, optimizer)
    schedule.step(x, target=x)  # the trainer still works without vpipe
    return {"before": before, "during": during, "after": after}


if __name__ == "__main__":
    ctx = init_distributed()
    result = run_rank(ctx, main)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
