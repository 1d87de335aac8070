"""Counting the bytes autograd saves for the backward.

Autograd's pack hook sees every tensor a forward saves: activations, but also parameters
and views of tensors that are already saved. Only activations are worth managing, and a
storage saved several times occupies memory once, so the count skips parameters and
counts each storage once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from vpipe.compat.torch_internals import pending_collective_elem


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``t`` is on this rank: a DTensor's local shard, the tensor a pending functional
    collective wraps (a tensor-parallel output whose all-reduce is not waited on yet), else ``t``."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        elem = pending_collective_elem(t)
        if elem is not None:
            return elem
    return t


def storage_key(t: torch.Tensor) -> tuple[int, torch.device]:
    """Identity of the memory behind a tensor (views of one storage share it)."""
    t = local_of(t)
    return (t.untyped_storage().data_ptr(), t.device)


def storage_bytes(t: torch.Tensor) -> int:
    return local_of(t).untyped_storage().nbytes()


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a (nested) value, each counted by its own elements: what a layer
    hands to the next one (a view counts its own size, not its storage's)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


class SavedBytesCounter:
    """Bytes of distinct non-parameter storages saved while it was active."""

    def __init__(self, skip: set[tuple[int, torch.device]]) -> None:
        self._skip = skip
        self._seen: set[tuple[int, torch.device]] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter):
            return t
        key = storage_key(t)
        if key not in self._skip and key not in self._seen:
            self._seen.add(key)
            self.bytes += storage_bytes(t)
        return t


@contextmanager
def count_saved_bytes(module: nn.Module) -> Iterator[SavedBytesCounter]:
    """Count the activation bytes a forward of ``module`` saves (parameters excluded)."""
    skip = {storage_key(p) for p in module.parameters()} | {storage_key(b) for b in module.buffers()}
    counter = SavedBytesCounter(skip)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        yield counter


class RecomputeCounter:
    """Bytes a recomputed forward saves (distinct storages, weights excluded).

    A recomputed layer's saved tensors are replaced by slots, so the ledger never sees them;
    the slots' pack hook shows them to this counter instead: a budget needs that number for
    recomputed layers too.
    """

    def __init__(self, is_weight: Callable[[torch.Tensor], bool], min_swap_bytes: int) -> None:
        self._is_weight = is_weight
        self._min_swap = min_swap_bytes
        # nothing is kept, so a storage can die and its address be reused within the
        # forward: a weak reference tells a new storage from one seen before
        self._seen: dict[int, StorageWeakRef] = {}
        self.bytes = 0
        self.swappable = 0

    def see(self, t: torch.Tensor) -> None:
        if self._is_weight(t) or t.layout is not torch.strided:
            return
        storage = local_of(t).untyped_storage()
        key = storage.data_ptr()
        seen = self._seen.get(key)
        if seen is not None and not seen.expired():
            return
        self._seen[key] = StorageWeakRef(storage)
        n = storage.nbytes()
        self.bytes += n
        if n >= self._min_swap:
            self.swappable += n


class CountedBytes(Protocol):
    """Bytes the ledger counts for one (layer, micro-batch): a saved storage's entry."""

    layer: int
    mb: int
    nbytes: int


def bytes_by_call(entries: Iterable[CountedBytes]) -> dict[tuple[int, int], int]:
    """The bytes of ``entries`` summed per (layer, micro-batch): a batch of copies is one layer's, mostly."""
    counts: dict[tuple[int, int], int] = {}
    for entry in entries:
        call = (entry.layer, entry.mb)
        counts[call] = counts.get(call, 0) + entry.nbytes
    return counts


