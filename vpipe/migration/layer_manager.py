"""The layer manager of one rank: which layers its stages hold, and moving them to neighbouring stages.

A plan (with an epoch) is diffed against the placement it is handed into rounds of neighbour moves
(:mod:`vpipe.migration.moves`), and the placement reached is returned. A move between two stages this
rank runs (the multi-stage schedules) re-parents the blocks locally, with nothing sent. A move to another
rank is an exchange over the control plane, the tensors travelling over the migration group
(:mod:`.transfer`)::

    source                                   target
      migrate_prepare (manifests) ------->     build the layers (meta device, no init cost)
                      <------------------      migrate_ready
      migrate_transfer + isend(payload) -->    irecv(payload)
                      <------------------      migrate_ack
      ============ vote of all ranks: did every move of the round get its ack? ============
      yes: drop the layers                     insert the layers, register them with the optimizer
      no:  keep the layers                     discard what it built

The vote is the commit: a move that fails leaves the old placement everywhere and loses nothing. The
phases up to the vote run in :mod:`.rounds`; the vote and the block edits (and the carried averages',
:mod:`.carried`) are here, each block edit carried out with what follows it by :mod:`.block_edits`;
streamed PipeDream moves go on in :mod:`.stream`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vpipe.log import decision
from vpipe.migration.block_edits import BlockEdits, LayerListener
from vpipe.migration.carried import CarriedState
from vpipe.migration.cloning import block_info
from vpipe.migration.handshake import (
    NO_FAULTS,
    BlockBuilder,
    FaultHook,
    Incoming,
    LayerFactory,
    Messenger,
    MigrationError,
)
from vpipe.migration.link import MoveLink
from vpipe.migration.moves import Move, apply_round, plan_rounds
from vpipe.migration.namesakes import join_groups
from vpipe.migration.patience import RoundClock, patience_s
from vpipe.migration.placement import Placement
from vpipe.migration.rounds import MigrationReport, exchange
from vpipe.migration.shapes import BoundaryShapes
from vpipe.migration.state import LayerState, pack_layer
from vpipe.migration.stream import WatchShapes, check_idle, start_round
from vpipe.migration.transfer import TransferChannel
from vpipe.plan import Plan
from vpipe.stage.blocks import StageBlocks
from vpipe.stage.fsdp import resharded
from vpipe.stage.optimizers import group_refusal, part_of
from vpipe.stage.pins import pin_reason

__all__ = ["LayerManager", "MigrationReport", "MigrationError", "Messenger"]


class LayerManager:
    """Holds the blocks of this rank's stages by global id and applies placement plans by neighbour moves.

    ``blocks`` maps each stage this rank runs to its block container
    (:class:`~vpipe.stage.blocks.StageBlocks`, or an ``nn.Sequential`` whose children are
    named by layer id), edited in place, never replaced. ``stage_ranks`` gives the rank of
    every stage (default: stage ``v`` on rank ``v``). A block that arrives from another
    rank is built by ``factory(id, spec)`` when there is one (``specs`` maps layer ids to
    specs, which travel with moved layers), else cloned from a local block of the same kind
    and given the moved block's plain attributes. One optimizer holds the parameters of all
    of this rank's stages, or an :class:`~vpipe.stage.optimizers.OptimizerParts` holds one per stage.

    The placement is not kept here: its one owner is the plan in force
    (:class:`vpipe.rank.plan_in_force.PlanInForce`), which hands it to each call that moves or
    edits layers (``start``) and records the placement the call returns. A plan given to
    :meth:`apply` or :meth:`start_streamed` has been checked against that placement and found
    newer than the plan in force: the layer manager trusts it. ``placement`` at construction
    only checks the blocks. ``epoch`` is the plan in force's, as its owner tells it
    (:meth:`plan_changed`). ``shared``: the blocks
    that never move to another rank (they share a module or tensor), and why; ``listeners``:
    per local stage, the parts that follow its layers (tensor manager, monitor); ``carry``: the weight
    averages that move with the blocks (:mod:`vpipe.migration.carried`).
    """

    def __init__(
        self,
        blocks: Mapping[int, StageBlocks | nn.Sequential] | StageBlocks | nn.Sequential,
        *,
        placement: Sequence[Sequence[int]],
        optimizer: torch.optim.Optimizer | None,
        factory: LayerFactory | None,
        specs: Mapping[int, Any] | None,
        messenger: Messenger,
        channel: TransferChannel,
        device: torch.device,
        stage_ranks: Sequence[int] | None = None,
        stage_index: int | None = None,
        timeout_s: float = 30.0,
        epoch: int = 0,
        faults: FaultHook = NO_FAULTS,
        shared: Mapping[int, str] | None = None,
        listeners: Mapping[int, Sequence[LayerListener]] | None = None,
        carry: CarriedState | None = None,
    ) -> None:
        if not isinstance(blocks, Mapping):
            if stage_index is None:
                raise ValueError("a single block container needs stage_index=")
            blocks = {stage_index: blocks}
        self.blocks: dict[int, StageBlocks] = {v: StageBlocks.keyed_by_ids(b) if isinstance(b, nn.Sequential)
                                               else b
                                               for v, b in sorted(blocks.items())}
        initial = Placement.of(placement, stage_ranks)
        self.stage_ranks = initial.stage_ranks
        self.optimizer = optimizer
        self.specs: dict[int, Any] = dict(specs or {})
        self.builder = BlockBuilder(self.blocks, factory, self.specs, device)
        self.messenger = messenger
        self.channel, self.device, self.timeout_s, self.epoch, self.faults = (channel, device, timeout_s,
                                                                              epoch, faults)
        self.carry = carry if carry is not None else CarriedState()  # averages beside the stages, on_move
        self.listeners: dict[int, list[LayerListener]] = {
            v: [*(listeners or {}).get(v, ()), self.carry.follower(v)] for v in self.blocks}
        self.shared: dict[int, str] = dict(shared or {})
        self.next_layer_id = max(initial.order) + 1
        for v, stage_blocks in self.blocks.items():  # checked before any hook goes on: a refusal leaves none
            if stage_blocks.ids != list(initial.stages[v]):
                raise ValueError(f"stage {v} holds layers {stage_blocks.ids} but the placement says "
                                 f"{list(initial.stages[v])}")
        ranks = {initial.rank_of(v) for v in self.blocks}
        if len(ranks) != 1:
            raise ValueError(f"the local stages {sorted(self.blocks)} run on ranks "
                             f"{sorted(ranks)}, not on one")
        self.rank = ranks.pop()
        self.shapes = BoundaryShapes()
        for lid, layer in ((lid, layer) for b in self.blocks.values() for lid, layer in b.blocks().items()):
            self.shapes.watch(lid, layer)

    # ---------------------------------------------------------------- queries
    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def local_stages(self) -> list[int]:
        return list(self.blocks)

    @property
    def stage_index(self) -> int:
        """The one stage of a single-stage rank (PipeDream streams have one)."""
        if len(self.blocks) != 1:
            raise ValueError(f"this rank runs stages {self.local_stages}, not one")
        return next(iter(self.blocks))

    @property
    def layer_ids(self) -> list[int]:
        """This rank's layers, stage by stage, in model order."""
        return [lid for v in self.blocks for lid in self.blocks[v].ids]

    def layers_of(self, stage: int) -> list[int]:
        return self.blocks[stage].ids

    def close(self) -> None:
        self.shapes.close()
        if self.channel is not None:
            self.channel.close()

    # ---------------------------------------------------------------- plans
    def plan_changed(self, plan: Plan, cause: str) -> None:
        """The plan in force changed (its owner tells): its epoch is this manager's."""
        self.epoch = plan.epoch

    def _involved(self, moves: Iterable[Move]) -> list[Move]:
        return [m for m in moves if m.src in self.blocks or m.dst in self.blocks]

    def apply(self, plan: Plan, start: Sequence[Sequence[int]]) -> MigrationReport:
        """Move layers from placement ``start`` until this rank's stages hold their part of ``plan``.

        Every rank calls this at the same step boundary with the same plan: the rounds end
        with a collective vote, so all ranks agree on what moved even when a move aborts. The
        report's ``placement`` is where the layers are now (``plan``'s, or the last agreed one).
        """
        report = MigrationReport(epoch=plan.epoch, placement=Placement.of(start, self.stage_ranks).stages)
        started = time.perf_counter()
        rounds = plan_rounds(report.placement, plan.stages)
        mine = self._involved(m for moves in rounds for m in moves)
        if mine:
            decision("migration_start", f"epoch {plan.epoch}: {len(mine)} move(s) involving rank {self.rank}",
                     epoch=plan.epoch, stage=self.local_stages[0], stages=self.local_stages,
                     moves=[{"src": m.src, "dst": m.dst, "layers": list(m.layers)} for m in mine])
        for r, moves in enumerate(rounds):
            if not self._run_round(plan.epoch, r, moves, report):
                break  # later rounds assumed this one: stay at the last agreed placement
        report.seconds = time.perf_counter() - started
        if mine:
            decision("migration_done",
                     f"epoch {plan.epoch}: rank {self.rank} moved {len(report.moved)}, aborted "
                     f"{len(report.aborted)}",
                     epoch=plan.epoch, stage=self.local_stages[0], stages=self.local_stages,
                     seconds=report.seconds,
                     bytes_sent=report.bytes_sent, bytes_received=report.bytes_received,
                     moved=[list(m.layers) for m in report.moved],
                     aborted=[list(m.layers) for m in report.aborted],
                     layers=self.layer_ids, rebuilt=report.rebuilt)
        return report

    def rank_of(self, stage: int) -> int:
        return self.stage_ranks[stage]

    def _link(self) -> MoveLink:
        """What the exchanges with other ranks may use of this manager, with a
        clock for one round (made per round: fields may be swapped). The round ends
        within the transfer group's timeout, the trainer's."""
        limit = self.channel.timeout_s
        patience = patience_s(self.timeout_s, limit)
        return MoveLink(self.messenger, self.channel, self.stage_ranks, patience, self.builder,
                        self.optimizer, self._pack, RoundClock(limit, patience), self.faults)

    def _pack(self, move: Move, with_state: bool) -> list[LayerState]:
        """The leaving layers of ``move`` and what the target needs to rebuild each block (kind, key, plain
        attributes, boundary shapes); their optimizer state too when ``with_state`` (a streamed move
        sends its state at the hand-over). ``ValueError`` names a block that cannot
        move to another rank (shared, hooked)."""
        blocks = self.blocks[move.src]
        children = blocks.blocks()
        for lid in move.layers:
            reason = pin_reason(lid, children[lid], self.shared)
            if reason is not None:
                raise ValueError(f"layer {lid} {reason}")
        optimizer = part_of(self.optimizer, move.src) if with_state else None
        states = [pack_layer(lid, resharded(children[lid]), optimizer, self.specs.get(lid),
                             self.carry.pack(move.src, lid)) for lid in move.layers]
        for st in states:
            st.manifest["block"] = block_info(children[st.layer_id], blocks.key_of(st.layer_id))
            st.manifest.update(self.shapes.describe(st.layer_id))
        return states

    def _run_round(self, epoch: int, r: int, moves: Sequence[Move], report: MigrationReport) -> bool:
        """One round of moves from ``report.placement``; True if every move of the round went through on
        every rank (and ``report.placement`` is the round's)."""
        local = self.blocks
        outgoing = [m for m in moves if m.src in local and m.dst not in local]
        incoming = [m for m in moves if m.dst in local and m.src not in local]
        within = [m for m in moves if m.src in local and m.dst in local]
        # phases 1-5: the exchange with the other ranks (announce, build, send, receive, acknowledge)
        link = self._link()
        ok, arriving = exchange(link, epoch, r, outgoing, incoming, report)
        ok = self._can_move_within(within) and ok
        # phase 6: one vote decides the whole round on every rank, then both sides act on it; the
        # same collective tells whether a boundary activation changes (every rank must redo shape inference)
        before = report.placement
        after = apply_round(before, moves)
        ok, changed = self.channel.vote([(ok, True), (self._output_changes(before, after, arriving), False)],
                                        timeout_s=link.clock.vote_s(),
                                        what=f"the move of epoch {epoch} (round {r})")
        if not ok:
            report.aborted.extend(self._involved(moves))
            decision("migration_aborted",
                     f"epoch {epoch} round {r}: a move failed; every stage keeps its layers",
                     epoch=epoch, round=r, stage=self.local_stages[0])
            return False
        edits = self._edits()
        for m in outgoing:
            edits.drop(m.src, m.layers)
        moved_here = [(m, edits.take(m.src, m.layers)) for m in within]
        for inc in arriving:
            edits.insert(inc)
        for m, entries in moved_here:
            edits.move(m, entries)
        report.placement = Placement.of(after, self.stage_ranks).stages
        report.moved.extend(self._involved(moves))
        report.rebuilt = report.rebuilt or changed
        return True

    def _can_move_within(self, moves: Sequence[Move]) -> bool:
        """Whether every move between two of this rank's stages
        finds its param groups there (before the vote)."""
        for m in moves:
            params = [p for lid in m.layers for p in self.blocks[m.src].blocks()[lid].parameters()]
            reason = group_refusal(part_of(self.optimizer, m.src), part_of(self.optimizer, m.dst), params)
            if reason is not None:
                decision("migration_refused", f"stage {m.dst} cannot take layers {list(m.layers)}: {reason}",
                         stage=m.dst, layers=list(m.layers), reason=reason)
                return False
        return True

    def _output_changes(self, before: Sequence[Sequence[int]], after: Sequence[Sequence[int]],
                        arriving: Sequence[Incoming]) -> bool:
        """Whether this round changes what one of this rank's stages
        sends downstream (shape, dtype, arity)."""
        manifests = {man["layer"]: man for inc in arriving for man in inc.manifests}
        return any(self.shapes.last_output_changes(before[v], after[v], manifests)
                   for v in self.blocks if v != self.num_stages - 1)

    # ---------------------------------------------------------------- streamed moves (PipeDream, 2BW, WPipe)
    def start_streamed(self, plan: Plan, start: Sequence[Sequence[int]], schedule: Any,
                       switch_mb: int) -> tuple[list[Any], tuple[tuple[int, ...], ...]]:
        """Begin moving from ``start`` towards ``plan`` in a running stream, switching at ``switch_mb``: every
        rank at the same step boundary before that step, one round of neighbour hops a call. Returns the
        movers (none when the round aborted) and the placement reached at once: streamed blocks switch in the
        stream, those of a stage it does not stream (WPipe's G1) move here, at the step boundary."""
        check_idle(schedule)
        before = Placement.of(start, self.stage_ranks).stages
        rounds = plan_rounds(before, plan.stages)
        if not rounds:
            return [], before
        streamed = [m for m in rounds[0] if schedule.streams_stage(m.src)]
        s = next(v for v in self.blocks if schedule.streams_stage(v))
        whole, part = apply_round(before, rounds[0]), apply_round(before, streamed)
        shaped = any(self.shapes.boundary_changed(v, before, whole) for v in self.blocks)
        movers = start_round(self._link(), schedule, switch_mb, plan.epoch, streamed, stage=s,
                             blocks=self.blocks[s], listeners=[WatchShapes(self.shapes), *self.listeners[s]],
                             device=self.device, reshapes=shaped)
        if movers is None:
            return [], before
        report = MigrationReport(plan.epoch, Placement.of(part, self.stage_ranks).stages)
        at_boundary = [m for m in rounds[0] if not schedule.streams_stage(m.src)]
        if at_boundary:  # every rank sees the same round, joins its vote; round 0 keeps the stream's current
            self._run_round(plan.epoch, 0, at_boundary, report)
        return movers, report.placement

    # ---------------------------------------------------------------- adding and removing layers
    def add_layers(self, start: Sequence[Sequence[int]], position: int, specs: Sequence[Any],
                   namesakes: Mapping[str, Any] | None = None) -> tuple[list[int],
                                                                        tuple[tuple[int, ...], ...]]:
        """Insert new layers before model position ``position`` of placement ``start`` (0 = first;
        every rank calls it alike): fresh ids (never reused), on the stage holding the layer at
        ``position`` (the last when appending), built by the factory, each parameter in the group its
        namesake in the nearest block alike trains in (``namesakes``: every rank's
        :func:`.namesakes.group_table`). Returns the new ids and the placement."""
        before = Placement.of(start, self.stage_ranks)
        if not specs:
            return [], before.stages
        first_new = max(self.next_layer_id, max(before.order) + 1)
        new_ids = list(range(first_new, first_new + len(specs)))
        placement, owner, at = before.with_added(position, new_ids)
        if owner in self.blocks:
            if self.builder.factory is None:
                raise ValueError("adding layers needs layer_factory= in the vpipe config to build them")
            built = [(lid, self.builder.factory(lid, spec).to(self.device))
                     for lid, spec in zip(new_ids, specs)]
            optimizer = part_of(self.optimizer, owner)
            joins = [j for lid, layer in built for j in join_groups(optimizer, layer, lid, placement.order,
                                                                   namesakes or {})]
            self.blocks[owner].insert(at, [(lid, layer, str(lid)) for lid, layer in built])
            for p, g in joins:
                optimizer.param_groups[g]["params"].append(p)  # type: ignore[union-attr]
            edits = self._edits()
            for lid, layer in built:
                edits.welcome(owner, lid, layer)
            self.carry.arrived(owner, dict(built), None)
        self.specs.update(zip(new_ids, specs))
        self.next_layer_id = max(new_ids) + 1
        decision("layers_added", f"{len(new_ids)} layer(s) added to stage {owner} at position {position}",
                 stage=owner, layers=new_ids, position=position, placement=placement.as_lists())
        return new_ids, placement.stages

    def remove_layers(self, start: Sequence[Sequence[int]],
                      layer_ids: Iterable[int]) -> tuple[bool, tuple[tuple[int, ...], ...]]:
        """Remove layers by id from placement ``start`` (every rank calls it alike; no stage
        left empty); whether any stage now sends another activation downstream (voted: every
        rank learns it alike), and the placement without them."""
        doomed = set(layer_ids)
        placement = Placement.of(start, self.stage_ranks).without(doomed)
        reshapes = self.channel.vote([(any(self.shapes.last_output_changes(start[v], placement.stages[v], {})
                                           for v in self.blocks if v != self.num_stages - 1), False)],
                                     what="a layer removal")[0]
        edits = self._edits()
        for v in self.blocks:
            edits.drop(v, [lid for lid in self.blocks[v].ids if lid in doomed])
        for lid in doomed:
            self.specs.pop(lid, None)
            self.shapes.forget(lid)
        decision("layers_removed", f"{len(doomed)} layer(s) removed", layers=sorted(doomed),
                 placement=placement.as_lists())
        return reshapes, placement.stages

    def _edits(self) -> BlockEdits:
        """Edits of this rank's blocks with everything that follows them (made per edit: fields may be
        swapped)."""
        return BlockEdits(self.blocks, self.listeners, self.optimizer, self.shapes, self.carry, self.specs)
