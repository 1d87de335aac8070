"""The tensor side of a migration: one flat payload per move over a process group of its own.

Migration payloads travel over ``torch.distributed`` (gloo on CPU, NCCL on GPU) on a
dedicated group, so they never interleave with the schedule's activation and gradient
sends. Every transfer has a tag both sides derive from the plan (epoch, round, direction),
so a receive left behind by an aborted move can never swallow a later move's bytes.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
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
    """Point-to-point payload transfers between neighbouring stages, and the votes that commit a move.

    Creating one is a collective call: every rank of the run must create it at the same
    point (vpipe does so when it attaches). Its group spans the whole world, so the vote of a
    move is taken by every data-parallel replica of the pipeline together: one that cannot
    apply a plan makes every replica skip it. Peers are named by their rank in the pipeline's
    own group; ``world_ranks[r]`` is the world rank of pipeline rank ``r`` (default: the same).
    """

    def __init__(self, device: torch.device, group: Any = None, world_ranks: Sequence[int] | None = None) -> None:
        self.device = device
        self.group = group if group is not None else dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")
        self.world_ranks = None if world_ranks is None else tuple(world_ranks)

    def _world(self, rank: int) -> int:
        return rank if self.world_ranks is None else self.world_ranks[rank]

    def send(self, payload: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending to pipeline rank ``dst``; returns the work to wait on (keep ``payload`` alive until then)."""
        return dist.isend(payload.to(self.device), dst=self._world(dst), group=self.group, tag=tag)

    def recv(self, nbytes: int, src: int, tag: int) -> tuple[torch.Tensor, Any]:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf, dist.irecv(buf, src=self._world(src), group=self.group, tag=tag)

    def vote(self, flags: list[tuple[bool, bool]]) -> list[bool]:
        """Every rank learns, for each ``(flag, all_of)``, whether the flag holds on all ranks (``all_of``) or
        on any. One collective over this channel's group for all of them; every rank must call it alike."""
        # MIN of x is "all"; MIN of -x is -"any"
        values = [(1.0 if f else 0.0) if all_of else -(1.0 if f else 0.0) for f, all_of in flags]
        t = torch.tensor(values, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [(v > 0.5) if all_of else (v < -0.5) for v, (_, all_of) in zip(t.tolist(), flags)]

    @staticmethod
    def wait(work: Any, timeout_s: float) -> None:
        """Wait for a transfer; raises ``TimeoutError`` if the peer never delivered."""
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise TimeoutError(f"migration transfer did not complete within {timeout_s:.0f} s") from e
            raise