def format_bytes(n: float) -> str:
    """Bytes for messages: '12.0 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


class Ledger:
    """Saved bytes a tensor manager holds on the device, per (layer, micro-batch), and their peak.

    "Resident" counts what the manager itself keeps alive on the device: kept tensors,
    swapped tensors until their copy to the host finished, and swapped tensors brought
    back for a backward. The activation sizes (what a layer saves for one micro-batch,
    whatever its policy) are recorded separately: they are what a planner needs.
    """

    def __init__(self) -> None:
        self.resident = 0
        self.peak = 0
        self.step_peak = 0  # the peak since reset_step_peak() (per-step metrics; ``peak`` stays the run's)
        self._resident: dict[tuple[int, int], int] = {}
        self.activation: dict[int, dict[int, int]] = {}  # layer -> micro-batch -> bytes saved
        self.swappable: dict[int, int] = {}  # layer -> bytes of its last micro-batch that could be swapped
        self.inputs: dict[int, int] = {}  # layer -> bytes a recomputed micro-batch keeps (its inputs)
        # layer -> bytes one micro-batch keeps on the device between the input and the weight pass of a
        # split backward (what the weight pass unpacks again: brought back or recomputed once, kept)
        self.lag: dict[int, int] = {}

    def add(self, layer: int, mb: int, nbytes: int) -> None:
        by_key = self._resident
        key = (layer, mb)
        by_key[key] = by_key.get(key, 0) + nbytes
        self.resident = resident = self.resident + nbytes
        if resident > self.step_peak:  # (never above peak: one comparison while under both)
            self.step_peak = resident
            if resident > self.peak:
                self.peak = resident

    def sub(self, layer: int, mb: int, nbytes: int) -> None:
        by_key = self._resident
        key = (layer, mb)
        left = by_key.get(key, 0) - nbytes
        if left > 0:
            by_key[key] = left
        elif left == 0:
            by_key.pop(key, None)
        else:
            raise AssertionError(f"resident bytes of layer {layer} micro-batch {mb} would become negative")
        self.resident -= nbytes

    def add_each(self, entries: Iterable[CountedBytes]) -> dict[tuple[int, int], int]:
        """:meth:`add` the bytes of ``entries`` (a batch of copies), once per (layer, micro-batch); returns
        what it added, by (layer, micro-batch)."""
        counts = bytes_by_call(entries)
        for (layer, mb), nbytes in counts.items():
            self.add(layer, mb, nbytes)
        return counts

    def sub_each(self, entries: Iterable[CountedBytes]) -> None:
        """:meth:`sub` the bytes of ``entries``, once per (layer, micro-batch)."""
        for (layer, mb), nbytes in bytes_by_call(entries).items():
            self.sub(layer, mb, nbytes)

    def add_micro_batch(self, mb: int, counts: list[tuple[int, int]]) -> None:
        """:meth:`add` for each ``(layer, bytes)`` of one micro-batch (a forward run without hooks)."""
        resident = self._resident
        for layer, nbytes in counts:
            key = (layer, mb)
            resident[key] = resident.get(key, 0) + nbytes
        self.resident += sum(nbytes for _, nbytes in counts)
        if self.resident > self.step_peak:
            self.step_peak = self.resident
            if self.resident > self.peak:
                self.peak = self.resident

    def sub_micro_batch(self, mb: int, counts: list[tuple[int, int]]) -> None:
        """:meth:`sub` for each ``(layer, bytes)`` that :meth:`add_micro_batch` counted."""
        for layer, nbytes in counts:
            self.sub(layer, mb, nbytes)

    def reset_peak(self) -> None:
        self.peak = self.step_peak = self.resident

    def reset_step_peak(self) -> None:
        self.step_peak = self.resident

    def resident_by_layer(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for (layer, _mb), n in self._resident.items():
            out[layer] = out.get(layer, 0) + n
        return out

    def resident_of(self, layer: int) -> dict[int, int]:
        """Resident bytes of one layer per micro-batch."""
        return {mb: n for (lid, mb), n in self._resident.items() if lid == layer}

    def record_activation(self, layer: int, mb: int, nbytes: int, swappable: int | None = None) -> None:
        self.activation.setdefault(layer, {})[mb] = nbytes
        if swappable is not None:
            self.swappable[layer] = swappable

    def activation_bytes(self, layer: int) -> int | None:
        """The largest per-micro-batch activation size seen for ``layer`` (None if never measured)."""
        sizes = self.activation.get(layer)
        return max(sizes.values()) if sizes else None

    def forget_layer(self, layer: int) -> None:
        self.activation.pop(layer, None)
        self.swappable.pop(layer, None)
        self.inputs.pop(layer, None)
        self.lag.pop(layer, None)
