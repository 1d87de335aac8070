"""The model, data and hand-written update rule that tests/integration/test_wpipe.py
and its rank program (tests/workers/wpipe_worker.py) share: WPipe's double-grouped
weight updates written out directly, in one process."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from support.twobw import batch, make_layer, make_optimizer

MICRO_BATCHES, PERIODS, LAYERS_PER_STAGE = 3, 6, 2
FLUSH_AFTER = 3  # the SGD run flushes before this period: G0's delay restarts there
# a rank's budget for vpipe: 5184 bytes of weights, gradients, Adam's state and G0's two versions, 1016 for
# activations, fewer than rank 0's G0 stage holds at its peak with every layer kept
BUDGET = 6200
RECOMPUTE_AT = 5  # a run under vpipe with every block kept is told to recompute them all from this step


def layers(ranks: int) -> int:
    """Layers of the model: two stages a rank (G0's and G1's), two layers a stage."""
    return 2 * ranks * LAYERS_PER_STAGE


def stage_layers(stage: int) -> range:
    return range(stage * LAYERS_PER_STAGE, (stage + 1) * LAYERS_PER_STAGE)


def stage_module(stage: int) -> nn.Sequential:
    """Stage ``stage``'s slice of the model, children named by global layer id."""
    return nn.Sequential(OrderedDict((str(i), make_layer(i)) for i in stage_layers(stage)))


def reference_wpipe(optimizer: str, ranks: int, *, periods: int = PERIODS, restart: int | None = None,
                    delays: tuple[int, int] = (1, 0)) -> dict[str, torch.Tensor]:
    """The parameters after ``periods`` periods of Wg(t+1) = Wg(t) - update(mean over
    period t's micro-batches of grad_g f(W0(t - delays[0]), W1(t - delays[1]))), a group's
    weights never older than those at the (re)start. ``delays=(1, 0)`` is WPipe (G0
    delayed, G1 not); others show the rule is observable."""
    n = layers(ranks)
    model = nn.Sequential(OrderedDict((str(i), make_layer(i)) for i in range(n)))
    params = dict(model.named_parameters())
    opt = make_optimizer(optimizer, model.parameters())  # per-parameter state: as one optimizer per rank
    history = [{k: p.detach().clone() for k, p in params.items()}]  # history[v]: the weights after v updates
    start = 0
    for t in range(periods):
        if t == restart:
            start = t
        weights = {}
        for k in params:
            group = int(int(k.split(".")[0]) >= n // 2)
            weights[k] = history[max(start, t - delays[group])][k].clone().requires_grad_()
        x, y = batch(t)
        for xm, ym in zip(x.tensor_split(MICRO_BATCHES), y.tensor_split(MICRO_BATCHES)):
            F.mse_loss(functional_call(model, weights, (xm,)), ym).backward()  # grads sum on the version
        for k, p in params.items():
            p.grad = weights[k].grad.div_(MICRO_BATCHES)
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append({k: p.detach().clone() for k, p in params.items()})
    return {k: p.detach().clone() for k, p in params.items()}
