"""Rank program for tests/integration/test_wpipe.py: ``vpipe.ScheduleWPipe`` on real gloo ranks.

In one launch (``argv[1]``: where each rank writes ``OUT.rankR.pt``) it trains the model of
:mod:`support.wpipe` (two stages a rank, G0's and G1's) seven times: SGD with a flush before
period ``FLUSH_AFTER``, Adam, and Adam again with ``vpipe.attach`` under it five times:
planning off with every block recomputed, swapped, or kept (then the stages run without
their managers after a few steps, G0's period in flight counted) until a plan has every block
recomputed from step ``RECOMPUTE_AT``, every block kept under a rank budget of ``BUDGET``
bytes, and planning on (the
planner daemon started, every block kept). Each run writes the rank's
parameters after the final flush, the weight versions each group held at the end of every
step and at its peak, the last rank's losses, and under vpipe the engine it ran under, why
its layers cannot move (and the moves_off lines attach logged), each layer's recomputes and
policy, and the bytes swapped out.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

import vpipe
from support.twobw import feed_step, make_optimizer
from support.wpipe import (
    BUDGET,
    FLUSH_AFTER,
    MICRO_BATCHES,
    PERIODS,
    RECOMPUTE_AT,
    layers,
    stage_layers,
    stage_module,
)
from vpipe.log import decision_log


class Decisions(logging.Handler):
    """The decisions vpipe logs on this rank: (event, message)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((getattr(record, "vpipe_fields", {}).get("event", ""), record.getMessage()))


def train(optimizer_name: str, *, flush_after: int | None = None, attach: bool = False, policy: str = "R",
          planning: bool = False, recompute_at: int | None = None,
          budget: int | None = None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    modules = [stage_module(rank), stage_module(world + rank)]
    stages = [PipelineStage(m, v, 2 * world, torch.device("cpu"))
              for m, v in zip(modules, (rank, world + rank))]
    optimizer = make_optimizer(optimizer_name, [p for m in modules for p in m.parameters()])
    schedule = vpipe.ScheduleWPipe(stages, MICRO_BATCHES, F.mse_loss, optimizer)
    vp, decisions = None, Decisions()
    if attach:
        decision_log.addHandler(decisions)
        decision_log.setLevel(logging.INFO)
        vp = vpipe.attach(schedule, optimizer=optimizer, planning=planning, memory_budget=budget,
                          policies=dict.fromkeys(range(layers(world)), policy))
        for manager in vp.tensor_managers.values():
            # the test's activations are a few hundred bytes: swap them all the same
            manager.min_swap_bytes = 0
        if recompute_at is not None:  # a plan that changes policies only: every block recomputed from then on
            stages = tuple(tuple(stage_layers(v)) for v in range(2 * world))
            recompute = dict.fromkeys(range(layers(world)), vpipe.Policy.RECOMPUTE)
            vp.request_plan(vpipe.Plan(epoch=1, stages=stages, policies=recompute), at_step=recompute_at)
    # per step: versions each group holds at its end, last rank's losses, and
    held, losses, plain = [], [], []
    # under vpipe whether each stage ran without its manager (the quiet
    # path: every layer kept, nothing measured)
    for step in range(PERIODS):
        if step == flush_after:
            schedule.flush()
        got = feed_step(schedule, step)
        held.append(schedule.versions_held)
        if vp is not None:
            plain.append([vp.stage_handles[v].plain for v in sorted(vp.stage_handles)])
        losses.append(got)
    schedule.flush()
    state = [(k, v.detach().clone()) for m in modules for k, v in m.state_dict().items()]
    result: dict[str, Any] = {"state": state, "held": held, "peak_versions": schedule.peak_versions,
                              "peak_stashed": schedule.peak_stashed, "losses": losses,
                              "updates": schedule.updates}
    if vp is not None:
        stats = [tm.stats() for tm in vp.tensor_managers.values()]
        recomputes = {lid: layer.recomputes for st in stats for lid, layer in st.layers.items()}
        result.update(kind=vp.engine.kind.value, move_refusal=vp.move_refusal, recomputes=recomputes,
                      stages=sorted(vp.tensor_managers), swapped_bytes=sum(st.d2h_bytes for st in stats),
                      policies=vp.memory_report()["policies"],
                      plain=plain, moves_off=[message for event, message in decisions.seen
                                              if event == "moves_off"])
        decision_log.removeHandler(decisions)
        vp.detach()
    return result


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    runs = {"sgd": train("sgd", flush_after=FLUSH_AFTER), "adam": train("adam")}
    if len(sys.argv) < 3 or sys.argv[2] != "plain":
        runs["attached"] = train("adam", attach=True)
        runs["swapped"] = train("adam", attach=True, policy="S")
        runs["planned"] = train("adam", attach=True, policy="D", planning=True)
        runs["kept"] = train("adam", attach=True, policy="D", recompute_at=RECOMPUTE_AT)
        runs["budget"] = train("adam", attach=True, policy="D", budget=BUDGET)
    torch.save(runs, f"{sys.argv[1]}.rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
