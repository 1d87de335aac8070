"""Single-process references that a pipeline run must reproduce exactly.

- Flush schedules (GPipe, 1F1B, and the multi-stage ones: Interleaved 1F1B, LoopedBFS,
  the zero-bubble schedules): the whole model, gradient accumulation over the same
  micro-batches in the order the schedule runs their backwards, gradients divided by
  their number (what torch's schedules do), one optimizer step per batch.
- PipeDream: the weight-stashing semantics written out directly: micro-batch ``i`` runs
  forward and backward on stage ``k``'s weight version ``start_version(i, k, p)``, and each
  stage applies one optimizer step per micro-batch in completion (= micro-batch) order.
- PipeDream-2BW: every micro-batch of step ``t`` runs on the weights after ``t - 1`` steps
  (the initial ones for steps 0 and 1), gradients summed over the step and divided by their
  number, one optimizer step per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.func import functional_call

from vpipe.compat.torch_internals import child_modules
from vpipe.schedules.pipedream import start_version
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.models import block_spec, build_layer, build_model
from vpipe_lab.runtime.optim import make_optimizer, make_scheduler

__all__ = ["reference_flush", "reference_pipedream", "reference_2bw", "reference_wpipe",
           "optimizer_state_by_name",
           "backward_order"]


def optimizer_state_by_name(named_params: Mapping[str, torch.Tensor],
                            optimizers: list[torch.optim.Optimizer]) -> dict[str, dict[str, torch.Tensor]]:
    """Optimizer state keyed by parameter name (comparable across partitions), tensors only."""
    by_id = {id(p): n for n, p in named_params.items()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for opt in optimizers:
        for p, state in opt.state.items():
            if id(p) in by_id:
                out[by_id[id(p)]] = {k: v.detach().clone() for k, v in state.items()
                                     if isinstance(v, torch.Tensor)}
    return out


def _micro_batches(cfg: RunConfig, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = cfg.model_spec().batch(step, cfg.batch_size, cfg.seed)
    return list(zip(x.tensor_split(cfg.micro_batches), y.tensor_split(cfg.micro_batches)))


def reference_flush(cfg: RunConfig) -> tuple[dict[str, torch.Tensor], list[float],
                                             dict[str, dict[str, torch.Tensor]]]:
    """Parameters after ``cfg.steps`` steps, the mean loss of each step, and the optimizer state by name."""
    torch.set_num_threads(1)
    spec = cfg.model_spec()
    model = build_model(spec, seed=cfg.seed)
    # one optimizer per stage, as in the pipeline (Adam's per-parameter math does not care)
    optimizers = [make_optimizer(cfg, [p for i in ids for p in model.get_submodule(str(i)).parameters()])
                  for ids in cfg.stage_layer_ids()]
    schedulers = [s for s in (make_scheduler(cfg, opt) for opt in optimizers) if s is not None]
    loss_fn = spec.loss_fn()
    step_losses = []
    next_id = len(spec.layers)
    for step in range(cfg.steps):
        next_id = _edit_layers(cfg, model, optimizers, step, next_id)
        losses = [loss_fn(model(x), y) for x, y in _micro_batches(cfg, step)]
        for i in backward_order(cfg):  # gradients accumulate in the schedule's order: rounding follows it
            losses[i].backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(cfg.micro_batches)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()
        step_losses.append(float(torch.stack([loss.detach() for loss in losses]).mean()))
    state = optimizer_state_by_name(dict(model.named_parameters()), optimizers)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, step_losses, state


def backward_order(cfg: RunConfig) -> list[int]:
    """The micro-batches in the order every stage runs their backwards: LoopedBFS runs them last first,
    every other flush schedule first first."""
    order = list(range(cfg.micro_batches))
    return order[::-1] if cfg.schedule == "loopedbfs" else order


def _edit_layers(cfg: RunConfig, model: torch.nn.Sequential, optimizers: list, step: int,
                 next_id: int) -> int:
    """Apply the layer edits of ``cfg.nas`` due before ``step``, as
    the layer manager does; returns the next id."""
    for event in cfg.nas or []:
        if event["step"] != step:
            continue
        children = child_modules(model)  # edited in place, as the layer manager edits a stage's container
        items = list(children.items())
        if "add" in event:
            add = event["add"]
            new = []
            for kind in add["types"]:
                layer = build_layer(block_spec(kind, cfg.d_model, cfg.n_heads, 4 * cfg.d_model, cfg.dropout),
                                    next_id, cfg.seed)
                new.append((str(next_id), layer))
                next_id += 1
            items[add["position"]:add["position"]] = new
            optimizers.append(make_optimizer(cfg, [p for _, layer in new for p in layer.parameters()]))
        else:
            items = [(name, m) for name, m in items if int(name) not in event["remove"]]
        children.clear()
        children.update(items)
    return next_id


def reference_pipedream(
    cfg: RunConfig,
) -> tuple[dict[str, torch.Tensor], list[float], dict[str, dict[str, torch.Tensor]]]:
    """Parameters after ``cfg.steps * cfg.micro_batches`` PipeDream updates, and per-step mean losses.

    Layers may change stage during the run (``cfg.moves``): micro-batch ``j`` runs each
    layer on the stage the partition of step ``j // micro_batches`` gives it, on that
    stage's weight version. Every parameter is updated once per micro-batch, in order.
    """
    torch.set_num_threads(1)
    spec = cfg.model_spec()
    model = build_model(spec, seed=cfg.seed)
    loss_fn = spec.loss_fn()
    p = cfg.stages
    params = dict(model.named_parameters())
    # one optimizer per parameter: PipeDream's per-stage optimizers update each parameter on its own
    optimizers = {n: make_optimizer(cfg, [t]) for n, t in params.items()}
    versions: dict[int, dict[str, torch.Tensor]] = {0: {n: t.detach().clone() for n, t in params.items()}}
    step_losses = []
    mb = 0
    for step in range(cfg.steps):
        stage_of = {lid: s for s, ids in enumerate(cfg.stage_layer_ids(step)) for lid in ids}
        losses = []
        for x, y in _micro_batches(cfg, step):
            weights = {}
            for n in params:
                v = start_version(mb, stage_of[int(n.split(".")[0])], p, cfg.vertical_sync)
                weights[n] = versions[v][n].clone().requires_grad_()
            loss = loss_fn(functional_call(model, weights, (x,)), y)
            loss.backward()
            losses.append(loss.detach())
            for n, t in params.items():
                t.grad = weights[n].grad
                optimizers[n].step()
                optimizers[n].zero_grad(set_to_none=True)
            mb += 1
            versions[mb] = {n: t.detach().clone() for n, t in params.items()}
            versions.pop(mb - p - 1, None)
        step_losses.append(float(torch.stack(losses).mean()))
    state = optimizer_state_by_name(params, list(optimizers.values()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, step_losses, state


def reference_2bw(cfg: RunConfig) -> tuple[dict[str, torch.Tensor], list[float],
                                           dict[str, dict[str, torch.Tensor]]]:
    """Parameters after ``cfg.steps`` PipeDream-2BW updates W(t+1) = W(t) - update(grad f(W(t-1))), the
    mean loss of each step, and the optimizer state by name (a constant learning rate: under a stream a
    stage's update of step ``t`` may come after the scheduler's step of ``t``)."""
    torch.set_num_threads(1)
    model = build_model(cfg.model_spec(), seed=cfg.seed)
    optimizers = [make_optimizer(cfg, [p for i in ids for p in model.get_submodule(str(i)).parameters()])
                  for ids in cfg.stage_layer_ids()]
    state, step_losses = _delayed_updates(cfg, model, optimizers, lambda name: True)
    return state, step_losses, optimizer_state_by_name(dict(model.named_parameters()), optimizers)


def reference_wpipe(cfg: RunConfig) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Parameters after ``cfg.steps`` WPipe periods, W0(t+1) = W0(t) - update(grad_0 f(W0(t-1), W1(t))) for
    G0 (the first ``W`` virtual stages' layers) and W1(t+1) = W1(t) - update(grad_1 f(W0(t-1), W1(t))) for
    G1, and the mean loss of each step (a constant learning rate, as for 2BW)."""
    torch.set_num_threads(1)
    model = build_model(cfg.model_spec(), seed=cfg.seed)
    ids, ranks = cfg.stage_layer_ids(), cfg.stages
    optimizers = [make_optimizer(cfg, [p for i in ids[r] + ids[ranks + r]
                                       for p in model.get_submodule(str(i)).parameters()])
                  for r in range(ranks)]
    g0 = tuple(f"{i}." for stage in ids[:ranks] for i in stage)
    return _delayed_updates(cfg, model, optimizers, lambda name: name.startswith(g0))


def _delayed_updates(cfg: RunConfig, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                     delayed: Callable[[str], bool]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train ``cfg.steps`` steps in one process, each step's gradient taken on the weights of one update
    earlier for the parameters ``delayed`` names and on the newest for the others (2BW: all delayed; WPipe:
    G0's); the final state and the mean loss of each step."""
    loss_fn = cfg.model_spec().loss_fn()
    params = dict(model.named_parameters())
    history = [{n: t.detach().clone() for n, t in params.items()}]  # history[v]: the weights after v steps
    step_losses = []
    for step in range(cfg.steps):
        weights = {n: history[max(0, step - 1) if delayed(n) else step][n].clone().requires_grad_()
                   for n in params}
        losses = []
        for x, y in _micro_batches(cfg, step):
            loss = loss_fn(functional_call(model, weights, (x,)), y)
            loss.backward()
            losses.append(loss.detach())
        for n, t in params.items():
            grad = weights[n].grad
            t.grad = None if grad is None else grad.div_(cfg.micro_batches)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        history.append({n: t.detach().clone() for n, t in params.items()})
        step_losses.append(float(torch.stack(losses).mean()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, step_losses
