"""The migration protocol's control messages, and waiting for them on the control plane.

Types: ``migrate_prepare`` (layers and their manifests), ``migrate_ready``,
``migrate_transfer`` (payload size), ``migrate_ack``, ``migrate_abort`` and
``migrate_handover`` (streamed PipeDream moves). Each body names the round and the move it
belongs to (:func:`vpipe.migration.handshake.move_key`), so a message that arrives after its
round ended (a peer that was too slow) is recognised as stale and dropped instead of being
taken for a later move's, and two moves of one round between the same ranks stay apart.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vpipe.control.channel import ControlPlane
from vpipe.control.messages import make, register_type
from vpipe.migration.state import validate_manifest

log = logging.getLogger("vpipe.migration")

__all__ = ["MIGRATION_TYPES", "ControlMessenger"]

_MAX_LAYERS = 4096


def _int(value: Any, what: str, low: int = 0, high: int = 1 << 31) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}], got {value!r:.40}")
    return value


def _body(body: Any, required: set[str], optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ValueError(f"body must be a map, got {type(body).__name__}")
    keys = set(body)
    required = required | {"round", "move"}
    if not required <= keys or not keys <= required | optional:
        raise ValueError(f"body keys {sorted(map(str, keys))[:8]} do not match {sorted(required)}")
    _int(body["round"], "round", 0, 1 << 16)
    _int(body["move"], "move", 0, 1 << 18)
    return body


def _layers(value: Any) -> list[int]:
    if not isinstance(value, list) or not 0 < len(value) <= _MAX_LAYERS:
        raise ValueError(f"layers must be a list of 1..{_MAX_LAYERS} ids")
    return [_int(v, "layer id") for v in value]


def _parse_prepare(body: Any) -> dict[str, Any]:
    body = _body(body, {"src", "dst", "layers", "manifests"})
    _int(body["src"], "src", 0, 1 << 16)
    _int(body["dst"], "dst", 0, 1 << 16)
    layers = _layers(body["layers"])
    manifests = body["manifests"]
    if not isinstance(manifests, list) or len(manifests) != len(layers):
        raise ValueError("prepare needs one manifest per layer")
    for man in manifests:
        validate_manifest(man)
    return body


def _parse_handover(body: Any) -> dict[str, Any]:
    body = _body(body, {"manifests"})
    if not isinstance(body["manifests"], list) or not 0 < len(body["manifests"]) <= _MAX_LAYERS:
        raise ValueError("handover needs a list of manifests")
    for man in body["manifests"]:
        validate_manifest(man)
    return body


def _parse_transfer(body: Any) -> dict[str, Any]:
    body = _body(body, {"nbytes"})
    _int(body["nbytes"], "nbytes", 0, 1 << 62)
    return body


def _parse_abort(body: Any) -> dict[str, Any]:
    body = _body(body, {"reason"})
    if not isinstance(body["reason"], str) or len(body["reason"]) > 200:
        raise ValueError("abort reason must be a short string")
    return body


MIGRATION_TYPES = {
    "migrate_prepare": _parse_prepare,
    "migrate_ready": lambda b: _body(b, set()),
    "migrate_transfer": _parse_transfer,
    "migrate_ack": lambda b: _body(b, set()),
    "migrate_abort": _parse_abort,
    "migrate_handover": _parse_handover,
}
for _name, _parse in MIGRATION_TYPES.items():
    register_type(_name, _parse, replace=True)


class ControlMessenger:
    """The :class:`~vpipe.migration.handshake.Messenger` of a rank, on its control plane.

    Migration messages are taken from the plane by type, so the stage agent's stats and
    plans are never consumed here (and vice versa). Messages that match no open round are
    kept until they are older than the round being waited for, then dropped as stale.
    """

    def __init__(self, plane: ControlPlane, rank: int) -> None:
        self.plane = plane
        self.rank = rank
        self._held: list[Any] = []
        self.stale = 0

    def send_to(self, peer: int, type: str, body: dict[str, Any], *, epoch: int) -> None:
        if not self.plane.send(peer, make(type, body, epoch=epoch, stage=self.rank)):
            log.warning("rank %d: could not queue %s for rank %d", self.rank, type, peer)

    def wait_for(self, types: set[str], *, from_rank: int, key: tuple[int, int, int],
                 timeout_s: float) -> tuple[str, dict[str, Any]] | None:
        """The first ``types`` message from ``from_rank`` for ``key`` (epoch, round, move),
        or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i, msg in enumerate(self._held):
                if msg.type in types and msg.src == from_rank and (msg.epoch, msg.body["round"],
                                                                   msg.body["move"]) == key:
                    del self._held[i]
                    return msg.type, msg.body
            self._drop_stale(key)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._held.extend(self.plane.poll(timeout_ms=int(min(remaining, 0.1) * 1000) + 1,
                                              types=set(MIGRATION_TYPES)))

    def _drop_stale(self, key: tuple[int, int, int]) -> None:
        keep = []
        for msg in self._held:
            if (msg.epoch, msg.body["round"]) < key[:2]:
                self.stale += 1
                log.info("rank %d: dropped a stale %s from rank %d (epoch %d round %d)", self.rank,
                         msg.type, msg.src, msg.epoch, msg.body["round"])
            else:
                keep.append(msg)
        self._held = keep
