"""The layers one tensor manager manages, and their policies.

A layer is taken whole (claimed, its hooks on, its policy set) or not at all, and let go with its hooks
and claim; a policy change reaches the layer at its next call. Whether every layer is kept (D) decides
whether the layers may run without hooks, so each change is reported to the manager (``on_policies``).
Whether a layer may go at all (no saved tensor of it alive) is the manager's to check: it knows the
micro-batches in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial

from torch import nn

from vpipe.plan import Policy
from vpipe.tensor_manager.governor import BudgetGovernor
from vpipe.tensor_manager.interception import Interceptor
from vpipe.tensor_manager.layers import ManagedLayer, claim_module, release_module
from vpipe.tensor_manager.swap import SwapEngine

log = logging.getLogger("vpipe.tensor_manager")

__all__ = ["ManagedLayers"]


class ManagedLayers:
    """The manager's layers by id (``layers``, the dict the other parts read) and their policies."""

    def __init__(self, owner: object, *, layers: dict[int, ManagedLayer], calls: Interceptor,
                 engine: SwapEngine, budget: BudgetGovernor, on_policies: Callable[[bool], None]) -> None:
        self._owner = owner  # the manager a module is claimed for (one manager a module at a time)
        self._layers = layers
        self._calls = calls
        self._engine = engine
        self._budget = budget
        self._on_policies = on_policies

    @property
    def ids(self) -> list[int]:
        return sorted(self._layers)

    @property
    def all_keep(self) -> bool:
        return all(layer.policy is Policy.KEEP for layer in self._layers.values())

    def get(self, layer_id: int) -> ManagedLayer:
        try:
            return self._layers[layer_id]
        except KeyError:
            raise KeyError(f"layer {layer_id} is not managed by this tensor manager "
                           f"(it manages layers {self.ids})") from None

    def add(self, layer_id: int, module: nn.Module, policy: Policy | str) -> None:
        """Manage ``module`` as layer ``layer_id``; one not taken whole keeps no hook and no claim."""
        claim_module(module, self._owner, layer_id, self._layers)
        layer = self._layers[layer_id] = ManagedLayer(layer_id, module)
        try:
            layer.attach(partial(self._calls.pre_forward, layer), partial(self._calls.post_forward, layer))
            self.set(layer_id, policy)
        except BaseException:
            _detach(self._layers.pop(layer_id))
            raise

    def remove(self, layer_id: int) -> nn.Module:
        """Let a layer go (the manager checked that none of its saved tensors is alive)."""
        layer = self.get(layer_id)
        _detach(layer)
        del self._layers[layer_id]
        self._on_policies(self.all_keep)
        self._budget.reset_reserve()
        return layer.module

    def policies(self) -> dict[int, Policy]:
        return {lid: layer.policy for lid, layer in sorted(self._layers.items())}

    def set(self, layer_id: int, policy: Policy | str) -> None:
        """Takes effect at the layer's next call (the next micro-batch)."""
        layer = self.get(layer_id)
        policy = policy if isinstance(policy, Policy) else Policy.parse(policy)
        layer.use_policy(policy, self._calls.forward_layer)
        self._on_policies(self.all_keep)
        if policy is Policy.SWAP:
            _ = self._engine.pool  # pin the first chunk now, not in the middle of a forward

    def set_many(self, policies: Mapping[int, Policy | str]) -> None:
        unknown = sorted(set(policies) - set(self._layers))
        if unknown:
            raise KeyError(f"policies name layers {unknown} that this tensor manager does not manage "
                           f"(it manages layers {self.ids})")
        for layer_id, policy in policies.items():
            self.set(layer_id, policy)
        self._budget.supersede_escalations()  # what the budget escalated before a plan is the plan's now

    def detach_all(self) -> None:
        """Every layer's hooks and forward attribute off (the manager closes); its saved tensors stay."""
        for layer in self._layers.values():
            try:
                _detach(layer)
            except RuntimeError as e:  # someone else's forward attribute: leave it, say so
                log.warning("tensor manager close: %s", e)


def _detach(layer: ManagedLayer) -> None:
    try:
        layer.detach()
    finally:
        release_module(layer.module)
