"""Rank program for tests/integration/test_deferred_batch_norm_pipeline.py: BatchNorm blocks on a 2-rank GPipe
pipeline with ``deferred_batch_norm=True``, against one process training the whole model on the same batches.

The model has the torchtitan shape (``layers`` a ModuleDict keyed by global id, an input projection on the
first stage, a head on the last), split 6,2. Each block has a BatchNorm1d; they differ (momentum 0.1 or None,
affine or not) so every form of the update is seen. Scenarios (``argv[1]``): ``still`` (no move), ``moves``
(blocks moved 6,2 -> 4,4 -> 5,3 by plans vpipe is given, each arrival cloned from a block of its kind) and
``factory`` (the same moves, arrivals built by a ``layer_factory`` that makes torch's BatchNorm). Rank 0 then
trains the reference in one process: the same micro-batches, each BatchNorm normalising each micro-batch on
its own (what the pipeline computes) and its running statistics updated once per step by torch's BatchNorm
run on everything it saw in the step (one pass over the whole mini-batch). It writes both models' state
dicts (the ranks' merged by global key), the placement and vpipe's log to ``argv[2]``. ``pipedream_still`` and
``pipedream_moves`` run vpipe's PipeDream schedule instead (:func:`pipedream`); ``pipedream_moves_late``
attaches after the first step, with stashed weight versions in flight.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

# this directory is on the path
from block_worker import COUNTS, DIM, LAYERS, PLANS, Net, pipeline_step, split
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

MICRO, BATCH, STEPS, LR = 4, 16, 8, 0.05


class NormBlock(nn.Module):
    """A residual block with a BatchNorm1d: momentum 0.1 or None (the cumulative average), affine or not."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM, momentum=None if layer_id % 3 == 2 else 0.1, affine=layer_id % 2 == 0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.bn(self.fc(h)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, DIM, generator=gen) * (1 + step % 3) + step, torch.randn(BATCH, DIM,
                                                                                       generator=gen)


def whole_model() -> Net:
    torch.manual_seed(0)
    return Net(NormBlock)


def pipelined(scenario: str) -> dict[str, Any]:
    import vpipe
    from vpipe.plan import Plan

    rank = dist.get_rank()
    model = split(whole_model(), rank)
    schedule = ScheduleGPipe(PipelineStage(model, rank, len(COUNTS), torch.device("cpu")), MICRO,
                             loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    options: dict[str, Any] = ({"layer_factory": lambda layer_id, spec: NormBlock(layer_id)}
                               if scenario == "factory" \
        else {})
    vp = vpipe.attach(schedule, optimizer=optimizer, planning=False, deferred_batch_norm=True, **options)
    for epoch, (step, stages) in enumerate(sorted(PLANS.items() if scenario != "still" else []), start=1):
        vp.request_plan(Plan(epoch=epoch, stages=stages), at_step=step)
    for step in range(STEPS):
        pipeline_step(schedule, optimizer, *batch(step))
    deferred = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.BatchNorm1d)})
    placement = [list(s) for s in vp.placement]
    vp.detach()
    plain_after_detach = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.BatchNorm1d)})
    return {"state": {k: v.tolist() for k, v in model.state_dict().items()}, "placement": placement,
            "classes": deferred, "classes_after_detach": plain_after_detach}


