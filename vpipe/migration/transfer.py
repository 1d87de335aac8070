"""The tensor side of a migration: one flat payload per move over a process group of its own.

Migration payloads travel over ``torch.distributed`` (gloo on CPU, NCCL on GPU) on a
dedicated group, so they never interleave with the schedule's activation and gradient
sends. Every transfer has a tag both sides derive from the plan (epoch, round, direction),
so a receive left behind by an aborted move can never swallow a later move's bytes.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TransferChannel", "transfer_tag", "MOVE", "VERSION", "HANDOVER"]

MOVE, VERSION, HANDOVER = 0, 1, 2  # kinds of transfer


def transfer_tag(epoch: int, kind: int, index: int) -> int:
    """A gloo/NCCL tag unique per (epoch, kind, index) and below 2**31.

    ``index`` is the round and direction of a step-boundary move (``MOVE``), or the weight
    version of a streamed PipeDream move (``VERSION``), or 0 for its final hand-over.
    """
    if not 0 <= index < 10_000 or kind not in (MOVE, VERSION, HANDOVER):
        raise ValueError(f"bad transfer tag parts: kind {kind}, index {index}")
    return (epoch % 20_000) * 100_000 + kind * 10_000 + index


class TransferChannel:
    """Point-to-point payload transfers between neighbouring stages.

    Creating one is a collective call: every rank of the run must create it at the same
    point (vpipe does so when it attaches).
    """

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device = device
        self.group = group if group is not None else dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")

    def send(self, payload: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending; returns the work to wait on (keep ``payload`` alive until then)."""
        return dist.isend(payload.to(self.device), dst=dst, group=self.group, tag=tag)

    def recv(self, nbytes: int, src: int, tag: int) -> tuple[torch.Tensor, Any]:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf, dist.irecv(buf, src=src, group=self.group, tag=tag)

    @staticmethod
    def wait(work: Any, timeout_s: float) -> None:
        """Wait for a transfer; raises ``TimeoutError`` if the peer never delivered."""
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise TimeoutError(f"migration transfer did not complete within {timeout_s:.0f} s") from e
            raise
