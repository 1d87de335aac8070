"""Device <-> host copies for swapping, on their own streams, with events and timings.

On CUDA each direction has a dedicated low-priority stream, so a swap-out runs while the
compute stream goes on and a prefetch runs ahead of the backward that needs it; every
copy is a :class:`Ticket` holding an event, and the manager releases memory only once a
ticket is done. Pipeline sends/receives should win the copy engines: NCCL's streams are
asked for high priority (:func:`comm_process_group_options`), the copy streams take the
lowest.

Without CUDA the same interface copies synchronously: tickets are born complete and the
time is measured with the wall clock, so all the tensor manager's logic runs (and is
tested) on CPU.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from vpipe.compat.torch_internals import foreach_copy_, raw_stream_getter
from vpipe.settings import PREFETCH_ALLOCS

__all__ = ["Ticket", "CopyEngine", "CpuCopyEngine", "CudaCopyEngine", "make_copy_engine",
           "comm_process_group_options"]

D2H = "d2h"
H2D = "h2d"
# Copy bandwidth assumed before the first copy was timed (bytes/s).
ASSUMED_BANDWIDTH = {"cpu": 4e9, "cuda": 12e9}


class Ticket:
    """One asynchronous copy: done() polls it, wait() blocks the host until it finished.

    A batch's entries share one ticket and each asks it: once the event said it completed,
    the answer is remembered, so only the first asks the device.
    """

    __slots__ = ("direction", "nbytes", "event", "start", "seconds", "finished", "waited_on", "allocated_on")

    def __init__(self, direction: str, nbytes: int, event: Any = None, start: Any = None,
                 seconds: float | None = None) -> None:
        self.direction = direction
        self.nbytes = nbytes
        self.event = event  # None: finished when created (CPU)
        self.start = start
        self.seconds = seconds
        self.finished = event is None
        self.waited_on: object = None  # the last stream made to wait for it (a batch's entries share it)
        self.allocated_on: object = None  # the stream whose memory a copy to the device was allocated from

    def done(self) -> bool:
        if not self.finished and self.event.query():
            self.finished = True
        return self.finished

    def wait(self) -> None:
        if not self.finished:
            self.event.synchronize()
            self.finished = True


class CopyEngine(ABC):
    """Interface shared by the CPU and CUDA engines; keeps the copy statistics."""

    device: torch.device
    pinned: bool

    def __init__(self) -> None:
        self.bytes = {D2H: 0, H2D: 0}
        self.seconds = {D2H: 0.0, H2D: 0.0}
        self._untimed: deque[Ticket] = deque()

    # -- copies -------------------------------------------------------------
    @abstractmethod
    def to_host_batch(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Ticket:
        """Copy each pair's device tensor into its host tensor (in a
        pool block) asynchronously; one ticket for all.

        One layer's saved tensors go together: the stream switch, the wait for the producer and
        the events cost once per layer, not once per tensor (they dominate small copies).
        """
        ...

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Ticket:
        """Copy device bytes ``src`` into host bytes ``dst`` asynchronously."""
        return self.to_host_batch([(src, dst)])

    @abstractmethod
    def to_device_batch(self, sources: Sequence[torch.Tensor], after: Sequence[Ticket] = ()
                        ) -> tuple[list[torch.Tensor], Ticket]:
        """Copy host tensors back into new device tensors of the same dtype and
        layout ahead of use (prefetch), once ``after`` ended."""
        ...

    def to_device(self, src: torch.Tensor, after: Ticket | None = None) -> tuple[torch.Tensor, Ticket]:
        """Copy a host tensor back into a new device tensor of the
        same dtype and layout ahead of use (prefetch)."""
        outs, ticket = self.to_device_batch([src], [after] if after is not None else ())
        return outs[0], ticket

    @abstractmethod
    def to_device_now(self, src: torch.Tensor) -> tuple[torch.Tensor, Ticket]:
        """Copy host bytes back on the current stream: the fallback when no prefetch was issued."""
        ...

    @abstractmethod
    def consume(self, tensor: torch.Tensor, ticket: Ticket) -> object:
        """Make the current stream wait for ``ticket`` before it uses ``tensor``; returns that stream.

        A copy unpacked several times on one stream needs this once: the caller keeps the stream
        returned and asks :meth:`consumed_on` before calling again.
        """
        ...

    def consumed_on(self, stream: object) -> bool:
        """Whether ``stream`` (what :meth:`consume` returned) is the current stream."""
        return True

    # -- statistics ---------------------------------------------------------
    def _account(self, ticket: Ticket) -> None:
        self.bytes[ticket.direction] += ticket.nbytes
        if ticket.seconds is not None:
            self.seconds[ticket.direction] += ticket.seconds
        else:
            self._untimed.append(ticket)

    def resolve_timings(self) -> None:
        """Add the durations of finished asynchronous copies to the totals (no device sync)."""
        while self._untimed and self._untimed[0].done():
            ticket = self._untimed.popleft()
            ticket.seconds = ticket.start.elapsed_time(ticket.event) / 1000.0
            self.seconds[ticket.direction] += ticket.seconds

    def bandwidth(self, direction: str) -> float | None:
        """Measured bytes per second of one direction, None before the first timed copy."""
        self.resolve_timings()
        secs = self.seconds[direction]
        return self.bytes[direction] / secs if secs > 0 else None

    @property
    def kind(self) -> str:
        """``"cuda"`` or ``"cpu"``: which assumptions hold for these copies."""
        return "cuda" if self.device.type == "cuda" else "cpu"

    def expected_bandwidth(self, direction: str) -> float:
        """Measured bytes per second of one direction, or the assumed figure before the first timed copy."""
        return self.bandwidth(direction) or ASSUMED_BANDWIDTH[self.kind]


class CpuCopyEngine(CopyEngine):
    """The CPU stand-in: synchronous memcpy, wall-clock timing."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.pinned = False

    def to_host_batch(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Ticket:
        t0 = time.perf_counter()
        foreach_copy_([dst for _, dst in pairs], [src for src, _ in pairs])
        ticket = Ticket(D2H, sum(src.nbytes for src, _ in pairs), seconds=time.perf_counter() - t0)
        self._account(ticket)
        return ticket

    def to_device_batch(self, sources: Sequence[torch.Tensor], after: Sequence[Ticket] = ()
                        ) -> tuple[list[torch.Tensor], Ticket]:
        t0 = time.perf_counter()
        outs = [torch.empty_like(src, device=self.device) for src in sources]
        foreach_copy_(outs, list(sources))
        ticket = Ticket(H2D, sum(src.nbytes for src in sources), seconds=time.perf_counter() - t0)
        self._account(ticket)
        return outs, ticket

    def to_device_now(self, src: torch.Tensor) -> tuple[torch.Tensor, Ticket]:
        t0 = time.perf_counter()
        out = torch.empty_like(src, device=self.device)
        out.copy_(src)
        ticket = Ticket(H2D, src.nbytes, seconds=time.perf_counter() - t0)
        self._account(ticket)
        return out, ticket

    def consume(self, tensor: torch.Tensor, ticket: Ticket) -> object:
        return None


class CudaCopyEngine(CopyEngine):
    """Swap-out and prefetch on two dedicated lowest-priority CUDA streams."""

    def __init__(self, device: torch.device, prefetch_alloc: str = "copy") -> None:
        super().__init__()
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._index = device.index
        self.pinned = True
        self.prefetch_alloc = prefetch_alloc
        # 0 is CUDA's lowest priority (higher priorities are negative): compute and NCCL go first
        self.d2h_stream = torch.cuda.Stream(device, priority=0)
        self.h2d_stream = torch.cuda.Stream(device, priority=0)
        # torch.cuda.current_stream() costs about 20 us of Python (device lookup, a new Stream object); the
        # raw handle is one C call, so the Stream object is made again only when the current stream changes
        self._raw_stream = raw_stream_getter()
        self._stream_handle = -1
        self._stream: torch.cuda.Stream | None = None

    def _events(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _current_stream(self) -> torch.cuda.Stream:
        if self._raw_stream is None:  # pragma: no cover - every CUDA build of the supported torch has it
            return torch.cuda.current_stream(self._index)
        handle = self._raw_stream(self._index)
        if handle != self._stream_handle or self._stream is None:
            self._stream = torch.cuda.current_stream(self._index)
            self._stream_handle = handle
        return self._stream

    def _switch_to(self, stream: torch.cuda.Stream) -> int:
        """Make a copy stream current; returns the current device before (torch's setter makes the stream's
        device current too).

        Not the ``torch.cuda.stream()`` context: that one reads the current stream again on entry (and each
        ``Event.record()`` without a stream once more), about 20 us of Python each, per batch; the events are
        recorded on the stream by name and the compute stream is already known (:meth:`_current_stream`).
        """
        device = torch.cuda.current_device()
        torch.cuda.set_stream(stream)
        return device

    def _switch_back(self, compute: torch.cuda.Stream, device: int) -> None:
        torch.cuda.set_stream(compute)
        if device != self._index:  # the caller's current device was another one: it stays current
            torch.cuda.set_device(device)

    def to_host_batch(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Ticket:
        start, end = self._events()
        stream, compute = self.d2h_stream, self._current_stream()
        # the copies must see the producers' results: wait for what the compute stream queued so far
        stream.wait_stream(compute)
        device = self._switch_to(stream)
        try:
            start.record(stream)
            # one call for the batch: the per-pair dispatch runs in C++, not in Python
            foreach_copy_([dst for _, dst in pairs], [src for src, _ in pairs], non_blocking=True)
            end.record(stream)
        finally:
            self._switch_back(compute, device)
        ticket = Ticket(D2H, sum(src.nbytes for src, _ in pairs), end, start)
        self._account(ticket)
        return ticket

    def to_device_batch(self, sources: Sequence[torch.Tensor], after: Sequence[Ticket] = ()
                        ) -> tuple[list[torch.Tensor], Ticket]:
        start, end = self._events()
        stream, compute = self.h2d_stream, self._current_stream()
        waited: set[int] = set()
        for ticket in after:  # the host bytes must have arrived
            if not ticket.finished and id(ticket) not in waited:
                waited.add(id(ticket))
                stream.wait_event(ticket.event)
        outs = None
        if self.prefetch_alloc == "compute":
            # from the compute stream's cached memory, the pool the backward frees into: under a memory cap, a
            # second pool on the copy stream makes the allocator free its cache (a device sync) to fit. That
            # memory may still be read by kernels the compute stream has queued: the copy waits for them
            outs = [torch.empty_like(src, device=self.device) for src in sources]
            stream.wait_stream(compute)
        device = self._switch_to(stream)
        try:
            start.record(stream)
            if outs is None:
                # allocated on the copy stream: the allocator will not hand this memory to the
                # compute stream until consume() recorded the compute stream's use of it
                outs = [torch.empty_like(src, device=self.device) for src in sources]
            foreach_copy_(outs, list(sources), non_blocking=True)
            end.record(stream)
        finally:
            self._switch_back(compute, device)
        ticket = Ticket(H2D, sum(src.nbytes for src in sources), end, start)
        ticket.allocated_on = compute if self.prefetch_alloc == "compute" else stream
        self._account(ticket)
        return outs, ticket

    def to_device_now(self, src: torch.Tensor) -> tuple[torch.Tensor, Ticket]:
        start, end = self._events()
        stream = self._current_stream()
        start.record(stream)
        out = torch.empty_like(src, device=self.device)
        out.copy_(src, non_blocking=True)
        end.record(stream)
        ticket = Ticket(H2D, src.nbytes, end, start)
        self._account(ticket)
        return out, ticket

    def consume(self, tensor: torch.Tensor, ticket: Ticket) -> object:
        stream = self._current_stream()
        if not ticket.finished and ticket.waited_on is not stream:  # once per stream for a batch's copies
            stream.wait_event(ticket.event)
            ticket.waited_on = stream
        if ticket.allocated_on is not stream:  # (memory of the stream that uses it needs no record)
            tensor.record_stream(stream)
        return stream

    def consumed_on(self, stream: object) -> bool:
        return stream is self._current_stream()


def make_copy_engine(device: torch.device, prefetch_alloc: str = "copy") -> CopyEngine:
    """The copy engine of ``device``. ``prefetch_alloc``: ``copy`` (the default) allocates prefetched
    copies on the copy stream, ``compute`` from the compute stream's cached memory (an experiment timed by
    ``benchmarks/gpu_suite.sh``); anything else is refused, on CPU too (a typo does not wait for a GPU)."""
    if prefetch_alloc not in PREFETCH_ALLOCS:
        raise ValueError(
            f"prefetch_alloc must be one of {', '.join(PREFETCH_ALLOCS)}, got {prefetch_alloc!r}"
        )
    if device.type == "cuda":
        return CudaCopyEngine(device, prefetch_alloc)
    return CpuCopyEngine(device)


def comm_process_group_options(backend: str) -> Any | None:
    """Process-group options that put pipeline sends/receives on high-priority streams (NCCL)."""
    if backend != "nccl" or not torch.cuda.is_available():
        return None
    try:
        from torch.distributed import ProcessGroupNCCL
    except ImportError:  # pragma: no cover - a build without NCCL
        return None
    options = ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options
