"""Moving layers inside a running PipeDream stream: no flush, weight versions unchanged.

A move of layers ``Ls`` between neighbouring stages switches at micro-batch ``S`` (the
first of a step both stages know): micro-batches before ``S`` run ``Ls`` forward and
backward on the source, micro-batches from ``S`` on the target. So no autograd graph ever
spans two processes and the pipeline keeps its in-flight micro-batches. What must travel:

- the stashed weight versions of ``Ls`` that the target's first forwards use (versions up
  to ``S``, produced by the source's optimizer steps), sent as soon as each exists;
- at the hand-over, after the source applied the update of micro-batch ``S-1``, the live
  parameters, buffers and optimizer state; the target applies the update of ``S``.
- with ``deferred_batch_norm=``, what the layers' BatchNorms accumulated of the step on the
  source (micro-batches before ``S``) goes with the buffers at the hand-over and is merged with
  what the target's forwards from ``S`` accumulated meanwhile (:mod:`vpipe.stage.batch_norm`).

Each micro-batch thus runs on exactly the weight version the schedule's rule gives for the
stage that runs it, and every update of ``Ls`` is applied once, in micro-batch order. The
schedule says which versions travel and after which update the hand-over comes
(``move_versions``, ``updates_before``): under PipeDream-2BW, which updates once per step,
the versions of the step's period and of the update that ends the period before. The
boundary activation must keep its shape (the stream cannot resize receive buffers); the
layer manager checks this before starting a streamed move.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vpipe.log import decision
from vpipe.migration.handshake import (
    MigrationError,
    announce,
    await_ready,
    move_key,
    receive_prepare,
    refuse_move,
)
from vpipe.migration.link import MoveLink
from vpipe.migration.moves import Move
from vpipe.migration.shapes import BoundaryShapes
from vpipe.migration.state import (
    LayerState,
    decode_tensor,
    detach_from_optimizer,
    pack_layer,
    payload_bytes,
    unpack_layer,
    validate_manifest,
)
from vpipe.migration.transfer import HANDOVER, VERSION, TransferChannel, transfer_tag
from vpipe.schedules.pipedream import SchedulePipeDream, start_version
from vpipe.stage.batch_norm import accumulated, arriving, handed_over
from vpipe.stage.blocks import StageBlocks

__all__ = ["OutgoingStream", "IncomingStream", "version_window", "check_idle", "start_round", "WatchShapes"]


def version_window(switch_mb: int, target_stage: int, num_stages: int, vertical_sync: bool) -> range:
    """Weight versions of the moving layers the target needs before it makes its own."""
    first = start_version(switch_mb, target_stage, num_stages, vertical_sync)
    return range(first, switch_mb + 1)


def _version_payload(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8).cpu() for t in tensors if t.numel() > 0]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


class OutgoingStream:
    """The source side of a streamed move (a :class:`~vpipe.schedules.pipedream.StreamMover`)."""

    def __init__(self, schedule: SchedulePipeDream, blocks: StageBlocks, layers: dict[int, nn.Module], *,
                 forward: bool, switch_mb: int, dst: int, key: tuple[int, int, int], channel: TransferChannel,
                 messenger: Any, stage_index: int, listeners: Sequence[Any] = ()) -> None:
        self.schedule = schedule
        self.blocks = blocks
        self.messenger = messenger
        self.layers = layers  # layer id -> module, in model order
        self.forward = forward
        self.switch_mb = switch_mb
        self.dst = dst  # the target's rank
        self.key = key  # the move's message key (epoch, round, move)
        self.epoch = key[0]
        self.channel = channel
        self.listeners = list(listeners)
        self.window = schedule.move_versions(switch_mb, dst)
        self.handover_at = schedule.updates_before(switch_mb)  # the source's last update of the layers
        self.names = [f"{lid}.{n}" for lid, layer in layers.items() for n, _ in layer.named_parameters()]
        self._sent: set[int] = set()
        self._switched = False  # Ls left this stage's forward (at micro-batch S)
        self._handed_over = False  # the live state left (after the update of micro-batch S-1)
        self.bytes_sent = 0
        if schedule.next_forward >= switch_mb:
            raise RuntimeError(f"streamed move registered too late: micro-batch {switch_mb} already started")
        for v in self.window:  # versions that exist already go now
            if v < schedule.stream_updates:
                stashed = schedule.stashed(v)
                if stashed is None:
                    raise RuntimeError(f"stage {stage_index}: weight version {v} of "
                                       f"layers {list(layers)} is no longer kept; register the move earlier")
                self._send_version(v, [stashed[n] for n in self.names])
        self._send_live_if_due(schedule.stream_updates)

    def _live(self) -> list[torch.Tensor]:
        params = {f"{lid}.{n}": p for lid, layer in self.layers.items() for n, p in layer.named_parameters()}
        return [params[n] for n in self.names]

    def _send_version(self, v: int, tensors: list[torch.Tensor]) -> None:
        payload = _version_payload(tensors)
        self.schedule.defer_wait(self.channel.send(payload, self.dst,
                                                   transfer_tag(self.epoch, VERSION, v % 10_000)),
                                 payload)
        self._sent.add(v)
        self.bytes_sent += int(payload.numel())

    def _send_live_if_due(self, updates: int) -> None:
        if updates in self.window and updates not in self._sent:
            self._send_version(updates, self._live())

    # ------------------------------------------------------------- StreamMover
    @property
    def done(self) -> bool:
        return self._switched and self._handed_over

    def before_forward(self, mb: int) -> None:
        # on a stage with one micro-batch in flight (the last), the update of S-1 comes first
        if mb != self.switch_mb:
            return
        for lid, layer in self.layers.items():
            if not self._handed_over:  # its in-flight micro-batches still update it here
                for n, p in layer.named_parameters():
                    self.schedule.departing[f"{lid}.{n}"] = p
        self.blocks.remove(self.layers)
        if not self._handed_over:  # the listeners still hold the layers until their last update
            for lid in self.layers:
                for listener in self.listeners:
                    listener.retire_layer(lid)
        self._switched = True

    def add_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        return None

    def before_update(self, mb: int) -> None:
        return None

    def after_update(self, updates: int) -> None:
        self._send_live_if_due(updates)
        if updates == self.handover_at and not self._handed_over:  # 2BW: the count stays until a period ends
            self._hand_over()

    def _hand_over(self) -> None:
        states = [pack_layer(lid, layer, self.schedule.optimizer) for lid, layer in self.layers.items()]
        payload = torch.cat([s.payload for s in states])
        self.messenger.send_to(self.dst, "migrate_handover", {"round": self.key[1], "move": self.key[2],
                                                              "manifests": [s.manifest for s in states]},
                               epoch=self.epoch)
        self.schedule.defer_wait(self.channel.send(payload, self.dst, transfer_tag(self.epoch, HANDOVER, 0)),
                                 payload)
        self.bytes_sent += int(payload.numel())
        for lid, layer in self.layers.items():
            detach_from_optimizer(self.schedule.optimizer, layer.parameters())
            for n, _ in layer.named_parameters():
                self.schedule.departing.pop(f"{lid}.{n}", None)
            for listener in self.listeners:
                listener.remove_layer(lid)
        self._handed_over = True


class IncomingStream:
    """The target side of a streamed move."""

    def __init__(self, schedule: SchedulePipeDream, blocks: StageBlocks, layers: dict[int, nn.Module],
                 manifests: Sequence[dict[str, Any]], *, forward: bool, switch_mb: int, src: int,
                 key: tuple[int, int, int], channel: TransferChannel, messenger: Any, timeout_s: float,
                 stage_index: int, device: torch.device, listeners: Sequence[Any] = ()) -> None:
        self.schedule = schedule
        self.blocks = blocks
        self.messenger = messenger
        self.timeout_s = timeout_s
        self.layers = layers  # freshly built (empty) modules, in model order
        self.manifests = list(manifests)
        self.forward = forward
        self.switch_mb = switch_mb
        self.src = src  # the source's rank
        self.key = key  # the move's message key (epoch, round, move)
        self.epoch = key[0]
        self.channel = channel
        self.listeners = list(listeners)
        self.stage_index = stage_index  # this rank's stage the layers arrive on
        self.device = device
        self.window = schedule.move_versions(switch_mb, stage_index)
        self.entries = [(f"{man['layer']}.{e['name']}", e)
                        for man in manifests for e in man["entries"] if e["kind"] == "param"]
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._handed_over = False
        self.bytes_received = 0

    @property
    def done(self) -> bool:
        """Handed over, and no later forward can need a version from the source any more."""
        return (self._handed_over
                and self.schedule.upcoming_version > self.schedule.updates_before(self.switch_mb))

    def _receive_version(self, v: int) -> dict[str, torch.Tensor]:
        if v not in self._versions:
            nbytes = sum(e["nbytes"] for _, e in self.entries)
            buf, work = self.channel.recv(nbytes, self.src, transfer_tag(self.epoch, VERSION, v % 10_000))
            work.wait()
            buf = buf.cpu()
            self.bytes_received += nbytes
            device = self.device
            tensors, offset = {}, 0
            for name, e in self.entries:
                raw = buf[offset:offset + e["nbytes"]]
                offset += e["nbytes"]
                t = decode_tensor(raw, e).to(device)
                tensors[name] = t.requires_grad_(bool(e.get("requires_grad", True)))
            self._versions[v] = tensors
        return self._versions[v]

    # ------------------------------------------------------------- StreamMover
    def before_forward(self, mb: int) -> None:
        if mb != self.switch_mb:
            return
        new = [(lid, layer, str(lid)) for lid, layer in self.layers.items()]
        self.blocks.insert(0 if self.forward else len(self.blocks.ids), new)
        # deferred BatchNorms: what they see here waits for the sender's part
        for layer in self.layers.values():
            arriving(layer)

    def add_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        if version in self.window:
            weights.update(self._receive_version(version))

    def before_update(self, mb: int) -> None:
        if mb != self.switch_mb:
            return
        got = self.messenger.wait_for({"migrate_handover"}, from_rank=self.src, key=self.key,
                                      timeout_s=self.timeout_s)
        if got is None:
            raise RuntimeError(f"stage {self.stage_index}: rank {self.src} never "
                               f"handed over layers {list(self.layers)} (epoch {self.epoch})")
        manifests = [validate_manifest(man) for man in got[1].get("manifests", [])]
        if [man["layer"] for man in manifests] != list(self.layers):
            raise RuntimeError(f"hand-over of layers {[m['layer'] for m in manifests]}, "
                               f"expected {list(self.layers)}")
        nbytes = sum(payload_bytes(man) for man in manifests)
        buf, work = self.channel.recv(nbytes, self.src, transfer_tag(self.epoch, HANDOVER, 0))
        work.wait()
        buf = buf.cpu()
        self.bytes_received += nbytes
        offset = 0
        for man in manifests:
            size = payload_bytes(man)
            lid = man["layer"]
            early = accumulated(self.layers[lid])
            unpack_layer(LayerState(lid, man, buf[offset:offset + size]), self.layers[lid],
                         self.schedule.optimizer)
            handed_over(self.layers[lid], early)
            offset += size
            for listener in self.listeners:
                listener.add_layer(lid, self.layers[lid])
        # the source sent every version of the window before the hand-over: take them
        # now, so none is left unread (and the source waiting on its send at a flush)
        # when the run ends before a forward would have asked
        for v in self.window:
            self._receive_version(v)
        self._handed_over = True

    def after_update(self, updates: int) -> None:
        return None


def check_idle(schedule: Any) -> None:
    """A stream runs one round of streamed moves at a time."""
    if any(not m.done for m in schedule.movers):
        raise MigrationError("a streamed move is still in progress; wait for it before the next plan")


def start_round(link: MoveLink, schedule: Any, switch_mb: int, epoch: int, moves: Sequence[Move], *,
                stage: int, blocks: StageBlocks, listeners: Sequence[Any], reshapes: bool,
                device: torch.device) -> list[Any] | None:
    """Start one round of neighbour moves inside a running PipeDream stream, switching at ``switch_mb``.

    Called on every rank at the same step boundary, before the step that contains
    ``switch_mb`` starts its forwards; ``stage`` is this rank's stage that streams (its one, or
    WPipe's G0 stage) and ``blocks`` its container, which the movers edit at the switch.
    ``reshapes``: this rank sees the round change a boundary activation's shape (every rank votes
    on it first); ``device`` is where arriving versions go. Returns the movers
    registered with the schedule, or None when the round aborted (nothing moves anywhere).
    """
    what = f"the streamed move of epoch {epoch}"
    if link.channel.vote([(reshapes, False)], timeout_s=link.clock.vote_s(), what=what)[0]:
        raise MigrationError("this move changes a boundary activation's shape; a PipeDream stream cannot "
                             "resize its buffers: flush() first and apply it at the step boundary")
    outgoing = [m for m in moves if m.src == stage]
    incoming = [m for m in moves if m.dst == stage]
    leaving: dict[Move, list[LayerState]] = {}
    refused = []
    for m in outgoing:
        try:
            leaving[m] = link.pack(m, False)
        except ValueError as e:  # a pinned block: the target hears why, the vote below aborts
            refuse_move(link.messenger, m, link.rank_of(m.dst), move_key(epoch, 0, m), str(e))
            refused.append(m)
            continue
        announce(link.messenger, m, link.rank_of(m.dst), [st.manifest for st in leaving[m]],
                 move_key(epoch, 0, m))
    arriving = [receive_prepare(link.messenger, link.builder, m, link.rank_of(m.src), move_key(epoch, 0, m),
                                link.clock.wait_s(), link.faults) for m in incoming]
    ready = all(inc.ok for inc in arriving) and not refused
    for m in leaving:
        ready = await_ready(link.messenger, m, link.rank_of(m.dst), move_key(epoch, 0, m),
                            link.clock.wait_s(),
                            abort_on_silence=False) and ready
    if not link.channel.vote([(ready, True)], timeout_s=link.clock.vote_s(), what=what)[0]:
        decision("migration_aborted",
                 f"epoch {epoch}: a streamed move was not ready; every stage keeps its layers",
                 epoch=epoch, stage=stage)
        return None
    decision("migration_start", f"epoch {epoch}: streamed move at micro-batch {switch_mb}",
             epoch=epoch, stage=stage, switch_mb=switch_mb,
             moves=[{"src": m.src, "dst": m.dst, "layers": list(m.layers)} for m in moves
                    if stage in (m.src, m.dst)])
    # the shapes of an arriving layer are known before its first call here (a move back may come first)
    for watch, man in ((w, man) for w in listeners if isinstance(w, WatchShapes) for inc in arriving
                       for man in inc.manifests):
        watch.shapes.learn(man["layer"], man)
    movers: list[Any] = []
    children = blocks.blocks()
    for m in outgoing:
        movers.append(OutgoingStream(schedule, blocks, {lid: children[lid] for lid in m.layers},
                                     forward=m.forward, switch_mb=switch_mb, dst=link.rank_of(m.dst),
                                     key=move_key(epoch, 0, m), channel=link.channel,
                                     messenger=link.messenger, stage_index=stage,
                                     listeners=listeners))
    for inc in arriving:
        movers.append(IncomingStream(schedule, blocks, inc.modules, inc.manifests, forward=inc.move.forward,
                                     switch_mb=switch_mb, src=link.rank_of(inc.move.src),
                                     key=move_key(epoch, 0, inc.move), channel=link.channel,
                                     messenger=link.messenger, timeout_s=3 * link.timeout_s,
                                     stage_index=stage, device=device, listeners=listeners))
    schedule.movers.extend(movers)
    return movers


class WatchShapes:
    """Keeps the boundary-shape watchers in step with a streamed move."""

    def __init__(self, shapes: BoundaryShapes) -> None:
        self.shapes = shapes

    def add_layer(self, layer_id: int, module: nn.Module) -> None:
        self.shapes.watch(layer_id, module)

    def remove_layer(self, layer_id: int) -> None:
        self.shapes.unwatch(layer_id)

    def retire_layer(self, layer_id: int) -> None:
        return None  # it is unwatched when it leaves
