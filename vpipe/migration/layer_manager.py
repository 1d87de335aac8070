"""The layer manager of one stage: which layers it holds, and moving them to neighbours.

A plan (with an epoch) is diffed against the current placement into rounds of neighbour
moves (:mod:`vpipe.migration.moves`). In a round every move is an exchange between two
neighbours over the control plane, the layer's tensors travelling over the migration
process group (:mod:`vpipe.migration.transfer`)::

    source                                   target
      migrate_prepare (manifests) ------->     build the layers (meta device, no init cost)
                      <------------------      migrate_ready
      migrate_transfer + isend(payload) -->    irecv(payload)
                      <------------------      migrate_ack
      ============ vote of all ranks: did every move of the round get its ack? ============
      yes: drop the layers                     insert the layers, register them with the optimizer
      no:  keep the layers                     discard what it built

The vote is the commit: no rank changes its layers before every rank knows the outcome,
so a move that fails (a peer that never answers in time) leaves the old placement
everywhere and loses nothing. Every phase waits only on an earlier phase of a peer, so a
round cannot deadlock; a peer that dies is caught by the run's watchdog.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from vpipe.log import decision
from vpipe.migration.blocks import KeyStyle, StageBlocks, block_attrs, block_kind, clone_block, set_block_attrs
from vpipe.migration.moves import Move, apply_round, plan_rounds
from vpipe.migration.state import LayerState, detach_from_optimizer, pack_layer, payload_bytes, unpack_layer, validate_manifest
from vpipe.migration.transfer import MOVE, TransferChannel, transfer_tag
from vpipe.planner.plan import Plan, PlanError
from vpipe.runtime import faults

log = logging.getLogger("vpipe.migration")

__all__ = ["LayerManager", "LayerListener", "MigrationReport", "MigrationError", "Messenger"]

LayerFactory = Callable[[int, Any], nn.Module]


class MigrationError(RuntimeError):
    """A migration that cannot complete safely (the run must stop, nothing was dropped)."""


class LayerListener(Protocol):
    """Parts that keep per-layer state (tensor manager, monitor) follow the placement."""

    def add_layer(self, layer_id: int, module: nn.Module) -> None: ...

    def remove_layer(self, layer_id: int) -> None: ...


class Messenger(Protocol):
    """The control-plane operations a migration needs (see :class:`vpipe.control.channel.ControlPlane`)."""

    def send_to(self, peer: int, type: str, body: dict[str, Any], *, epoch: int) -> None: ...

    def wait_for(self, types: set[str], *, from_rank: int, key: tuple[int, int], timeout_s: float) -> tuple[str, dict[str, Any]] | None: ...


@dataclass
class MigrationReport:
    epoch: int
    moved: list[Move] = field(default_factory=list)
    aborted: list[Move] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    rebuilt: bool = False


@dataclass
class _Incoming:
    move: Move
    manifests: list[dict[str, Any]]
    modules: dict[int, nn.Module]
    states: list[LayerState] = field(default_factory=list)
    ok: bool = True


class LayerManager:
    """Holds a stage's layers by global id and applies placement plans by neighbour moves.

    ``blocks`` is the stage's block container (:class:`~vpipe.migration.blocks.StageBlocks`,
    or an ``nn.Sequential`` whose children are named by layer id); it is edited in place
    (entries inserted and removed), never replaced. A block that arrives is built by
    ``factory(id, spec)`` when there is one (``specs`` maps layer ids to specs, which travel
    with moved layers), else cloned from a local block of the same kind
    (:func:`~vpipe.migration.blocks.clone_block`) and given the moved block's plain attributes.
    """

    def __init__(
        self,
        blocks: StageBlocks | nn.Sequential,
        *,
        stage_index: int,
        placement: Sequence[Sequence[int]],
        optimizer: torch.optim.Optimizer | None,
        factory: LayerFactory | None,
        specs: Mapping[int, Any] | None,
        messenger: Messenger,
        channel: TransferChannel,
        device: torch.device,
        timeout_s: float = 30.0,
        epoch: int = 0,
    ) -> None:
        if isinstance(blocks, nn.Sequential):
            blocks = StageBlocks(blocks, [int(name) for name in blocks._modules], KeyStyle.IDS)
        self.blocks = blocks
        self.stage_index = stage_index
        self.placement = tuple(tuple(s) for s in placement)
        self.optimizer = optimizer
        self.factory = factory
        self.specs: dict[int, Any] = dict(specs or {})
        self.messenger = messenger
        self.channel = channel
        self.device = device
        self.timeout_s = timeout_s
        self.epoch = epoch
        self.listeners: list[LayerListener] = []
        self._next_id = max(lid for layers in self.placement for lid in layers) + 1
        self.out_meta: dict[int, tuple[Any, ...]] = {}
        self.in_meta: dict[int, tuple[Any, ...]] = {}
        self._hooks: dict[int, Any] = {}
        if list(self.layer_ids) != list(self.placement[stage_index]):
            raise ValueError(f"stage {stage_index} holds layers {self.layer_ids} but the placement says "
                             f"{list(self.placement[stage_index])}")
        for lid, layer in self._children().items():
            self._watch(lid, layer)

    # ---------------------------------------------------------------- queries
    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def module(self) -> nn.Module:
        """The block container (edited in place)."""
        return self.blocks.container

    @property
    def layer_ids(self) -> list[int]:
        """This stage's layers, in order."""
        return self.blocks.ids

    @property
    def order(self) -> list[int]:
        """All layers of the model, in execution order (as this stage knows the placement)."""
        return [lid for layers in self.placement for lid in layers]

    def _children(self) -> dict[int, nn.Module]:
        return self.blocks.blocks()

    def can_build(self) -> list[str] | None:
        """The kinds of block this stage can build for an incoming move (None: any, a factory builds them)."""
        if self.factory is not None:
            return None
        return sorted({block_kind(block) for block in self._children().values()})

    def _describe(self, layer_id: int, block: nn.Module) -> dict[str, Any]:
        """What a receiving stage needs besides the tensors to rebuild ``block``: kind, key, plain attributes."""
        return {"kind": block_kind(block), "key": self.blocks.key_of(layer_id), "attrs": block_attrs(block)}

    # ---------------------------------------------------------------- output metadata
    def _watch(self, lid: int, layer: nn.Module) -> None:
        def record(_module: nn.Module, inputs: Any, output: Any, lid: int = lid) -> None:
            if lid not in self.out_meta:
                self.out_meta[lid] = _meta(output)
                self.in_meta[lid] = _meta(inputs)

        self._hooks[lid] = layer.register_forward_hook(record)

    def _unwatch(self, lid: int) -> None:
        handle = self._hooks.pop(lid, None)
        if handle is not None:
            handle.remove()

    def close(self) -> None:
        for lid in list(self._hooks):
            self._unwatch(lid)

    # ---------------------------------------------------------------- plans
    def check_plan(self, plan: Plan) -> None:
        if plan.epoch <= self.epoch:
            raise PlanError(f"stale plan: epoch {plan.epoch} <= current epoch {self.epoch}")
        plan.check_against(self.order, self.num_stages)

    def apply(self, plan: Plan) -> MigrationReport:
        """Move layers until this stage holds its part of ``plan``.

        Every rank calls this at the same step boundary with the same plan: the rounds end
        with a collective vote, so all ranks agree on what moved even when a move aborts.
        """
        self.check_plan(plan)
        report = MigrationReport(epoch=plan.epoch)
        start = time.perf_counter()
        rounds = plan_rounds(self.placement, plan.stages)
        mine = [m for moves in rounds for m in moves if self.stage_index in (m.src, m.dst)]
        if mine:
            decision("migration_start", f"epoch {plan.epoch}: {len(mine)} move(s) involving stage {self.stage_index}",
                     epoch=plan.epoch, stage=self.stage_index,
                     moves=[{"src": m.src, "dst": m.dst, "layers": list(m.layers)} for m in mine])
        for r, moves in enumerate(rounds):
            if not self._run_round(plan.epoch, r, moves, report):
                break  # later rounds assumed this one: stay at the last agreed placement
            self.placement = apply_round(self.placement, moves)
        self.epoch = plan.epoch
        report.seconds = time.perf_counter() - start
        if mine:
            decision("migration_done",
                     f"epoch {plan.epoch}: stage {self.stage_index} moved {len(report.moved)}, aborted {len(report.aborted)}",
                     epoch=plan.epoch, stage=self.stage_index, seconds=report.seconds,
                     bytes_sent=report.bytes_sent, bytes_received=report.bytes_received,
                     moved=[list(m.layers) for m in report.moved], aborted=[list(m.layers) for m in report.aborted],
                     layers=self.layer_ids, rebuilt=report.rebuilt)
        return report

    def start_streamed(self, plan: Plan, schedule: Any, switch_mb: int, *, continuation: bool = False) -> list[Any]:
        """Begin moving towards ``plan`` inside a running PipeDream stream, switching at ``switch_mb``.

        Called on every rank at the same step boundary, before the step that contains
        ``switch_mb`` starts its forwards. Only the first round of neighbour moves is started
        (a layer two stages away hops once per plan); the rest follows with a later plan.
        Returns the movers registered with the schedule (empty when the round aborted).
        ``continuation`` starts the next round of a plan already begun (same epoch).
        """
        from vpipe.migration.stream import IncomingStream, OutgoingStream

        if continuation:
            plan.check_against(self.order, self.num_stages)
        else:
            self.check_plan(plan)
        if any(not m.done for m in schedule.movers):
            raise MigrationError("a streamed move is still in progress; wait for it before the next plan")
        rounds = plan_rounds(self.placement, plan.stages)
        if not rounds:
            self.epoch = plan.epoch
            return []
        moves = rounds[0]
        after = apply_round(self.placement, moves)
        if self._vote(self._boundary_changed(self.placement, after), all_of=False):
            raise MigrationError("this move changes a boundary activation's shape; a PipeDream stream cannot "
                                 "resize its buffers: flush() first and apply it at the step boundary")
        s, key, epoch = self.stage_index, (plan.epoch, 0), plan.epoch
        outgoing = [m for m in moves if m.src == s]
        incoming = [m for m in moves if m.dst == s]
        children = self._children()
        for m in outgoing:
            manifests = [dict(pack_layer(lid, children[lid], None, self.specs.get(lid)).manifest,
                              block=self._describe(lid, children[lid])) for lid in m.layers]
            self.messenger.send_to(m.dst, "migrate_prepare", {"round": 0, "src": m.src, "dst": m.dst,
                                                              "layers": list(m.layers), "manifests": manifests},
                                   epoch=epoch)
        arriving = [self._receive_prepare(m, key) for m in incoming]
        ready = all(inc.ok for inc in arriving)
        for m in outgoing:
            answer = self.messenger.wait_for({"migrate_ready", "migrate_abort"}, from_rank=m.dst, key=key,
                                             timeout_s=self.timeout_s)
            if answer is None or answer[0] == "migrate_abort":
                if answer is None:
                    log.warning("stage %d: no migrate_ready from stage %d for layers %s", s, m.dst, list(m.layers))
                ready = False
        if not self._vote(ready, all_of=True):
            decision("migration_aborted", f"epoch {epoch}: a streamed move was not ready; every stage keeps its layers",
                     epoch=epoch, stage=s)
            self.epoch = epoch
            return []
        decision("migration_start", f"epoch {epoch}: streamed move at micro-batch {switch_mb}",
                 epoch=epoch, stage=s, switch_mb=switch_mb,
                 moves=[{"src": m.src, "dst": m.dst, "layers": list(m.layers)} for m in moves if s in (m.src, m.dst)])
        movers: list[Any] = []
        listeners = [self._Bookkeeping(self), *self.listeners]
        for m in outgoing:
            movers.append(OutgoingStream(schedule, self.blocks, {lid: children[lid] for lid in m.layers},
                                         forward=m.forward, switch_mb=switch_mb, dst=m.dst, epoch=epoch,
                                         channel=self.channel, messenger=self.messenger, listeners=listeners))
        for inc in arriving:
            movers.append(IncomingStream(schedule, self.blocks, inc.modules, inc.manifests, forward=inc.move.forward,
                                         switch_mb=switch_mb, src=inc.move.src, epoch=epoch, channel=self.channel,
                                         messenger=self.messenger, timeout_s=3 * self.timeout_s, listeners=listeners))
        schedule.movers.extend(movers)
        self.placement = after
        self.epoch = epoch
        return movers

    class _Bookkeeping:
        """Keeps the manager's own per-layer records in step with a streamed move."""

        def __init__(self, manager: LayerManager) -> None:
            self.manager = manager

        def add_layer(self, layer_id: int, module: nn.Module) -> None:
            self.manager._watch(layer_id, module)

        def remove_layer(self, layer_id: int) -> None:
            self.manager._unwatch(layer_id)

    def _vote(self, flag: bool, *, all_of: bool) -> bool:
        """All ranks learn whether ``flag`` holds on all (``all_of``) or on any rank."""
        return self._votes([(flag, all_of)])[0]

    def _votes(self, flags: Sequence[tuple[bool, bool]]) -> list[bool]:
        """Several votes in one collective: each ``(flag, all_of)`` becomes "on all" or "on any" rank."""
        # MIN of x is "all"; MIN of -x is -"any"
        values = [(1.0 if f else 0.0) if all_of else -(1.0 if f else 0.0) for f, all_of in flags]
        t = torch.tensor(values, device=self.channel.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.channel.group)
        return [(v > 0.5) if all_of else (v < -0.5) for v, (_, all_of) in zip(t.tolist(), flags)]

    def _boundary_changed(self, before: Sequence[Sequence[int]], after: Sequence[Sequence[int]]) -> bool:
        """Before a one-round move: whether a boundary next to this stage will carry a different activation.

        Boundary ``b`` (between stages b and b+1) is judged by the stage that held its new
        last layer before the move: it knows that layer's output and the old boundary (as
        stage b, the old last layer's output; as stage b+1, its old first layer's input).
        Unknown metadata (a layer that never ran) counts as a change.
        """
        s = self.stage_index
        changed = False
        for b in (s - 1, s):
            if not 0 <= b < self.num_stages - 1 or before[b][-1] == after[b][-1]:
                continue
            new_last = after[b][-1]
            if new_last not in before[s]:
                continue  # the other neighbour judges this boundary
            old = self.out_meta.get(before[b][-1]) if b == s else self.in_meta.get(before[b + 1][0])
            new = self.out_meta.get(new_last)
            changed = changed or old is None or new is None or old != new
        return changed

    # ---------------------------------------------------------------- one round
    def _run_round(self, epoch: int, r: int, moves: Sequence[Move], report: MigrationReport) -> bool:
        """One round of moves; True if every move of the round went through on every rank."""
        s = self.stage_index
        outgoing = [m for m in moves if m.src == s]
        incoming = [m for m in moves if m.dst == s]
        key = (epoch, r)
        ok = True
        # phase 1: announce what leaves
        sent_states: dict[Move, list[LayerState]] = {}
        for m in outgoing:
            children = self._children()
            states = [pack_layer(lid, children[lid], self.optimizer, self.specs.get(lid)) for lid in m.layers]
            for st in states:
                st.manifest["block"] = self._describe(st.layer_id, children[st.layer_id])
                st.manifest["out_meta"] = _wire_meta(self.out_meta.get(st.layer_id))
                st.manifest["in_meta"] = _wire_meta(self.in_meta.get(st.layer_id))
            sent_states[m] = states
            self.messenger.send_to(m.dst, "migrate_prepare",
                                   {"round": r, "src": m.src, "dst": m.dst, "layers": list(m.layers),
                                    "manifests": [st.manifest for st in states]}, epoch=epoch)
        # phase 2: build what arrives (on the meta device, then empty storage: no init cost)
        arriving = [self._receive_prepare(m, key) for m in incoming]
        # phase 3: send each payload once its target is ready
        works = []
        for m in outgoing:
            answer = self.messenger.wait_for({"migrate_ready", "migrate_abort"}, from_rank=m.dst, key=key,
                                             timeout_s=self.timeout_s)
            if answer is None or answer[0] == "migrate_abort":
                if answer is None:
                    log.warning("stage %d: no migrate_ready from stage %d for layers %s; aborting", s, m.dst,
                                list(m.layers))
                    self.messenger.send_to(m.dst, "migrate_abort", {"round": r, "reason": "no ready"}, epoch=epoch)
                ok = False
                continue
            payload = torch.cat([st.payload for st in sent_states[m]])
            self.messenger.send_to(m.dst, "migrate_transfer", {"round": r, "nbytes": int(payload.numel())}, epoch=epoch)
            works.append((m, self.channel.send(payload, m.dst, transfer_tag(epoch, MOVE, 2 * r + (m.dst > m.src))), payload))
        # phase 4: receive payloads and acknowledge them
        for inc in arriving:
            if inc.ok:
                self._receive_payload(inc, key, report)
            ok = ok and inc.ok
        for m, work, payload in works:
            work.wait()
            report.bytes_sent += int(payload.numel())
        # phase 5: the sources collect the acknowledgements
        for m, _work, _payload in works:
            if self.messenger.wait_for({"migrate_ack"}, from_rank=m.dst, key=key, timeout_s=self.timeout_s) is None:
                log.warning("stage %d: no migrate_ack from stage %d for layers %s; aborting", s, m.dst, list(m.layers))
                ok = False
        # phase 6: one vote decides the whole round on every rank, then both sides act on it; the
        # same collective tells whether a boundary activation changes (every rank must redo shape inference)
        ok, changed = self._votes([(ok, True), (self._last_output_changes(outgoing, arriving), False)])
        if not ok:
            report.aborted.extend(m for m in moves if s in (m.src, m.dst))
            decision("migration_aborted", f"epoch {epoch} round {r}: a move failed; every stage keeps its layers",
                     epoch=epoch, round=r, stage=s)
            return False
        for m in outgoing:
            self._drop(m.layers)
        for inc in arriving:
            self._insert(inc)
        report.moved.extend(m for m in moves if s in (m.src, m.dst))
        report.rebuilt = report.rebuilt or changed
        return True

    def _last_output_changes(self, outgoing: Sequence[Move], arriving: Sequence[_Incoming]) -> bool:
        """Whether this round changes what this stage sends downstream (shape, dtype, arity)."""
        if self.stage_index == self.num_stages - 1:
            return False
        leaving = {lid for m in outgoing for lid in m.layers}
        layers = [lid for lid in self.layer_ids if lid not in leaving]
        metas = dict(self.out_meta)
        for inc in arriving:
            if not inc.manifests:
                continue
            for man in inc.manifests:
                metas[man["layer"]] = _unwire_meta(man.get("out_meta"))
            layers = list(inc.move.layers) + layers if inc.move.forward else layers + list(inc.move.layers)
        old_last = self.layer_ids[-1]
        if not layers or layers[-1] == old_last:
            return False
        old, new = self.out_meta.get(old_last), metas.get(layers[-1])
        return old is None or new is None or old != new

    def _build(self, layer_id: int, spec: Any) -> nn.Module:
        """An empty layer of the right shape (built on the meta device: no initialisation cost)."""
        assert self.factory is not None
        with torch.device("meta"):
            layer = self.factory(layer_id, spec)
        return layer.to_empty(device=self.device)

    def _clone_for(self, manifest: dict[str, Any]) -> nn.Module:
        """An empty block for ``manifest``, cloned from a local block of the same kind (no factory)."""
        lid, info = manifest["layer"], manifest.get("block")
        if not isinstance(info, dict):
            raise MigrationError(f"layer {lid} arrives without a description of its block, and there is no layer_factory")
        donor = next((b for b in self._children().values() if block_kind(b) == info["kind"]), None)
        if donor is None:
            raise MigrationError(f"stage {self.stage_index} has no block of kind {info['kind']} to build layer {lid} "
                                 "from; pass layer_factory= to vpipe.attach for models whose blocks differ")
        block = clone_block(donor)
        try:
            set_block_attrs(block, info["attrs"], lid)
        except ValueError as e:
            raise MigrationError(str(e)) from None
        return block

    def _receive_prepare(self, m: Move, key: tuple[int, int]) -> _Incoming:
        # the plan names the layers: build those whose spec we know while the source packs them
        early = ({lid: self._build(lid, self.specs[lid]) for lid in m.layers if lid in self.specs}
                 if self.factory is not None else {})
        got = self.messenger.wait_for({"migrate_prepare"}, from_rank=m.src, key=key, timeout_s=self.timeout_s)
        if got is None:
            log.warning("stage %d: no migrate_prepare from stage %d for layers %s", self.stage_index, m.src, list(m.layers))
            return _Incoming(m, [], {}, ok=False)
        rank = dist.get_rank()
        if faults.active("migration_silent", rank):
            log.warning("stage %d: fault injected: ignoring migrate_prepare from stage %d", self.stage_index, m.src)
            return _Incoming(m, [], {}, ok=False)
        if faults.active("migration_die", rank):
            log.error("stage %d: fault injected: dying in the middle of a move", self.stage_index)
            os._exit(9)
        body = got[1]
        if body.get("layers") != list(m.layers) or body.get("src") != m.src or body.get("dst") != m.dst:
            raise MigrationError(f"stage {self.stage_index}: stage {m.src} announced layers {body.get('layers')} "
                                 f"but the plan moves {list(m.layers)}")
        manifests = [validate_manifest(man) for man in body.get("manifests", [])]
        if [man["layer"] for man in manifests] != list(m.layers):
            raise MigrationError(f"stage {self.stage_index}: manifests do not match the moved layers {list(m.layers)}")
        modules = {}
        try:
            for man in manifests:
                lid = man["layer"]
                if self.factory is None:
                    modules[lid] = self._clone_for(man)
                    continue
                same_spec = lid in early and man.get("spec") in (None, self.specs.get(lid))
                modules[lid] = early[lid] if same_spec else self._build(lid, man.get("spec"))
        except MigrationError as e:
            decision("migration_refused", f"stage {self.stage_index} cannot build layers {list(m.layers)}: {e}",
                     stage=self.stage_index, layers=list(m.layers), reason=str(e))
            self.messenger.send_to(m.src, "migrate_abort", {"round": key[1], "reason": str(e)[:200]}, epoch=key[0])
            return _Incoming(m, [], {}, ok=False)
        self.messenger.send_to(m.src, "migrate_ready", {"round": key[1]}, epoch=key[0])
        return _Incoming(m, manifests, modules)

    def _receive_payload(self, inc: _Incoming, key: tuple[int, int], report: MigrationReport) -> None:
        m, (epoch, r) = inc.move, key
        got = self.messenger.wait_for({"migrate_transfer", "migrate_abort"}, from_rank=m.src, key=key,
                                      timeout_s=2 * self.timeout_s)
        if got is None or got[0] == "migrate_abort":
            inc.ok = False
            return
        nbytes = sum(payload_bytes(man) for man in inc.manifests)
        if got[1].get("nbytes") != nbytes:
            raise MigrationError(f"stage {self.stage_index}: stage {m.src} sends {got[1].get('nbytes')} bytes, "
                                 f"the manifests describe {nbytes}")
        buf, work = self.channel.recv(nbytes, m.src, transfer_tag(epoch, MOVE, 2 * r + (m.dst > m.src)))
        work.wait()
        buf = buf.cpu()
        offset = 0
        for man in inc.manifests:
            size = payload_bytes(man)
            inc.states.append(LayerState(man["layer"], man, buf[offset:offset + size]))
            offset += size
        report.bytes_received += nbytes
        self.messenger.send_to(m.src, "migrate_ack", {"round": r}, epoch=epoch)

    # ---------------------------------------------------------------- adding and removing layers
    def add_layers(self, position: int, specs: Sequence[Any], *, seed_ids: Sequence[int] | None = None) -> list[int]:
        """Insert new layers before model position ``position`` (0 = first); every rank calls it identically.

        New layers get fresh ids above every id in use. They join the stage that holds
        the layer currently at ``position`` (the last stage when appending), are built by
        the factory, and their parameters join this stage's optimizer (param group 0).
        Returns the new ids.
        """
        order = self.order
        if not 0 <= position <= len(order):
            raise ValueError(f"position {position} is outside 0..{len(order)}")
        if not specs:
            return []
        first_new = max(self._next_id, max(order) + 1)  # ids are never reused, even after a removal
        new_ids = list(seed_ids) if seed_ids is not None else list(range(first_new, first_new + len(specs)))
        if len(new_ids) != len(specs) or set(new_ids) & set(order):
            raise ValueError(f"new layer ids {new_ids} clash with the model's ids or do not match the specs")
        if position < len(order):
            owner, anchor = self._stage_holding(order[position]), order[position]
        else:
            owner, anchor = self.num_stages - 1, None
        stages = [list(layers) for layers in self.placement]
        at = stages[owner].index(anchor) if anchor is not None else len(stages[owner])
        stages[owner][at:at] = new_ids
        if owner == self.stage_index:
            if self.factory is None:
                raise ValueError("adding layers needs layer_factory= in the vpipe config to build them")
            built = [(lid, self.factory(lid, spec).to(self.device)) for lid, spec in zip(new_ids, specs)]
            self.blocks.insert(at, [(lid, layer, str(lid)) for lid, layer in built])
            for lid, layer in built:
                if self.optimizer is not None:
                    self.optimizer.param_groups[0]["params"].extend(layer.parameters())
                self._watch(lid, layer)
                for listener in self.listeners:
                    listener.add_layer(lid, layer)
        for lid, spec in zip(new_ids, specs):
            self.specs[lid] = spec
        self._next_id = max(new_ids) + 1
        self.placement = tuple(tuple(layers) for layers in stages)
        decision("layers_added", f"{len(new_ids)} layer(s) added to stage {owner} at position {position}",
                 stage=owner, layers=new_ids, position=position, placement=[list(s) for s in self.placement])
        return new_ids

    def remove_layers(self, layer_ids: Iterable[int]) -> None:
        """Remove layers by id (every rank calls it identically); no stage may be left empty."""
        doomed = set(layer_ids)
        unknown = doomed - {lid for layers in self.placement for lid in layers}
        if unknown:
            raise ValueError(f"cannot remove unknown layers {sorted(unknown)}")
        stages = [[lid for lid in layers if lid not in doomed] for layers in self.placement]
        empty = [s for s, layers in enumerate(stages) if not layers]
        if empty:
            raise ValueError(f"removing {sorted(doomed)} would leave stage(s) {empty} without layers")
        mine = [lid for lid in self.layer_ids if lid in doomed]
        self._drop(mine)
        for lid in doomed:
            self.specs.pop(lid, None)
            self.out_meta.pop(lid, None)
            self.in_meta.pop(lid, None)
        self.placement = tuple(tuple(layers) for layers in stages)
        decision("layers_removed", f"{len(doomed)} layer(s) removed", layers=sorted(doomed),
                 placement=[list(s) for s in self.placement])

    def _stage_holding(self, layer_id: int) -> int:
        for s, layers in enumerate(self.placement):
            if layer_id in layers:
                return s
        raise ValueError(f"layer {layer_id} is not placed")

    # ---------------------------------------------------------------- placement edits
    def _drop(self, layer_ids: Iterable[int]) -> None:
        children = self._children()
        for lid in layer_ids:
            layer = children[lid]
            detach_from_optimizer(self.optimizer, layer.parameters())
            for listener in self.listeners:
                listener.remove_layer(lid)
            self._unwatch(lid)
            self.blocks.remove([lid])

    def _insert(self, inc: _Incoming) -> None:
        for st in inc.states:
            unpack_layer(st, inc.modules[st.layer_id], self.optimizer)
            for table, key in ((self.out_meta, "out_meta"), (self.in_meta, "in_meta")):
                meta = _unwire_meta(st.manifest.get(key))
                if meta is not None:
                    table[st.layer_id] = meta
            if st.manifest.get("spec") is not None:
                self.specs[st.layer_id] = st.manifest["spec"]
        keys = {man["layer"]: (man.get("block") or {}).get("key") for man in inc.manifests}
        new = [(lid, inc.modules[lid], keys.get(lid) or str(lid)) for lid in inc.move.layers]
        self.blocks.insert(0 if inc.move.forward else len(self.blocks.ids), new)
        for lid in inc.move.layers:
            self._watch(lid, inc.modules[lid])
            for listener in self.listeners:
                listener.add_layer(lid, inc.modules[lid])


def _meta(output: Any) -> tuple[Any, ...]:
    """Shape (without the batch dimension), dtype and arity of a layer's output."""
    outs = output if isinstance(output, (tuple, list)) else (output,)
    return tuple((tuple(o.shape[1:]), str(o.dtype)) if isinstance(o, torch.Tensor) else ("?",) for o in outs)


def _wire_meta(meta: tuple[Any, ...] | None) -> list[Any] | None:
    return None if meta is None else [[list(m[0]), m[1]] if len(m) == 2 else ["?"] for m in meta]


def _unwire_meta(raw: Any) -> tuple[Any, ...] | None:
    if not isinstance(raw, list):
        return None
    try:
        return tuple((tuple(int(d) for d in m[0]), str(m[1])) if len(m) == 2 else ("?",) for m in raw)
    except (TypeError, ValueError, IndexError):
        return None
