"""What autograd holds for a managed saved tensor: a handle, and the entry of its storage.

Autograd's pack hook returns a *handle* per saved tensor; several handles may share one
*entry*, the bookkeeping of one storage (``q``, ``k`` and ``v`` are views of one ``qkv``
storage; a dropout output is saved by the next op too): a storage saved several times is
copied to the host once, and its bytes are counted once.

Handles are destroyed wherever autograd runs (on CUDA, its device thread), so their
destructor only queues the entry (with what the handle still expected); the swap engine
drains that queue under its lock at the next safe point.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vpipe.compat.torch_internals import free_weak_ref, weak_ref_expired
from vpipe.tensor_manager.copy_engine import Ticket
from vpipe.tensor_manager.pool import PoolBlock

__all__ = ["StorageEntry", "SwappedEntry", "KeptHandle", "SwappedHandle", "ShardHandle", "WHOLE", "VIEW",
           "BYTES",
           "without_graph"]


def without_graph(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a saved-tensor hook may hold it until the backward: detached if it has a grad_fn.

    A saved output's grad_fn is the node saving it: holding the tensor itself would make a reference
    cycle (node -> saved handle -> tensor -> node) that only the garbage collector breaks.
    ``is_leaf`` says the same as ``grad_fn is None`` without reading ``grad_fn``, which gives the
    node a Python object: a graph whose nodes have one is freed recursively, a C stack frame per
    node, and a stage of thousands of blocks overflowed it.
    """
    return t if t.is_leaf else t.detach()


class ShardHandle:
    """A saved DTensor (a tensor-parallel block's input, say): the handle of its
    local shard, which is kept or swapped as any saved tensor is, and what wraps that
    shard as the same DTensor again when it is unpacked."""

    __slots__ = ("inner", "mesh", "placements", "shape", "stride")

    def __init__(self, inner: Any, t: DTensor) -> None:
        self.inner = inner
        self.mesh, self.placements, self.shape, self.stride = t.device_mesh, t.placements, t.shape, t.stride()

    def wrap(self, local: torch.Tensor) -> DTensor:
        with torch.no_grad():
            return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                      stride=self.stride)


class StorageEntry:
    """One saved storage of one (layer, micro-batch), kept on the device."""

    __slots__ = ("key", "layer", "mb", "nbytes", "seq", "refs", "counted", "released")
    swapped = False

    def __init__(self, key: int, layer: int, mb: int, nbytes: int, seq: int) -> None:
        self.key = key
        self.layer = layer
        self.mb = mb
        self.nbytes = nbytes
        self.seq = seq
        self.refs = 0
        self.counted = False  # its bytes are in the ledger's resident total
        self.released = False


class SwappedEntry(StorageEntry):
    """A storage copied to the host pool, and what brings it back."""

    __slots__ = ("source", "host", "host_view", "whole", "d2h", "device_copy", "h2d", "weak", "phases",
                 "last_phase",
                 "task", "task_unpacks", "users", "unseen", "later", "fetches", "consumed")
    swapped = True

    def __init__(self, key: int, layer: int, mb: int, nbytes: int, seq: int) -> None:
        StorageEntry.__init__(self, key, layer, mb, nbytes, seq)  # (not super(): an object less per swap)
        self.source: torch.Tensor | None = None  # the original device bytes, while a swap-out is in flight
        self.host: PoolBlock | None = None
        # the host bytes as the tensor the copies move (``whole``'s layout, or bytes): set with ``host``
        self.host_view: torch.Tensor | None = None
        # (dtype, size, stride) of the tensor the copies move (swap.dense_source: most storages are one saved
        # tensor, whose handle then gets the copy itself back); None: they move the storage's bytes
        self.whole: tuple[torch.dtype, torch.Size, tuple[int, ...]] | None = None
        self.d2h: Ticket | None = None
        self.device_copy: torch.Tensor | None = None  # brought back for a backward
        self.h2d: Ticket | None = None
        # a weak reference to the storage it was saved from (torch's raw handle: StorageWeakRef's Python
        # wrapper cost more than the rest of a small tensor's swap-out); freed by forget_storage()
        self.weak: int | None = None
        self.phases = 0  # backward phases (the manager's backward() contexts) that unpacked it
        self.last_phase = -1
        self.task = -1  # the autograd graph task of the last unpack, and its unpacks in that task
        self.task_unpacks = 0
        self.users = [mb]  # micro-batches with handles on it (views of one input are shared by several)
        self.unseen = 0  # live handles never unpacked
        self.later = 0  # live handles unpacked in an input pass that the weight pass unpacks again
        self.fetches = 0  # times brought back from the host
        self.consumed: object = None  # the stream the device copy was handed to (once per stream)


    def storage_died(self) -> bool:
        """Whether the storage it was saved from is gone (its address may now belong to another)."""
        return self.weak is not None and weak_ref_expired(self.weak)

    def forget_storage(self) -> None:
        if self.weak is not None:
            free_weak_ref(self.weak)
            self.weak = None


class KeptHandle:
    """What the pack hook returns for a tensor that stays on the device (held without its graph)."""

    __slots__ = ("tensor", "entry", "_dead")

    def __init__(self, tensor: torch.Tensor, entry: StorageEntry, dead: deque) -> None:
        self.tensor = without_graph(tensor)
        self.entry = entry
        self._dead = dead

    def __del__(self) -> None:
        self._dead.append(self.entry)


# How a swapped handle's tensor is rebuilt from its entry's device copy (SwappedHandle.layout)
WHOLE = 0  # it is the copy: the tensor that spans the storage was saved itself
VIEW = 1  # a view of the copy (same dtype): as_strided
# a view of the copy's bytes (the entry moved flat bytes, or another dtype, or the tensor reads its storage
# conjugated or negated): set_ on its storage, then the conjugate and negative bits the tensor had
BYTES = 2


class SwappedHandle:
    """What the pack hook returns for a swapped tensor: the view to rebuild on its storage.

    ``copied``: ``t`` is the very tensor the entry's copies move (its layout is known: the
    handle reads none of it, and gets the copy itself back).
    """

    __slots__ = ("entry", "dtype", "size", "stride", "offset", "layout", "conj", "neg", "_dead", "unpacked",
                 "later")

    def __init__(self, t: torch.Tensor, entry: SwappedEntry, dead: deque, copied: bool = False) -> None:
        self.entry = entry
        self._dead = dead
        self.unpacked = False
        self.later = False  # the weight pass will unpack it again (set by an input pass)
        if copied:
            self.layout = WHOLE  # (dtype, size, stride, offset, conj and neg stay unset: WHOLE reads none)
            return
        self.dtype = dtype = t.dtype
        self.size = size = t.size()
        self.stride = stride = t.stride()
        self.offset = offset = t.storage_offset()
        # a lazily conjugated or negated view (x.conj() saved by a matmul) reads the same bytes differently
        self.conj = conj = t.is_conj()
        self.neg = neg = t.is_neg()
        whole = entry.whole
        if whole is None or conj or neg:
            self.layout = BYTES
        elif offset == 0 and whole == (dtype, size, stride):
            self.layout = WHOLE
        else:
            self.layout = VIEW if whole[0] is dtype else BYTES

    def __del__(self) -> None:
        self._dead.append((self.entry, self.unpacked, self.later))
