"""What moving layers to and from other ranks needs from the rank, and nothing more.

The layer manager hands a :class:`MoveLink` to :mod:`vpipe.migration.rounds` and
:mod:`vpipe.migration.stream` instead of itself: they talk through it, build arriving
blocks with it and ask it to pack leaving ones, while the placement, the epoch and the
block containers stay with the manager, the one place that changes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vpipe.migration.handshake import NO_FAULTS, BlockBuilder, FaultHook, Messenger
from vpipe.migration.moves import Move
from vpipe.migration.patience import RoundClock
from vpipe.migration.state import LayerState
from vpipe.migration.transfer import TransferChannel

__all__ = ["MoveLink", "Packer"]

# the states of a move's leaving layers, manifests described for the target (with optimizer state when the
# flag is set); ValueError naming why one of them cannot move
Packer = Callable[[Move, bool], list[LayerState]]


@dataclass(frozen=True)
class MoveLink:
    """One rank's end of its moves: the two channels, who runs each stage, patience, packing and building."""

    messenger: Messenger  # control messages: the handshake
    channel: TransferChannel  # payloads and the round's vote
    stage_ranks: tuple[int, ...]
    timeout_s: float  # how long one handshake message may take (the migration patience)
    builder: BlockBuilder  # empty blocks for arriving layers
    optimizer: torch.optim.Optimizer | None  # takes the arriving layers' state
    pack: Packer
    clock: RoundClock  # the round's: every wait of it, the vote included, ends within the group's timeout
    faults: FaultHook = NO_FAULTS

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def rank_of(self, stage: int) -> int:
        return self.stage_ranks[stage]
