"""The model, data and hand-written update rule that tests/integration/test_pipedream_2bw.py
and its rank program (tests/workers/twobw_worker.py) share: PipeDream-2BW's semantics
written out directly, in one process."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

WIDTH, LAYERS, MICRO_BATCHES, MICRO_BATCH_SIZE, PERIODS = 8, 4, 3, 2, 6
FLUSH_AFTER = 3  # the SGD run flushes before this period: the delay restarts there


def make_layer(layer_id: int) -> nn.Module:
    """Layer ``layer_id`` of the model; its initial weights depend on its id only."""
    torch.manual_seed(100 + layer_id)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


def stage_layers(stage: int, num_stages: int, counts: tuple[int, ...] | None = None) -> range:
    """The layer ids of ``stage``: ``counts`` layers per stage, else as many on every stage."""
    counts = counts or (LAYERS // num_stages,) * num_stages
    return range(sum(counts[:stage]), sum(counts[:stage + 1]))


def stage_module(stage: int, num_stages: int, counts: tuple[int, ...] | None = None) -> nn.Sequential:
    """A stage's slice of the model, children named by global layer
    id (state dict keys as the whole model's)."""
    return nn.Sequential(OrderedDict((str(i), make_layer(i))
                                     for i in stage_layers(stage, num_stages, counts)))


def make_optimizer(name: str, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.Adam(params, lr=1e-2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(MICRO_BATCHES * MICRO_BATCH_SIZE, WIDTH, generator=gen)
    return x, torch.randn(x.shape, generator=gen)


def reference_2bw(optimizer: str, num_stages: int, *, periods: int = PERIODS, restart: int | None = None,
                  delay: int = 1) -> dict[str, torch.Tensor]:
    """The parameters after ``periods`` updates of W(t+1) = W(t) - update(mean over period
    t's micro-batches of grad f(W(t - delay))), the weights never older than those at the
    (re)start; one optimizer per stage. ``delay=1`` is PipeDream-2BW; ``delay=0`` the
    flush schedules' rule (used to show the two differ)."""
    model = nn.Sequential(OrderedDict((str(i), make_layer(i)) for i in range(LAYERS)))
    params = dict(model.named_parameters())
    optimizers = [make_optimizer(optimizer, [p for i in stage_layers(s, num_stages)
                                             for p in model.get_submodule(str(i)).parameters()])
                  for s in range(num_stages)]
    history = [{n: p.detach().clone() for n, p in params.items()}]  # history[v]: the weights after v updates
    start = 0
    for t in range(periods):
        if t == restart:
            start = t
        weights = {n: w.clone().requires_grad_() for n, w in history[max(start, t - delay)].items()}
        x, y = batch(t)
        for xm, ym in zip(x.tensor_split(MICRO_BATCHES), y.tensor_split(MICRO_BATCHES)):
            F.mse_loss(functional_call(model, weights, (xm,)), ym).backward()  # grads sum on the version
        for n, p in params.items():
            p.grad = weights[n].grad.div_(MICRO_BATCHES)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        history.append({n: p.detach().clone() for n, p in params.items()})
    return {n: p.detach().clone() for n, p in params.items()}


def feed_step(schedule, step: int) -> list[float]:
    """Feed step ``step``'s batch to a streamed schedule as each rank does (the first the inputs, the last the
    targets); the losses the last rank got, [] elsewhere."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(step)
    got: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y, losses=got)
    else:
        schedule.step()
    return [float(loss) for loss in got]
