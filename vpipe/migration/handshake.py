"""The first half of every move between ranks: announce the layers, build them, say ready.

Both ways of moving (at a step boundary, and streamed inside a PipeDream stream) begin the
same: the source sends ``migrate_prepare`` with one manifest per layer (tensor names,
shapes, dtypes, the block's kind and plain attributes); the target builds empty blocks for
them (by the layer factory, or by cloning a local block of the same kind) and answers
``migrate_ready``, or ``migrate_abort`` when it cannot build them. What follows differs
(a payload now, or weight versions and a hand-over later), so it stays with the callers.

Every message of a move carries its round and a move number (:func:`move_key`), so two
moves between the same two ranks in one round (a rank with two virtual stages next to
another rank's) never take each other's messages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from vpipe.log import decision
from vpipe.migration.cloning import clone_block, set_block_attrs
from vpipe.migration.moves import Move
from vpipe.migration.state import LayerState, LoadedLayer, validate_manifest
from vpipe.stage.blocks import StageBlocks
from vpipe.stage.kinds import block_kind

log = logging.getLogger("vpipe.migration")

__all__ = ["Messenger", "MigrationError", "Incoming", "BlockBuilder", "move_key", "announce", "refuse_move",
           "receive_prepare", "await_ready", "FaultHook", "NO_FAULTS"]

LayerFactory = Callable[[int, Any], nn.Module]
# called at the named points of a move ("prepare_received"); True: act as a peer that went silent
FaultHook = Callable[[str], bool]


def NO_FAULTS(point: str) -> bool:  # noqa: N802 - a constant-like default
    return False


class MigrationError(RuntimeError):
    """A migration that cannot complete safely (the run must stop, nothing was dropped)."""


class Messenger(Protocol):
    """The control-plane operations a migration needs (see
    :class:`vpipe.migration.messages.ControlMessenger`)."""

    def send_to(self, peer: int, type: str, body: dict[str, Any], *, epoch: int) -> None: ...

    def wait_for(self, types: set[str], *, from_rank: int, key: tuple[int, int, int],
                 timeout_s: float) -> tuple[str, dict[str, Any]] | None: ...


def move_key(epoch: int, round_index: int, move: Move) -> tuple[int, int, int]:
    """The key both ends of ``move`` use for its messages: (epoch, round, move number)."""
    return epoch, round_index, 2 * move.src + (1 if move.forward else 0)


@dataclass
class Incoming:
    """A move arriving on this rank: its manifests, the blocks built for it, and (later) their states."""

    move: Move
    manifests: list[dict[str, Any]]
    modules: dict[int, nn.Module]
    states: list[LayerState] = field(default_factory=list)
    loaded: list[LoadedLayer] = field(default_factory=list)  # states checked and copied into ``modules``
    ok: bool = True


class BlockBuilder:
    """Builds empty blocks for layers arriving on this rank: by the factory, else by cloning a local block."""

    def __init__(self, blocks: Mapping[int, StageBlocks], factory: LayerFactory | None, specs: dict[int, Any],
                 device: torch.device) -> None:
        self.blocks = blocks
        self.factory = factory
        self.specs = specs
        self.device = device

    def build(self, layer_id: int, spec: Any) -> nn.Module:
        """An empty layer from the factory (built on the meta device: no initialisation cost)."""
        assert self.factory is not None
        with torch.device("meta"):
            layer = self.factory(layer_id, spec)
        return layer.to_empty(device=self.device)

    def clone_for(self, manifest: dict[str, Any]) -> nn.Module:
        """An empty block for ``manifest``, cloned from a local block of the same kind."""
        lid, info = manifest["layer"], manifest.get("block")
        if not isinstance(info, dict):
            raise MigrationError(f"layer {lid} arrives without a description of its block, and there is no "
                                 "layer_factory")
        donor = next((b for blocks in self.blocks.values() for b in blocks.blocks().values()
                      if block_kind(b) == info["kind"]), None)
        if donor is None:
            raise MigrationError(f"this rank has no block of kind {info['kind']} to build layer {lid} from; "
                                 "pass layer_factory= to vpipe.attach for models whose blocks differ")
        block = clone_block(donor)
        try:
            set_block_attrs(block, info["attrs"], lid)
        except ValueError as e:
            raise MigrationError(str(e)) from None
        return block

    def for_manifests(self, manifests: Sequence[dict[str, Any]],
                      early: dict[int, nn.Module]) -> dict[int, nn.Module]:
        modules = {}
        for man in manifests:
            lid = man["layer"]
            if self.factory is None:
                modules[lid] = self.clone_for(man)
                continue
            same_spec = lid in early and man.get("spec") in (None, self.specs.get(lid))
            modules[lid] = early[lid] if same_spec else self.build(lid, man.get("spec"))
        return modules


def announce(messenger: Messenger, move: Move, dst_rank: int, manifests: list[dict[str, Any]],
             key: tuple[int, int, int]) -> None:
    """Source side: tell the target which layers come, with their manifests."""
    messenger.send_to(dst_rank, "migrate_prepare",
                      {"round": key[1], "move": key[2], "src": move.src, "dst": move.dst,
                       "layers": list(move.layers),
                       "manifests": manifests}, epoch=key[0])


def refuse_move(messenger: Messenger, move: Move, dst_rank: int, key: tuple[int, int, int],
                reason: str) -> None:
    """Source side: the layers cannot move (pinned, or state that
    cannot travel); one line, and the target hears it."""
    decision("migration_refused", f"stage {move.src} cannot send layers {list(move.layers)}: {reason}",
             stage=move.src, layers=list(move.layers), reason=reason)
    messenger.send_to(dst_rank, "migrate_abort", {"round": key[1], "move": key[2], "reason": reason[:200]},
                      epoch=key[0])


def receive_prepare(messenger: Messenger, builder: BlockBuilder, move: Move, src_rank: int,
                    key: tuple[int, int, int], timeout_s: float, faults: FaultHook = NO_FAULTS) -> Incoming:
    """Target side: take the announcement, build the blocks, answer ready (or abort, naming why)."""
    # the plan names the layers: build those whose spec we know while the source packs them
    early = ({lid: builder.build(lid, builder.specs[lid]) for lid in move.layers if lid in builder.specs}
             if builder.factory is not None else {})
    got = messenger.wait_for({"migrate_prepare", "migrate_abort"}, from_rank=src_rank, key=key,
                             timeout_s=timeout_s)
    if got is None or got[0] == "migrate_abort":
        log.warning("stage %d: no migrate_prepare from stage %d for layers %s", move.dst, move.src,
                    list(move.layers))
        return Incoming(move, [], {}, ok=False)
    if faults("prepare_received"):
        log.warning("stage %d: fault injected: ignoring migrate_prepare from stage %d", move.dst, move.src)
        return Incoming(move, [], {}, ok=False)
    body = got[1]
    if body.get("layers") != list(move.layers) or body.get("src") != move.src or body.get("dst") != move.dst:
        raise MigrationError(f"stage {move.dst}: stage {move.src} announced layers {body.get('layers')} "
                             f"but the plan moves {list(move.layers)}")
    manifests = [validate_manifest(man) for man in body.get("manifests", [])]
    if [man["layer"] for man in manifests] != list(move.layers):
        raise MigrationError(f"stage {move.dst}: manifests do not match the moved layers {list(move.layers)}")
    try:
        modules = builder.for_manifests(manifests, early)
    except MigrationError as e:
        decision("migration_refused", f"stage {move.dst} cannot build layers {list(move.layers)}: {e}",
                 stage=move.dst, layers=list(move.layers), reason=str(e))
        messenger.send_to(src_rank, "migrate_abort", {"round": key[1], "move": key[2],
                                                      "reason": str(e)[:200]},
                          epoch=key[0])
        return Incoming(move, [], {}, ok=False)
    messenger.send_to(src_rank, "migrate_ready", {"round": key[1], "move": key[2]}, epoch=key[0])
    return Incoming(move, manifests, modules)


def await_ready(messenger: Messenger, move: Move, dst_rank: int, key: tuple[int, int, int], timeout_s: float,
                *, abort_on_silence: bool) -> bool:
    """Source side: whether the target said ready (a silent one gets an abort when ``abort_on_silence``)."""
    answer = messenger.wait_for({"migrate_ready", "migrate_abort"}, from_rank=dst_rank, key=key,
                                timeout_s=timeout_s)
    if answer is not None:
        return answer[0] == "migrate_ready"
    log.warning("stage %d: no migrate_ready from stage %d for layers %s", move.src, move.dst,
                list(move.layers))
    if abort_on_silence:
        messenger.send_to(dst_rank, "migrate_abort", {"round": key[1], "move": key[2], "reason": "no ready"},
                          epoch=key[0])
    return False
