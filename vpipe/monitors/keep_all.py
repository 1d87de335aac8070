"""The saved-tensor source of a stage that keeps every activation on its device.

Such a stage swaps nothing and recomputes nothing, so its copy and recompute figures are
true zeros, and the only thing to measure is how many bytes each layer saves per
micro-batch: autograd's pack hook counts them (parameters and repeated storages
skipped, see :mod:`vpipe.tensor_manager.accounting`). The tensor manager replaces this
source when it is attached; both must not be active on the same layers, because only the
innermost ``saved_tensors_hooks`` sees a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vpipe.monitors.source import SavedTensorStats
from vpipe.tensor_manager.accounting import SavedBytesCounter, storage_key

__all__ = ["KeepAllSource"]


class KeepAllSource:
    """Counts each layer's saved bytes on forwards that record a graph, while enabled.

    The monitor owns one disabled and enables it for sampled iterations only, so that other
    iterations run without its hooks; the last counts stay readable in between. With
    ``first_call_only`` a layer is counted on its first forward after :meth:`set_enabled`
    and then unhooked: micro-batches of one batch save the same bytes, and the pack hook's
    Python call per saved tensor is the costly part of monitoring a sampled step.
    """

    def __init__(self, layers: Mapping[int, nn.Module], *, enabled: bool = True,
                 first_call_only: bool = False) -> None:
        self._layers: dict[int, nn.Module] = {}
        self._handles: dict[int, list[RemovableHandle]] = {}
        self._open: dict[int, tuple[Any, SavedBytesCounter]] = {}
        self._bytes: dict[int, int] = {}
        self._enabled = enabled
        self._first_call_only = first_call_only
        for layer_id, module in layers.items():
            self.add_layer(layer_id, module)

    def add_layer(self, layer_id: int, module: nn.Module) -> None:
        if layer_id in self._layers:
            raise ValueError(f"layer {layer_id} is already counted")
        self._layers[layer_id] = module
        if self._enabled:
            self._hook(layer_id)

    def remove_layer(self, layer_id: int) -> None:
        self._unhook(layer_id)
        self._layers.pop(layer_id, None)
        self._bytes.pop(layer_id, None)

    def retire_layer(self, layer_id: int) -> None:
        return None  # a layer out of the forward path is not called: its hooks stay quiet

    def set_enabled(self, enabled: bool) -> None:
        self._enabled = enabled
        for layer_id in self._layers:
            self._hook(layer_id) if enabled else self._unhook(layer_id)

    def _hook(self, layer_id: int) -> None:
        if layer_id in self._handles:
            return
        module = self._layers[layer_id]
        self._handles[layer_id] = [
            module.register_forward_pre_hook(lambda m, a, lid=layer_id: self._enter(lid, m)),
            module.register_forward_hook(lambda m, a, o, lid=layer_id: self._exit(lid), always_call=True),
        ]

    def _unhook(self, layer_id: int) -> None:
        for handle in self._handles.pop(layer_id, []):
            handle.remove()
        opened = self._open.pop(layer_id, None)
        if opened is not None:  # removed mid-forward: leave autograd's hook stack balanced
            opened[0].__exit__(None, None, None)

    def close(self) -> None:
        for layer_id in list(self._layers):
            self.remove_layer(layer_id)

    def stats(self) -> SavedTensorStats:
        return SavedTensorStats(activation_bytes=dict(self._bytes))

    # ---------------------------------------------------------------- hooks
    def _enter(self, layer_id: int, module: nn.Module) -> None:
        if not torch.is_grad_enabled():
            return
        # read at call time: torch.func.functional_call swaps in other parameter tensors
        skip = {storage_key(t) for t in module.parameters()} | {storage_key(t) for t in module.buffers()}
        counter = SavedBytesCounter(skip)
        hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, _unpack)
        hooks.__enter__()
        self._open[layer_id] = (hooks, counter)

    def _exit(self, layer_id: int) -> None:
        opened = self._open.pop(layer_id, None)
        if opened is not None:
            hooks, counter = opened
            hooks.__exit__(None, None, None)
            self._bytes[layer_id] = counter.bytes
            if self._first_call_only:
                self._unhook(layer_id)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
