"""A host memory pool for swapped activations.

Pinning a tensor per swap (``tensor.pin_memory()``) calls ``cudaHostAlloc``, which is slow
and serialises with the device, so swap-outs would stop overlapping compute. The pool pins
large chunks once and hands out byte ranges of them. It grows one chunk at a time up to a
configured maximum, so a stage that swaps little pins little; when the maximum is reached
a request fails with :class:`HostPoolFullError` naming the capacity and the request.

Ranges are freed in any order (zero-bubble schedules free micro-batches out of order), so
each chunk keeps a sorted free list that coalesces neighbours. Every step saves tensors of
the same sizes as the last, so a freed range is first kept aside under its exact size and
handed to the next request of that size without a search (a first-fit scan over a
fragmented free list cost more Python than the copy of a small tensor); the ranges kept
aside go back to the free lists when a request of another size finds no room.
Without CUDA the chunks are ordinary host memory: the same code runs, the copies are plain
memcpy.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import psutil
import torch

from vpipe.tensor_manager.accounting import format_bytes

__all__ = ["HostPool", "PoolBlock", "HostPoolFullError", "default_host_pool_bytes", "DEFAULT_CHUNK_BYTES"]

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
DEFAULT_HOST_FRACTION = 0.25
ALIGNMENT = 512  # keeps every range aligned for vectorised and DMA copies


class HostPoolFullError(MemoryError):
    """The host pool cannot place a swap: its maximum size is reached."""


def default_host_pool_bytes(fraction: float = DEFAULT_HOST_FRACTION) -> int:
    """A fraction of the host memory that is available now (psutil), at least one chunk."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"host pool fraction must be in (0, 1], got {fraction}")
    return max(DEFAULT_CHUNK_BYTES, int(psutil.virtual_memory().available * fraction))


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


# typed views a block keeps for reuse (a step saves the same few shapes again; see PoolBlock.view)
MAX_VIEWS_PER_BLOCK = 4


