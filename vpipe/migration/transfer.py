"""The tensor side of a migration: one flat payload per move over a process group of its own.

Migration payloads travel over ``torch.distributed`` (gloo on CPU, NCCL on GPU) on a
dedicated group, so they never interleave with the schedule's activation and gradient
sends. Every transfer has a tag both sides derive from the plan (epoch, round, direction),
so a receive left behind by an aborted move can never swallow a later move's bytes.

Nothing here waits longer than the trainer's own process-group timeout: the group is made
with the default group's timeout (``new_group()`` alone would get torch's 30 minutes), and a
vote may be given less (:mod:`vpipe.migration.patience`). A vote that fails names the ranks
that never reached it (:class:`SilentPeerError`).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from vpipe.compat.torch_distributed import group_timeout_s, set_group_timeout
from vpipe.migration.handshake import MigrationError
from vpipe.migration.patience import VoteMarks

__all__ = ["TransferChannel", "SilentPeerError", "transfer_tag", "MOVE", "VERSION", "HANDOVER"]

MOVE, VERSION, HANDOVER = 0, 1, 2  # kinds of transfer


def transfer_tag(epoch: int, kind: int, index: int) -> int:
    """A gloo/NCCL tag unique per (epoch, kind, index) and below 2**31.

    ``index`` is the round and direction of a step-boundary move (``MOVE``), or the weight
    version of a streamed PipeDream move (``VERSION``), or 0 for its final hand-over.
    """
    if not 0 <= index < 10_000 or kind not in (MOVE, VERSION, HANDOVER):
        raise ValueError(f"bad transfer tag parts: kind {kind}, index {index}")
    return (epoch % 20_000) * 100_000 + kind * 10_000 + index


class SilentPeerError(MigrationError):
    """A peer stopped answering in the middle of a move or a vote: this rank cannot tell what the others
    decided, so it stops (before acting: no layer was dropped or taken here)."""


class TransferChannel:
    """Point-to-point payload transfers between neighbouring stages, and the votes that commit a move.

    Creating one is a collective call: every rank of the run must create it at the same
    point (vpipe does so when it attaches). Its group spans the whole world, so the vote of a
    move is taken by every data-parallel replica of the pipeline together: one that cannot
    apply a plan makes every replica skip it. Peers are named by their rank in the pipeline's
    own group; ``world_ranks[r]`` is the world rank of pipeline rank ``r`` (default: the same).
    ``timeout_s`` bounds every collective of the group (default: the default group's timeout, the
    trainer's); ``marks`` (every rank's, in one shared store; their beat runs until :meth:`close`) name
    the ranks that miss a vote.
    """

    def __init__(self, device: torch.device, group: Any = None, world_ranks: Sequence[int] | None = None, *,
                 timeout_s: float | None = None, marks: VoteMarks | None = None) -> None:
        self.device = device
        self.timeout_s = timeout_s if timeout_s is not None else group_timeout_s(group)
        self.group = (
            group
            if group is not None
            else dist.new_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )
        )
        self.world_ranks = None if world_ranks is None else tuple(world_ranks)
        self.marks = marks
        if marks is not None:
            marks.start_beat()
        self.votes = 0  # every rank votes alike: the n-th vote is the same on every rank

    def close(self) -> None:
        if self.marks is not None:
            self.marks.close()

    def _world(self, rank: int) -> int:
        return rank if self.world_ranks is None else self.world_ranks[rank]

    def send(self, payload: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending to pipeline rank ``dst``; returns the work
        to wait on (keep ``payload`` alive until then)."""
        return dist.isend(payload.to(self.device), dst=self._world(dst), group=self.group, tag=tag)

    def recv(self, nbytes: int, src: int, tag: int) -> tuple[torch.Tensor, Any]:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf, dist.irecv(buf, src=self._world(src), group=self.group, tag=tag)

    def vote(self, flags: list[tuple[bool, bool]], *, timeout_s: float | None = None,
             what: str = "a vote") -> list[bool]:
        """Every rank learns, for each ``(flag, all_of)``, whether the flag holds on all ranks (``all_of``) or
        on any. One collective over this channel's group for all of them; every rank must call it alike.
        It waits at most ``timeout_s`` (at most the group's timeout), then raises :class:`SilentPeerError`
        naming the ranks that never reached it (``what``: the vote, for that line)."""
        self.votes += 1
        limit = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        if self.marks is not None:
            self.marks.arrive(self.votes)
        # MIN of x is "all"; MIN of -x is -"any"
        values = [(1.0 if f else 0.0) if all_of else -(1.0 if f else 0.0) for f, all_of in flags]
        t = torch.tensor(values, device=self.device)
        shortened = limit < self.timeout_s and set_group_timeout(self.group, limit)
        started = time.monotonic()
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
            got = t.tolist()
        except RuntimeError as e:
            raise SilentPeerError(self._silence(limit, time.monotonic() - started, what, e)) from e
        finally:
            if shortened:
                set_group_timeout(self.group, self.timeout_s)
        return [(v > 0.5) if all_of else (v < -0.5) for v, (_, all_of) in zip(got, flags)]

    def _silence(self, limit: float, waited: float, what: str, error: Exception) -> str:
        """The one line a failed vote ends with: who stopped (of the ranks that never came, those whose beat
        stood still), or the error when every rank came."""
        absent = None if self.marks is None else self.marks.absent(self.votes)
        if absent:
            silent = self.marks.silent(absent) or absent  # type: ignore[union-attr]
            busy = [r for r in absent if r not in silent]
            one = len(silent) == 1
            when = (f"within {limit:.0f} s" if waited >= limit - 1
                    else f"(the vote broke after {waited:.1f} s)")
            also = f"; {_ranks(busy)} (alive) had not reached it" if busy else ""
            return (f"{_ranks(silent)} stopped answering (dead or hung) during {what}: no vote from "
                    f"{'it' if one else 'them'} {when}{also}; stopping (no layer was dropped or taken here)")
        nobody = ("; the store did not say who is missing (its host may be the one)" if self.marks is not None
                  and absent is None else "")
        return (f"{what} failed after at most {limit:.0f} s "
                f"({str(error).splitlines()[0][:200]}){nobody}; stopping")

    @staticmethod
    def wait(work: Any, timeout_s: float) -> None:
        """Wait for a transfer at most ``timeout_s``; raises ``TimeoutError`` if the peer never delivered."""
        try:
            work.wait(datetime.timedelta(seconds=max(timeout_s, 0.001)))  # 0 would mean no timeout at all
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise TimeoutError(f"migration transfer did not complete within {timeout_s:.0f} s") from e
            raise


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
