"""Rank program for tests/integration/test_uneven_devices.py: a rank made slower, and vpipe's planner left to
find it, against the same trainer without vpipe.

The blocks of ``block_worker``'s torchtitan-shaped model, split 4,4, each waiting 2 ms in its forward (the
device's compute; waiting, not work, so that the two ranks on two cores do not slow each other). In scenario
``slow`` every block that runs on rank 1 takes twice as long
(:class:`vpipe_lab.runtime.slowdown.SlowDevice`, in both copies: values are untouched); in ``even`` the
devices are alike; ``slow_200`` and ``even_200`` train 200 steps (a steady state: nothing changes after the
start). vpipe's copy attaches with the one line (its planner on) and both copies train the same batches;
rank 0 writes the losses, the whole model's state and the final placement.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import block_worker as bw
import torch
import torch.distributed as dist
from torch import nn

from vpipe_lab.runtime.slowdown import SlowDevice, of_class

STEPS = 30


class WaitBlock(nn.Module):
    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.fc = nn.Linear(bw.DIM, bw.DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return h + torch.tanh(self.fc(h))


def run(slow: float, steps: int = STEPS) -> dict:
    import vpipe

    bw.COUNTS[:] = [4, 4]
    torch.set_num_threads(1)
    device = SlowDevice(slow if dist.get_rank() == 1 else 1.0, modules=of_class(WaitBlock))
    copies = {"plain": bw.build(dist.new_group(backend="gloo"), WaitBlock, "adam"),
              "vpipe": bw.build(None, WaitBlock, "adam")}
    model, schedule, opt = copies["vpipe"]
    vp = vpipe.attach(schedule, optimizer=opt)
    losses: dict[str, list[float]] = {name: [] for name in copies}
    for step in range(steps):
        for name, (_, sched, o) in copies.items():
            losses[name] += bw.train_step(sched, o, step)
    placement = [list(s) for s in vp.placement]
    vp.detach()
    device.remove()
    states = {name: {k: v.tolist() for k, v in m.state_dict().items()} for name, (m, _, _) in copies.items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, states)
    merged = {name: {k: v for rank_states in gathered for k, v in rank_states[name].items()}
              for name in copies}
    return {"losses": losses if dist.get_rank() == 1 else None, "states": merged, "placement": placement}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    slow, steps = {"slow": (2.0, STEPS), "even": (1.0, STEPS), "slow_200": (2.0, 200),
                   "even_200": (1.0, 200)}[scenario]
    result = run(slow, steps)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result["losses"])
    result["losses"] = next(g for g in gathered if g is not None)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
