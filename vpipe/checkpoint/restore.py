"""Restoring a stage from a checkpoint: everything checked against the stage first, then copied in.

A stage's layers are found by name in whichever shards hold them, so the checkpoint may
come from another number of stages. Names, shapes, dtypes, the optimizer's kind and its
param groups' hyperparameters are all checked before a value is copied, so an error
leaves the module, optimizer and scheduler as they were.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from vpipe.checkpoint.layout import CheckpointError
from vpipe.checkpoint.load import Checkpoint
from vpipe.compat.torch_internals import child_modules

log = logging.getLogger("vpipe.checkpoint")

__all__ = ["stage_state", "restore_stage"]


def stage_state(checkpoint: Checkpoint, module: nn.Module, rng_rank: int | None = None) -> dict[str, Any]:
    """The checkpoint's state for ``module``'s layers, checked against the module (nothing is loaded yet)."""
    layer_ids = [int(n) for n in child_modules(module)]
    missing_layers = sorted(set(layer_ids) - set(checkpoint.layer_order))
    if missing_layers:
        raise CheckpointError(f"checkpoint {checkpoint.path} has no layers {missing_layers[:5]} "
                              f"(it holds {checkpoint.layer_order[:3]}...{checkpoint.layer_order[-1:]})")
    state = checkpoint.load_shards(layer_ids, rng_rank=rng_rank)
    own = module.state_dict()
    for name, target in own.items():
        value = state["params"].get(name)
        where = f"checkpoint {checkpoint.path}"
        if value is None:
            raise CheckpointError(f"{where} has no value for {name}")
        if value.shape != target.shape or value.dtype != target.dtype:
            raise CheckpointError(f"{where}: {name} is {tuple(value.shape)} {value.dtype} there, "
                                  f"{tuple(target.shape)} {target.dtype} in this model")
    named = dict(module.named_parameters())
    return {"params": {n: state["params"][n] for n in own},
            "optimizer": {n: s for n, s in state["optimizer"].items() if n in named},
            "groups": {n: g for n, g in state["groups"].items() if n in named},
            "scheduler": state["scheduler"], "rng": state["rng"]}


def _group_settings(checkpoint: Checkpoint, module: nn.Module, optimizer: torch.optim.Optimizer,
                    saved: Mapping[str, dict[str, Any]]) -> list[dict[str, Any] | None]:
    """Per param group of ``optimizer``: the saved hyperparameters of its parameters (None: none saved)."""
    names = {id(p): name for name, p in module.named_parameters()}
    out: list[dict[str, Any] | None] = []
    for g, group in enumerate(optimizer.param_groups):
        found = [saved[names[id(p)]] for p in group["params"] if names.get(id(p)) in saved]
        if not found:
            out.append(None)
            continue
        if any(_differs(f, found[0]) for f in found[1:]):
            raise CheckpointError(f"checkpoint {checkpoint.path}: the parameters of this stage's "
                                  f"optimizer group {g} "
                                  "had different hyperparameters (learning rate, weight decay...) when saved")
        unknown = sorted(set(found[0]) - set(group))
        if unknown:
            raise CheckpointError(f"checkpoint {checkpoint.path}: its optimizer groups have "
                                  f"{unknown}, this stage's {type(optimizer).__name__} has not")
        out.append(found[0])
    return out


def _differs(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return True
    return any(not torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
               else x != y
               for x, y in ((a[k], b[k]) for k in a))


def restore_stage(checkpoint: Checkpoint, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                  scheduler: Any = None, *, rank: int | None = None) -> None:
    """Load this stage's layers' parameters, buffers, optimizer state and param-group hyperparameters,
    the learning-rate scheduler's state and, given the ``rank`` of a run on the checkpoint's
    number of stages, that rank's RNG state.

    Everything is checked first (shards, names, shapes, optimizer kind and groups); only then
    are values copied, so an error leaves ``module``, ``optimizer`` and ``scheduler`` as they were.
    """
    state = stage_state(checkpoint, module, rank)
    mine = set(child_modules(module))
    kinds = {s.optimizer for s in checkpoint.shards if {str(lid) for lid in s.layers} & mine}
    if optimizer is not None and state["optimizer"] and type(optimizer).__name__ not in kinds:
        raise CheckpointError(f"checkpoint {checkpoint.path} holds {sorted(k for k in kinds if k)} optimizer "
                              f"state, this stage's optimizer is {type(optimizer).__name__}")
    settings = _group_settings(checkpoint, module, optimizer,
                               state["groups"]) if optimizer is not None else []
    if scheduler is not None and state["scheduler"] is None and checkpoint.step > 0:
        log.warning("checkpoint %s has no learning-rate scheduler state; the scheduler starts over",
                    checkpoint.path)
    with torch.no_grad():
        for name, target in module.state_dict(keep_vars=True).items():
            target.copy_(state["params"][name])
    if optimizer is not None:
        params = dict(module.named_parameters())
        for name, values in state["optimizer"].items():
            p = params[name]
            # per-element state (moments) lives with its parameter; scalars (Adam's step) stay on the CPU
            optimizer.state[p] = {k: (v.to(p.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                                  for k, v in values.items()}
        for group, saved in zip(optimizer.param_groups, settings):
            if saved is not None:
                group.update(saved)  # in place: a scheduler holding the optimizer sees the restored values
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if state["rng"] is not None:
        torch.set_rng_state(state["rng"])
