"""Rank program for tests/integration/test_engines.py: an engine vpipe
does not ship, registered by the trainer.

The trainer's engine is :class:`LoopTrainer`: the hand-written GPipe loop of
examples/train_handwritten.py behind a ``train_batch(x, y)`` method (all forwards, all
backwards, the optimizer's step), the way a small in-house engine would wrap it. Its
adapter, :class:`LoopEngine`, is one class and one ``register_engine`` line. In one launch
a plain trainer and one under vpipe (``argv[1]``: ``recompute``, every layer recomputed with
planning off; ``planned``, the planner rebalancing the 6,2 partition) train on the same
batches; the last rank writes both loss lists and the layers it ended with to ``argv[2]``.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import vpipe  # noqa: E402
from train_1f1b import batch, make_layer  # noqa: E402
from train_handwritten import train_step  # noqa: E402
from vpipe.engines import Engine, register_engine  # noqa: E402
from vpipe.stage.pipeline import LocalStage, Pipeline  # noqa: E402

STEPS, LAYERS, MICRO_BATCHES, PARTITION = 40, 8, 4, (6, 2)  # the planner daemon starts in ~10 steps


class LoopTrainer:
    """A trainer's own engine: one stage module per rank, stepped by ``train_batch``."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: int) -> None:
        self.module, self.optimizer, self.micro_batches = module, optimizer, micro_batches

    def train_batch(self, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        rank, world = dist.get_rank(), dist.get_world_size()
        losses = train_step(self.module, rank, world, x, y, self.micro_batches)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses


@register_engine
class LoopEngine(Engine):
    """The adapter: how vpipe recognises a LoopTrainer and what it answers differently from the defaults."""

    step_method = "train_batch"
    counts_forwards = True  # the loop calls the stage module once per micro-batch

    @classmethod
    def accepts(cls, target: Any) -> bool:
        return isinstance(target, LoopTrainer)

    @classmethod
    def read(cls, target: Any) -> Engine:
        world = dist.get_world_size()
        stages = [LocalStage(dist.get_rank(), target.module)]
        return cls(Pipeline(target, stages, world, tuple(range(world)), "gpipe", torch.device("cpu"),
                            step_micro_batches=target.micro_batches))

    def default_optimizer(self) -> torch.optim.Optimizer | None:
        optimizer: torch.optim.Optimizer = self.pipeline.schedule.optimizer
        return optimizer


def _trainer() -> LoopTrainer:
    rank = dist.get_rank()
    first = sum(PARTITION[:rank])
    torch.manual_seed(0)
    module = nn.Sequential(OrderedDict((str(i), make_layer(i))
                                       for i in range(first, first + PARTITION[rank])))
    return LoopTrainer(module, torch.optim.Adam(module.parameters(), lr=1e-3), MICRO_BATCHES)


def _train(trainer: LoopTrainer) -> list[list[float]]:
    losses = []
    for step in range(STEPS):
        x, y = batch(step, 4 * MICRO_BATCHES)
        got = trainer.train_batch(x, y)
        if got:
            losses.append(got)
    return losses


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    plain = _train(_trainer())
    trainer = _trainer()
    planned = scenario == "planned"
    vp = vpipe.attach(trainer, layer_factory=make_layer, planning=planned, micro_batches=MICRO_BATCHES,
                      policies=None if planned else dict.fromkeys(range(LAYERS), "R"), sample_every=2,
                      planner_options={"warmup_samples": 1, "cooldown_steps": 4},
                      log_file=str(out.with_suffix(".log")))
    kind, caps = vp.engine.kind, vp.move_refusal
    losses = _train(trainer)
    layers = [int(n) for n in trainer.module._modules]
    vp.detach()
    if dist.get_rank() == dist.get_world_size() - 1:
        out.write_text(json.dumps({"plain": plain, "vpipe": losses, "layers": layers, "kind": kind.value,
                                   "move_refusal": caps}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
