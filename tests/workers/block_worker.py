"""Rank program for tests/integration/test_block_moves.py: everyday blocks moved whole, against the same
trainer without vpipe.

Each scenario (``argv[1]``) builds a torchtitan-shaped model (``layers`` a ModuleDict keyed by
global id, an input projection on the first stage, a head on the last), split 6,2 over two
ranks, twice side by side: a plain copy on a gloo group of its own and a copy with the one
line ``vpipe.attach(schedule, optimizer=opt)``. vpipe's copy is told to move blocks (6,2 ->
4,4 -> 5,3), both train the same batches, and rank 0 writes both copies' losses and the
whole model's parameters and buffers (the ranks' state dicts merged by global key), with
vpipe's log records, to ``argv[2]``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

DIM, LAYERS, COUNTS = 16, 8, [6, 2]
PLANS = {3: [[0, 1, 2, 3], [4, 5, 6, 7]], 6: [[0, 1, 2, 3, 4], [5, 6, 7]]}  # step -> placement asked for
STEPS = int(__import__("os").environ.get("BW_STEPS", 9))


class NormBlock(nn.Module):
    """A residual block with BatchNorm (float running stats, an int64
    ``num_batches_tracked``) and buffers of the kinds users keep: an int64 step counter the
    forward bumps, a bool feature mask, a float64 running scale."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.fc = nn.Linear(DIM, DIM)
        # a 0-d parameter: an odd run of 4-byte values before the int64s
        self.gain = nn.Parameter(torch.ones(()))
        self.bn = nn.BatchNorm1d(DIM)
        self.register_buffer("seen", torch.tensor([True, False, layer_id % 2 == 0]))  # 3 bytes
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mask", torch.arange(DIM) % (layer_id + 2) != 0)
        self.register_buffer("scale", torch.ones(DIM, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.calls += 1
                self.scale.mul_(0.99).add_(h.detach().double().abs().mean(0), alpha=0.01)
        out = self.bn(self.fc(h) * self.gain) * self.mask
        return h + torch.relu(out) * self.scale.to(h.dtype)


class Net(nn.Module):
    """The torchtitan / pipelining tutorial shape: a ModuleDict of blocks keyed by
    global id, None where a module belongs to another stage."""

    def __init__(self, make_block: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.inp: nn.Module | None = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleDict({str(i): make_block(i) for i in range(LAYERS)})
        self.out: nn.Module | None = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) if self.inp is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.out(h) if self.out is not None else h


def split(model: Net, rank: int) -> Net:
    first = sum(COUNTS[:rank])
    for name in [n for n in model.layers if not first <= int(n) < first + COUNTS[rank]]:
        del model.layers[name]
    if rank != 0:
        model.inp = None
    if rank != len(COUNTS) - 1:
        model.out = None
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, DIM, generator=gen), torch.randn(8, DIM, generator=gen)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


def build(group: Any, make_block: Callable[[int], nn.Module], optimizer: str,
          prepare: Callable[[Net], None] = lambda model: None):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = split(Net(make_block), rank)
    prepare(model)
    stage = PipelineStage(model, rank, world, torch.device("cpu"), group=group)
    keep_buffers_through_shape_inference(stage)
    return model, Schedule1F1B(stage, 4, loss_fn=F.mse_loss), OPTIMIZERS[optimizer](model.parameters())


def keep_buffers_through_shape_inference(stage: PipelineStage) -> None:
    """torch's first ``step()`` infers shapes by running a stage's forward on
    uninitialised tensors (on every stage but the first), which puts garbage into
    BatchNorm statistics, different garbage in each copy. Both copies restore their
    buffers after it, so that the comparison sees only what training and vpipe do."""
    inner = stage._prepare_forward_infra

    def prepare(*args: Any, **kwargs: Any) -> Any:
        saved = [(b, b.clone()) for b in stage.submod.buffers()]
        try:
            return inner(*args, **kwargs)
        finally:
            for b, value in saved:  # through .data: the pass's backward still holds the buffers it saved
                if not torch.equal(b, value):
                    b.data.copy_(value)

    stage._prepare_forward_infra = prepare


def train_step(schedule: Any, optimizer: torch.optim.Optimizer, step: int) -> list[float]:
    return pipeline_step(schedule, optimizer, *batch(step))


def pipeline_step(schedule: Any, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                  y: torch.Tensor) -> list[float]:
    """One step of the torch pipelining tutorial's loop on a 2-rank pipeline; the last stage's losses."""
    losses: list[torch.Tensor] = []
    if dist.get_rank() == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return [float(loss.detach()) for loss in losses]


_LAST_VPIPE_MODEL: list[Net] = []  # vpipe's copy of the last side_by_side run (what detach left)


def side_by_side(make_block: Callable[[int], nn.Module], optimizer: str, *, plans: dict | None = None,
                 prepare: Callable[[Net], None] = lambda model: None, **options: Any) -> dict:
    """Train the plain copy and vpipe's copy on the same batches; vpipe's is asked to move blocks."""
    import vpipe
    from vpipe.plan import Plan

    copies = {"plain": build(dist.new_group(backend="gloo"), make_block, optimizer, prepare),
              "vpipe": build(None, make_block, optimizer, prepare)}
    model, schedule, opt = copies["vpipe"]
    _LAST_VPIPE_MODEL[:] = [model]
    vp = vpipe.attach(schedule, optimizer=opt, planning=False, **options)
    for epoch, (step, stages) in enumerate(sorted((PLANS if plans is None else plans).items()), start=1):
        vp.request_plan(Plan(epoch=epoch, stages=stages), at_step=step)
    losses: dict[str, list[float]] = {name: [] for name in copies}
    for step in range(STEPS):
        for name, (_, sched, o) in copies.items():
            losses[name] += train_step(sched, o, step)
    placement = [list(s) for s in vp.placement]
    recomputes = sum(layer.recomputes for tm in vp.tensor_managers.values() for layer in tm._layers.values())
    vp.detach()
    states = {name: {k: v.tolist() for k, v in model.state_dict().items()}
              for name, (model, _, _) in copies.items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, states)
    merged = {name: {k: v for rank_states in gathered for k, v in rank_states[name].items()}
              for name in copies}
    return {"losses": losses if dist.get_rank() == 1 else None, "states": merged, "placement": placement,
            "recomputes": recomputes}


def buffers_adam() -> dict:
    return side_by_side(NormBlock, "adam")


def buffers_sgd() -> dict:
    return side_by_side(NormBlock, "sgd")


class CountingHook:
    """A stateful forward hook: counts its block's calls and lets the count shift the output."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return output + 1e-3 * self.calls


def hooked() -> dict:
    """A stateful hook on block 4, a stateless one on block 5: the plans that move them are refused."""

    def prepare(model: Net) -> None:
        if "4" in model.layers:
            model.layers["4"].register_forward_hook(CountingHook())
            model.layers["5"].register_forward_hook(lambda module, args, output: output * 0.5)

    return side_by_side(NormBlock, "adam", prepare=prepare)


class SharingBlock(NormBlock):
    """A NormBlock with a projection that some blocks share (weight sharing across layers)."""

    def __init__(self, layer_id: int) -> None:
        super().__init__(layer_id)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(self.proj(h))


def shared() -> dict:
    """Blocks 1 and 2 share their projection: blocks 4 and 5 move
    (6,2 -> 4,4), block 2 is refused (-> 2,6)."""

    def prepare(model: Net) -> None:
        if "1" in model.layers:
            model.layers["2"].proj = model.layers["1"].proj

    return side_by_side(SharingBlock, "adam", prepare=prepare,
                        plans={3: [[0, 1, 2, 3], [4, 5, 6, 7]], 6: [[0, 1], [2, 3, 4, 5, 6, 7]]})


class MLPBlock(nn.Module):
    """A residual MLP block with a plain attribute (its layer id), as torchtitan's blocks have."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.fc = nn.Linear(DIM, 2 * DIM)
        self.proj = nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(torch.tanh(self.fc(h)))


def compiled() -> dict:
    """torchtitan's way: each block replaced by ``torch.compile(block)``
    (an OptimizedModule in the ModuleDict)."""

    def prepare(model: Net) -> None:
        for key in list(model.layers):
            model.layers[key] = torch.compile(model.layers[key])

    return side_by_side(MLPBlock, "adam", prepare=prepare)


def compiled_in_place() -> dict:
    """Each block compiled in place, ``block.compile(fullgraph=True)``."""

    def prepare(model: Net) -> None:
        for block in model.layers.values():
            block.compile(fullgraph=True)

    result = side_by_side(MLPBlock, "adam", prepare=prepare)
    # after detach every block is compiled as block.compile() leaves it, the blocks that arrived too
    result["compiled_calls"] = [b._compiled_call_impl is not None and "forward" not in b.__dict__
                                for b in _LAST_VPIPE_MODEL[0].layers.values()]
    return result


def recompute_norm() -> dict:
    """Every block recomputed (no moves): its replays must leave BatchNorm statistics and counters alone."""
    return side_by_side(NormBlock, "adam", plans={}, policies={i: "R" for i in range(LAYERS)},
                        min_swap_bytes=0)


SCENARIOS: dict[str, Callable[[], dict]] = {"buffers_adam": buffers_adam, "buffers_sgd": buffers_sgd,
                                            "recompute_norm": recompute_norm, "hooked": hooked,
                                            "shared": shared,
                                            "compiled": compiled, "compiled_in_place": compiled_in_place}


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = SCENARIOS[scenario]()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        losses = next(r["losses"] for r in gathered if r["losses"] is not None)
        Path(out).write_text(json.dumps(dict(gathered[0], losses=losses)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