def pipedream(scenario: str) -> dict[str, Any]:
    """vpipe's PipeDream schedule: no flush, a step's forwards and backwards belong to different
    micro-batches and weights are stashed versions, so the reference is the same schedule without
    vpipe, side by side, its BatchNorms made deferred by hand and committed at each step's end (and
    torch's shape inference paused). In ``pipedream_moves`` vpipe's copy streams blocks between the
    stages mid-step (6,2 -> 4,4 -> 5,3): a moved layer then runs on another stage's weight
    versions, so only the updates are counted, not compared."""
    from collections import OrderedDict

    import vpipe
    from vpipe.compat.torch_distributed import single_stage, wrap_shape_inference
    from vpipe.plan import Plan
    from vpipe.stage.batch_norm import commit_batch_norms, defer_batch_norms, paused

    rank = dist.get_rank()
    first = sum(COUNTS[:rank])

    def build(group: Any) -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        blocks = [NormBlock(i) for i in range(LAYERS)]
        module = nn.Sequential(OrderedDict((str(i), blocks[i]) for i in range(first, first + COUNTS[rank])))
        stage = PipelineStage(module, rank, len(COUNTS), torch.device("cpu"), group=group)
        return module, vpipe.SchedulePipeDream(stage, MICRO, F.mse_loss,
                                               torch.optim.SGD(module.parameters(), lr=LR))

    copies = {"plain": build(dist.new_group(backend="gloo")), "vpipe": build(None)}
    plain_module, plain_schedule = copies["plain"]
    deferring = scenario != "pipedream_moves_plain"  # plain: torch's BatchNorm, updated per micro-batch
    if deferring:
        defer_batch_norms(plain_module)
        wrap_shape_inference(single_stage(plain_schedule), paused)
    module, schedule = copies["vpipe"]
    late = scenario == "pipedream_moves_late"  # attached after a step: stashed weight versions in flight
    x, y = batch(0)
    if late:  # the plain copy's stashed versions (a copy of the same model) would count as an average of it
        schedule.step(x) if rank == 0 else schedule.step(target=y, losses=[])
    stashed = len(schedule.stashed_versions())
    vp = vpipe.attach(schedule, optimizer=schedule.optimizer, planning=False, deferred_batch_norm=deferring)
    if late:
        plain_schedule.step(x) if rank == 0 else plain_schedule.step(target=y, losses=[])
        commit_batch_norms(plain_module)
    moving = scenario.startswith("pipedream_moves")
    for epoch, (step, stages) in enumerate(sorted(PLANS.items() if moving else []), start=1):
        vp.request_plan(Plan(epoch=epoch, stages=stages), at_step=step - late)
    for step in range(late, STEPS):
        x, y = batch(step)
        for _, sched in copies.values():
            sched.step(x) if rank == 0 else sched.step(target=y, losses=[])
        if deferring:
            commit_batch_norms(plain_module)
    for _, sched in copies.values():
        sched.flush()
    if deferring:
        commit_batch_norms(plain_module)
    deferred = sorted({type(m).__name__ for m in module.modules() if isinstance(m, nn.BatchNorm1d)})
    placement = [list(s) for s in vp.placement]
    vp.detach()
    return {"state": {f"layers.{k}": v.tolist() for k, v in module.state_dict().items()},
            "plain": {f"layers.{k}": v.tolist() for k, v in plain_module.state_dict().items()},
            "placement": placement, "stashed_at_attach": stashed, "classes": deferred,
            "classes_after_detach": sorted(
                {type(m).__name__ for m in module.modules() if isinstance(m, nn.BatchNorm1d)})}


def reference() -> dict[str, list[Any]]:
    """One process, the whole model, the same micro-batches; each BatchNorm's running
    statistics updated once a step by torch's own BatchNorm on the concatenation of
    what it saw (the pipeline's per-micro-batch outputs)."""
    model = whole_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    seen: dict[nn.Module, list[torch.Tensor]] = {}
    for bn in bns:
        bn.register_forward_pre_hook(lambda m, args: seen.setdefault(m, []).append(args[0].detach()))
    for step in range(STEPS):
        seen.clear()
        x, y = batch(step)
        for bn in bns:
            # each micro-batch normalised with its own statistics, nothing updated
            bn.track_running_stats = False
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            F.mse_loss(model(xm), ym).backward()
        for bn in bns:
            bn.track_running_stats = True
        with torch.no_grad():
            for bn in bns:  # one update per step: torch's BatchNorm over the whole mini-batch it saw
                bn(torch.cat(seen.pop(bn)))
        for p in model.parameters():  # torch's schedules scale the summed micro-batch gradients by 1 / MICRO
            p.grad.div_(MICRO)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.tolist() for k, v in model.state_dict().items()}


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = (pipedream if scenario.startswith("pipedream") else pipelined)(scenario)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        merged = {k: v for r in gathered for k, v in r["state"].items()}
        side = scenario.startswith("pipedream")  # the schedule without vpipe, side by side; else one process
        plain = {k: v for r in gathered for k, v in r["plain"].items()} if side else reference()
        Path(out).write_text(json.dumps({
            "vpipe": merged, "reference": plain, "placement": result["placement"],
            "stashed_at_attach": [r.get("stashed_at_attach") for r in gathered],
            "classes": sorted({c for r in gathered for c in r["classes"]}),
            "classes_after_detach": sorted({c for r in gathered for c in r["classes_after_detach"]})}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
