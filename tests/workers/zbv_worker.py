"""Rank program for tests/integration/test_zbv_moves.py: a Hugging Face-shaped trainer under ZBV, moved by
vpipe, against the same trainer without vpipe.

Two ranks run ``ScheduleZBVZeroBubble`` over four stages in its V (rank 0 holds stages 0 and 3, rank 1
stages 1 and 2). Each stage module has Hugging Face's shape: token embeddings on the first stage, ``self.h`` a
ModuleList of blocks called in a loop, ``ln_f`` and the LM head on the last. The head's output is 3-d, so
``nn.Linear`` returns it as a view, which torch's last stage cannot detach in place: its ``output_chunks``
(and the output ``step()`` returns) keep the stage's autograd graph alive after the step, and with it the
saved tensors of the nodes only the input-gradient pass ran (``retain_graph=True``; the weight pass never
runs them again).

The plain copy runs on a gloo group of its own, vpipe's copy with ``vpipe.attach`` (layers swapped and
recomputed per scenario, blocks moved out of the last stage by forced plans at step boundaries); both train
the same batches. Rank 0 (the last stage's) writes both copies' losses, every rank what its tensor managers
still held at each step boundary, to ``argv[2]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

DIM, HIDDEN, VOCAB, SEQ, LAYERS, MICRO_BATCHES, STEPS = 16, 32, 32, 4, 8, 4, 8
COUNTS = [2, 2, 2, 2]  # blocks per stage at the start: stage v holds blocks 2v and 2v + 1


class Block(nn.Module):
    """A pre-norm residual MLP block: tanh's saved output is unpacked by the input-gradient pass only."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, HIDDEN)
        self.proj = nn.Linear(HIDDEN, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(torch.tanh(self.fc(self.norm(h))))


class HFStage(nn.Module):
    """Hugging Face's shape: ``wte`` on the first stage, ``self.h``
    a ModuleList, ``ln_f`` and ``head`` on the last."""

    def __init__(self, blocks: list[nn.Module], first: bool, last: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM) if first else None
        self.h = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(DIM) if last else None
        self.head = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) if self.wte is not None else x
        for block in self.h:
            h = block(h)
        if self.ln_f is not None and self.head is not None:
            h = self.head(self.ln_f(h))  # (batch, seq, vocab): a view of the addmm's output
        return h


def stage_module(stage: int) -> HFStage:
    """Stage ``stage`` of the whole model, built the same way on every rank and in both copies."""
    torch.manual_seed(0)
    blocks = [Block() for _ in range(LAYERS)]
    first, last = nn.Embedding(VOCAB, DIM), (nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB))
    start = sum(COUNTS[:stage])
    module = HFStage(blocks[start:start + COUNTS[stage]], stage == 0, stage == len(COUNTS) - 1)
    if module.wte is not None:
        module.wte.load_state_dict(first.state_dict())
    if module.ln_f is not None and module.head is not None:
        module.ln_f.load_state_dict(last[0].state_dict())
        module.head.load_state_dict(last[1].state_dict())
    return module


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def build(group: Any) -> tuple[list[int], Any, torch.optim.Optimizer]:
    rank = dist.get_rank()
    stages = [rank, len(COUNTS) - 1 - rank]  # the V
    modules = [stage_module(v) for v in stages]
    pipe = [PipelineStage(m, v, len(COUNTS), torch.device("cpu"), group=group)
            for v, m in zip(stages, modules)]
    schedule = ScheduleZBVZeroBubble(pipe, MICRO_BATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.Adam([p for m in modules for p in m.parameters()], lr=1e-2)
    return stages, schedule, optimizer


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    rows = 2 * MICRO_BATCHES
    return torch.randint(VOCAB, (rows, SEQ), generator=gen), torch.randint(VOCAB, (rows, SEQ), generator=gen)


def train_step(stages: list[int], schedule: Any, optimizer: torch.optim.Optimizer, step: int) -> list[float]:
    x, y = batch(step)
    losses: list[torch.Tensor] = []
    inputs = (x,) if 0 in stages else ()
    if len(COUNTS) - 1 in stages:
        schedule.step(*inputs, target=y, losses=losses)
    else:
        schedule.step(*inputs)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return [float(loss.detach()) for loss in losses]


# scenario -> (initial policies, {step: blocks per stage}); every plan takes blocks out of the last stage (3)
SCENARIOS: dict[str, tuple[dict[int, str], dict[int, list[int]]]] = {
    # a swapped block leaves the last stage, recomputed ones come back and leave again
    "swap_recompute": ({1: "R", 3: "S", 5: "R", 6: "S", 7: "R"},
                       {2: [2, 2, 3, 1], 4: [2, 2, 1, 3], 6: [2, 2, 3, 1]}),
    # every block kept: the first step is measured through the hooks (the monitor's first sample)
    "keep": ({}, {1: [2, 2, 3, 1], 3: [2, 2, 2, 2]}),
}


def side_by_side(scenario: str) -> dict:
    import vpipe
    from vpipe.plan import Plan, Policy

    policies, plans = SCENARIOS[scenario]
    copies = {"plain": build(dist.new_group(backend="gloo")), "vpipe": build(None)}
    stages, schedule, optimizer = copies["vpipe"]
    vp = vpipe.attach(schedule, optimizer=optimizer, planning=False, min_swap_bytes=0, policies=policies)
    order = vp.plan_in_force.order
    for epoch, (step, counts) in enumerate(sorted(plans.items()), start=1):
        vp.request_plan(Plan(epoch=epoch, stages=Plan.from_counts(order, counts).stages,
                             policies={lid: Policy.parse(p) for lid, p in policies.items()}), at_step=step)
    losses: dict[str, list[float]] = {name: [] for name in copies}
    left: list[dict[str, int]] = []  # what each tensor manager still holds after each step
    for step in range(STEPS):
        for name, (st, sched, opt) in copies.items():
            losses[name] += train_step(st, sched, opt, step)
        for v, tm in sorted(vp.tensor_managers.items()):
            s = tm.stats()
            left.append({"step": step, "stage": v, "live": s.live_saved_storages,
                         "host_pool": s.host_pool_used_bytes, "resident": s.resident_bytes})
    result = {"losses": losses if 0 in stages else None, "placement": [list(s) for s in vp.placement],
              "left": left}
    vp.detach()
    return result


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = side_by_side(scenario)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        losses = next(r["losses"] for r in gathered if r["losses"] is not None)
        Path(out).write_text(json.dumps({"losses": losses, "placement": gathered[0]["placement"],
                                         "left": [row for r in gathered for row in r["left"]]}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