@dataclass(eq=False)
class PoolBlock:
    """A byte range of one chunk; ``data`` is a uint8 view of exactly ``nbytes``."""

    chunk: int
    offset: int
    size: int  # aligned size reserved in the chunk
    nbytes: int
    data: torch.Tensor
    freed: bool = False
    # (dtype, size, stride) -> a view of ``data`` with that layout; carried over when the range is reused
    views: dict[tuple[torch.dtype, torch.Size, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)

    def view(self, layout: tuple[torch.dtype, torch.Size, tuple[int, ...]]) -> torch.Tensor:
        """``data`` as a tensor of this dense ``(dtype, size, stride)`` (the same ``nbytes``): what a whole
        saved tensor is copied into and back from, so neither side needs a flat byte view of its storage.
        Made once per layout and range: every step saves tensors of the same shapes again."""
        view = self.views.get(layout)
        if view is None:
            if len(self.views) >= MAX_VIEWS_PER_BLOCK:
                self.views.clear()
            dtype, size, stride = layout
            view = self.views[layout] = self.data.view(dtype).as_strided(size, stride)
        return view


@dataclass
class _Chunk:
    buffer: torch.Tensor
    free: list[tuple[int, int]] = field(default_factory=list)  # sorted (offset, size)

    @property
    def size(self) -> int:
        return self.buffer.numel()


class HostPool:
    """Chunked, optionally pinned host memory with first-fit allocation."""

    def __init__(
        self,
        max_bytes: int,
        *,
        pinned: bool,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        preallocate: bool = False,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"host pool size must be positive, got {max_bytes}")
        if chunk_bytes <= 0:
            raise ValueError(f"host pool chunk size must be positive, got {chunk_bytes}")
        self.max_bytes = int(max_bytes)
        self.chunk_bytes = min(_align(int(chunk_bytes)), _align(self.max_bytes))
        self.pinned = pinned
        self._chunks: list[_Chunk] = []
        self._freed: dict[int, list[PoolBlock]] = {}  # nbytes -> freed ranges kept aside for that size
        self.used_bytes = 0  # aligned bytes handed out
        self.peak_used_bytes = 0
        if preallocate:
            self.reserve(self.chunk_bytes)

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_bytes(self) -> int:
        """Bytes allocated (pinned) so far: the sum of the chunks."""
        return sum(c.size for c in self._chunks)

    @property
    def chunks(self) -> int:
        return len(self._chunks)

    def can_hold(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` could be placed now or after growing."""
        need = _align(nbytes)
        if self._freed.get(nbytes):
            return True
        self._return_freed()
        if any(size >= need for c in self._chunks for _, size in c.free):
            return True
        return self.capacity_bytes + max(need, 0) <= self.max_bytes

    def free_bytes(self) -> int:
        """Bytes still obtainable: free ranges plus growth left (fragmentation ignored)."""
        return self.max_bytes - self.used_bytes

    # ------------------------------------------------------------------ alloc / free
    def reserve(self, nbytes: int) -> None:
        """Grow until at least ``nbytes`` are allocated (used by a stage that knows it will swap)."""
        while self.capacity_bytes < min(nbytes, self.max_bytes):
            self._grow(self.chunk_bytes)

    def alloc(self, nbytes: int) -> PoolBlock:
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes from the host pool")
        kept = self._freed.get(nbytes)
        if kept:
            old = kept.pop()
            self.used_bytes += old.size
            if self.used_bytes > self.peak_used_bytes:
                self.peak_used_bytes = self.used_bytes
            return PoolBlock(old.chunk, old.offset, old.size, nbytes, old.data, views=old.views)
        need = _align(nbytes)
        block = self._first_fit(need, nbytes)
        if block is None and self._freed:
            self._return_freed()
            block = self._first_fit(need, nbytes)
        if block is not None:
            return block
        room = self.max_bytes - self.capacity_bytes
        if need > room:
            raise HostPoolFullError(
                f"host pool full: a swap of {format_bytes(nbytes)} does not fit; "
                f"{format_bytes(self.used_bytes)} of the pool's maximum {format_bytes(self.max_bytes)} are "
                f"in use ({len(self._chunks)} chunks, {format_bytes(self.capacity_bytes)} allocated). Raise "
                "host_pool_bytes, or recompute (R) instead of swapping (S) some layers."
            )
        index = self._grow(max(self.chunk_bytes, need))
        block = self._take(index, self._chunks[index], need, nbytes)
        if block is None:  # pragma: no cover - a fresh chunk always fits
            raise AssertionError("a fresh host pool chunk could not place its request")
        return block

    def free(self, block: PoolBlock) -> None:
        if block.freed:
            raise RuntimeError(f"host pool block at chunk {block.chunk} offset {block.offset} freed twice")
        block.freed = True
        self.used_bytes -= block.size
        kept = self._freed.get(block.nbytes)
        if kept is None:
            kept = self._freed[block.nbytes] = []
        kept.append(block)

    def _return_freed(self) -> None:
        """Put the ranges kept aside back into their chunks' free lists, coalescing neighbours."""
        freed, self._freed = self._freed, {}
        for blocks in freed.values():
            for block in blocks:
                self._release_range(block)

    def _release_range(self, block: PoolBlock) -> None:
        chunk = self._chunks[block.chunk]
        free = chunk.free
        i = bisect.bisect_left(free, (block.offset, 0))
        start, size = block.offset, block.size
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:  # merge with the range before
            i -= 1
            start, size = free[i][0], free[i][1] + size
            del free[i]
        if i < len(free) and start + size == free[i][0]:  # merge with the range after
            size += free[i][1]
            del free[i]
        free.insert(i, (start, size))

    # ------------------------------------------------------------------ internals
    def _grow(self, nbytes: int) -> int:
        size = min(_align(nbytes), self.max_bytes - self.capacity_bytes)
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        self._chunks.append(_Chunk(buffer, [(0, size)]))
        return len(self._chunks) - 1

    def _first_fit(self, need: int, nbytes: int) -> PoolBlock | None:
        for index, chunk in enumerate(self._chunks):
            block = self._take(index, chunk, need, nbytes)
            if block is not None:
                return block
        return None

    def _take(self, index: int, chunk: _Chunk, need: int, nbytes: int) -> PoolBlock | None:
        for i, (offset, size) in enumerate(chunk.free):
            if size >= need:
                if size == need:
                    del chunk.free[i]
                else:
                    chunk.free[i] = (offset + need, size - need)
                self.used_bytes += need
                self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
                return PoolBlock(index, offset, need, nbytes, chunk.buffer[offset:offset + nbytes])
        return None
