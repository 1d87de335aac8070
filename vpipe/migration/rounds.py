"""One round of neighbour moves with other ranks, up to the vote: announce, build, send, receive, acknowledge.

The layer manager splits a round's moves into those leaving this rank, those arriving and
those between two of its own stages. :func:`exchange` runs the first five phases of the
handshake (:mod:`vpipe.migration.layer_manager` draws it) for the moves that cross ranks
and says whether every one of them went through here. It sees the rank only through a
:class:`~vpipe.migration.link.MoveLink`: the vote that commits the round, and the block
edits that follow it, stay with the manager, which owns the blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vpipe.log import decision
from vpipe.migration.handshake import (
    Incoming,
    MigrationError,
    announce,
    await_ready,
    move_key,
    receive_prepare,
    refuse_move,
)
from vpipe.migration.link import MoveLink
from vpipe.migration.moves import Move
from vpipe.migration.state import LayerState, load_layer, payload_bytes
from vpipe.migration.transfer import MOVE, TransferChannel, transfer_tag
from vpipe.stage.optimizers import part_of

log = logging.getLogger("vpipe.migration")

__all__ = ["MigrationReport", "exchange"]


@dataclass
class MigrationReport:
    """What one plan's moves did; ``placement``: where the layers are after them (the caller records it)."""

    epoch: int
    placement: tuple[tuple[int, ...], ...] = ()
    moved: list[Move] = field(default_factory=list)
    aborted: list[Move] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    rebuilt: bool = False


def exchange(link: MoveLink, epoch: int, r: int, outgoing: Sequence[Move], incoming: Sequence[Move],
             report: MigrationReport) -> tuple[bool, list[Incoming]]:
    """Phases 1-5 of round ``r`` for the moves leaving (``outgoing``) and reaching (``incoming``) this rank:
    whether each went through here, and what arrived (built, its payload received and acknowledged)."""
    ok = True
    # phase 1: announce what leaves this rank
    sent_states: dict[Move, list[LayerState]] = {}
    for m in outgoing:
        try:
            states = link.pack(m, True)
        # a block or state a move cannot carry: the target hears why, the round aborts
        except ValueError as e:
            refuse_move(link.messenger, m, link.rank_of(m.dst), move_key(epoch, r, m), str(e))
            ok = False
            continue
        sent_states[m] = states
        announce(link.messenger, m, link.rank_of(m.dst), [st.manifest for st in states],
                 move_key(epoch, r, m))
    # phase 2: build what arrives (on the meta device, then empty storage: no init cost)
    arriving = [receive_prepare(link.messenger, link.builder, m, link.rank_of(m.src), move_key(epoch, r, m),
                                link.clock.wait_s(), link.faults) for m in incoming]
    # phase 3: send each payload once its target is ready
    works = []
    for m in sent_states:
        key = move_key(epoch, r, m)
        if not await_ready(link.messenger, m, link.rank_of(m.dst), key, link.clock.wait_s(),
                           abort_on_silence=True):
            ok = False
            continue
        payload = torch.cat([st.payload for st in sent_states[m]])
        link.messenger.send_to(link.rank_of(m.dst), "migrate_transfer",
                               {"round": r, "move": key[2], "nbytes": int(payload.numel())}, epoch=epoch)
        works.append((m, link.channel.send(payload, link.rank_of(m.dst), _tag(link, key)), payload))
    # phase 4: receive payloads and acknowledge them
    for inc in arriving:
        if inc.ok:
            _receive_payload(link, inc, move_key(epoch, r, inc.move), report)
        ok = ok and inc.ok
    for m, work, payload in list(works):
        try:
            TransferChannel.wait(work, link.clock.remaining_s())
        except TimeoutError as e:  # the target stopped taking it: no ack will come
            log.warning("rank %d: layers %s to stage %d: %s", link.rank_of(m.src), list(m.layers), m.dst, e)
            works.remove((m, work, payload))
            ok = False
            continue
        report.bytes_sent += int(payload.numel())
    # phase 5: the sources collect the acknowledgements
    for m, _work, _payload in works:
        answer = link.messenger.wait_for({"migrate_ack", "migrate_abort"}, from_rank=link.rank_of(m.dst),
                                         key=move_key(epoch, r, m), timeout_s=link.clock.wait_s())
        if answer is None or answer[0] != "migrate_ack":
            log.warning("rank %d: no migrate_ack from stage %d for layers %s; aborting", link.rank_of(m.src),
                        m.dst,
                        list(m.layers))
            ok = False
    return ok, arriving


def _tag(link: MoveLink, key: tuple[int, int, int]) -> int:
    """The payload's transfer tag: unique per move of a round (a receive left behind by an aborted round
    cannot take a later round's bytes)."""
    epoch, round_index, move = key
    return transfer_tag(epoch, MOVE, (round_index * 2 * link.num_stages + move) % 10_000)


def _receive_payload(link: MoveLink, inc: Incoming, key: tuple[int, int, int],
                     report: MigrationReport) -> None:
    m, src = inc.move, link.rank_of(inc.move.src)
    got = link.messenger.wait_for({"migrate_transfer", "migrate_abort"}, from_rank=src, key=key,
                                  timeout_s=link.clock.wait_s(2))
    if got is None or got[0] == "migrate_abort":
        inc.ok = False
        return
    nbytes = sum(payload_bytes(man) for man in inc.manifests)
    if got[1].get("nbytes") != nbytes:
        raise MigrationError(f"stage {m.dst}: stage {m.src} sends {got[1].get('nbytes')} bytes, "
                             f"the manifests describe {nbytes}")
    buf, work = link.channel.recv(nbytes, src, _tag(link, key))
    try:
        TransferChannel.wait(work, link.clock.remaining_s())
    except TimeoutError as e:  # the source stopped sending: the round aborts (if the vote can still be held)
        log.warning("stage %d: layers %s from stage %d: %s", m.dst, list(m.layers), m.src, e)
        inc.ok = False
        return
    buf = buf.cpu()
    offset = 0
    for man in inc.manifests:
        size = payload_bytes(man)
        inc.states.append(LayerState(man["layer"], man, buf[offset:offset + size]))
        offset += size
    report.bytes_received += nbytes
    try:  # before the acknowledgement: a state this stage cannot load aborts the move, the source keeps it
        optimizer = part_of(link.optimizer, m.dst)
        inc.loaded = [load_layer(st, inc.modules[st.layer_id], optimizer) for st in inc.states]
    except ValueError as e:
        decision("migration_refused", f"stage {m.dst} cannot load layers {list(m.layers)}: {e}",
                 stage=m.dst, layers=list(m.layers), reason=str(e))
        link.messenger.send_to(src, "migrate_abort", {"round": key[1], "move": key[2],
                                                      "reason": str(e)[:200]},
                               epoch=key[0])
        inc.ok = False
        return
    link.messenger.send_to(src, "migrate_ack", {"round": key[1], "move": key[2]}, epoch=key[0])
