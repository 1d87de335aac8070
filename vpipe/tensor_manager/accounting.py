"""Counting the bytes autograd saves for the backward.

Autograd's pack hook sees every tensor a forward saves: activations, but also parameters
and views of tensors that are already saved. Only activations are worth managing, and a
storage saved several times occupies memory once, so the count skips parameters and
counts each storage once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def storage_key(t: torch.Tensor) -> tuple[int, torch.device]:
    """Identity of the memory behind a tensor (views of one storage share it)."""
    return (t.untyped_storage().data_ptr(), t.device)


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


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
