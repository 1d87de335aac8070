"""Policy R: run a layer under non-reentrant checkpoint so its activations are recomputed.

``torch.utils.checkpoint`` (non-reentrant, RNG state preserved) drops what the layer
would save and re-runs its forward in the backward with the CPU and device RNG states of
the original forward, so dropout masks are identical and gradients equal the kept run's
bit for bit.

Two things plain checkpointing gets wrong under vpipe and this module handles:

* Weight versions. PipeDream runs the stage through ``torch.func.functional_call`` with
  stashed weight tensors; the recompute happens in the backward, after functional_call
  has put the live parameters back (possibly already updated). The weights in effect at
  forward time are captured and, if they are no longer the module's, the recompute runs
  on them again through functional_call.
* Measuring. Checkpoint's own saved-tensor hooks intercept what the layer saves, so the
  tensor manager cannot see it. During the original forward a counting hook is stacked
  over checkpoint's (delegating to it), so the manager still learns how many bytes the
  layer would save: a budget needs that number for recomputed layers too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

__all__ = ["run_recomputed", "capture_weights", "RecomputeCounter"]


def capture_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameter and buffer tensors the module uses right now (stashed ones under functional_call)."""
    found = {name: t for name, t in module.named_parameters(remove_duplicate=False)}
    found.update({name: t for name, t in module.named_buffers(remove_duplicate=False) if t is not None})
    return found


def _same_weights(module: nn.Module, captured: dict[str, torch.Tensor]) -> bool:
    now = capture_weights(module)
    return now.keys() == captured.keys() and all(now[k] is t for k, t in captured.items())


class RecomputeCounter:
    """Bytes a checkpointed forward saves (distinct storages, weights excluded)."""

    def __init__(self, is_weight: Callable[[torch.Tensor], bool], min_swap_bytes: int) -> None:
        self._is_weight = is_weight
        self._min_swap = min_swap_bytes
        # checkpoint keeps nothing, so a storage can die and its address be reused within the
        # forward: a weak reference tells a new storage from one seen before
        self._seen: dict[int, StorageWeakRef] = {}
        self.bytes = 0
        self.swappable = 0

    def see(self, t: torch.Tensor) -> None:
        if self._is_weight(t) or t.layout is not torch.strided:
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        seen = self._seen.get(key)
        if seen is not None and not seen.expired():
            return
        self._seen[key] = StorageWeakRef(storage)
        n = storage.nbytes()
        self.bytes += n
        if n >= self._min_swap:
            self.swappable += n


def run_recomputed(
    module: nn.Module,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    counter: RecomputeCounter,
    on_recompute: Callable[[float], None],
) -> Any:
    """``forward(*args, **kwargs)`` under checkpoint; ``on_recompute(seconds)`` after each recompute."""
    captured = capture_weights(module)

    def body(*a: Any, **kw: Any) -> Any:
        if torch._C._current_graph_task_id() != -1:  # a recompute, inside the backward
            t0 = time.perf_counter()
            try:  # checkpoint stops a recompute early by raising once it has what it needs
                if _same_weights(module, captured):
                    return forward(*a, **kw)
                return functional_call(module, captured, a, kw)
            finally:
                on_recompute(time.perf_counter() - t0)
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:  # pragma: no cover - checkpoint always installs its hooks
            return forward(*a, **kw)
        inner_pack, inner_unpack = top

        def pack(t: torch.Tensor) -> Any:
            counter.see(t)
            return inner_pack(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack):
            return forward(*a, **kw)

    return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
