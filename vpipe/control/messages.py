"""Control-plane messages: the envelope, a registry of message types, msgpack encode/decode.

A message on the wire is one msgpack map::

    {"v": 1, "type": "stats", "epoch": 3, "iter": 120, "stage": 2, "src": 2, "body": {...}}

``v`` is the schema version, ``epoch`` the plan epoch the sender runs on, ``iter`` the
training iteration the message is about (-1 when none), ``stage`` the sender's stage and
``src`` its rank (both -1 for the planner daemon). Each ``type`` is registered with a
parser that validates its ``body`` and turns it into a Python value, and a dumper for the
other direction, so other parts (the migration protocol) add their own types with
:func:`register_type`.

Decoding trusts nothing: a size cap, msgpack limits derived from it, ``raw=False`` and
``strict_map_key``, no extension types, exact envelope keys, ranges on every number, and
the type's parser. Every failure is a :class:`DecodeError` with a short ``reason`` (the
counter key) and a detail; :class:`Decoder` counts, logs and drops them. Never pickle.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from vpipe.control.keys import check_z85_key
from vpipe.control.netaddr import check_endpoint
from vpipe.monitors.records import MAX_STAGES, StageRecord
from vpipe.plan import Plan

log = logging.getLogger("vpipe.control")

__all__ = [
    "SCHEMA_VERSION", "MAX_MESSAGE_BYTES", "PLANNER", "Message", "MessageType", "DecodeError", "Decoder",
    "register_type", "registered_types", "encode", "decode", "make", "frame_limit",
]

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # control messages are small; tensors go over torch.distributed
PLANNER = -1  # the ``stage`` and ``src`` of the planner daemon
_MAX_INT = (1 << 63) - 1
_MAX_RANK = 1 << 16
_ENVELOPE = frozenset({"v", "type", "epoch", "iter", "stage", "src", "body"})


def frame_limit(max_message_bytes: int) -> int:
    """A socket's ``maxmsgsize`` for a message cap: twice the cap.

    Frames between the two are read and dropped as ``too_large`` (counted, logged), so a
    peer with a bigger cap is noticed; beyond it zmq cuts the peer off without reading.
    """
    return 2 * max_message_bytes


class DecodeError(ValueError):
    """A received message that is not a valid control message; ``reason`` is its counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class MessageType:
    name: str
    parse: Callable[[Any], Any]  # wire body -> value; raises ValueError/TypeError on a bad body
    dump: Callable[[Any], Any]  # value -> msgpack-able body


@dataclass(frozen=True)
class Message:
    type: str
    body: Any = None
    epoch: int = 0
    iteration: int = -1
    stage: int = PLANNER
    src: int = PLANNER
    v: int = SCHEMA_VERSION


_REGISTRY: dict[str, MessageType] = {}


def register_type(
    name: str,
    parse: Callable[[Any], Any],
    dump: Callable[[Any], Any] = lambda body: body,
    *,
    replace: bool = False,
) -> None:
    """Teach the control plane a message type (``parse`` must reject bad bodies with ValueError)."""
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise ValueError(f"a message type name must be a string of 1-64 characters, got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"message type {name!r} is already registered")
    _REGISTRY[name] = MessageType(name, parse, dump)


def registered_types() -> list[str]:
    return sorted(_REGISTRY)


def make(type: str, body: Any = None, *, epoch: int = 0, iteration: int = -1, stage: int = PLANNER,
         src: int | None = None) -> Message:
    """A message from ``stage`` (``src`` defaults to it: one stage per rank)."""
    return Message(type=type, body=body, epoch=epoch, iteration=iteration, stage=stage,
                   src=stage if src is None else src)


# ---------------------------------------------------------------- encode / decode
def encode(message: Message, *, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """The wire bytes of a message; ValueError for an unknown type or one over ``max_bytes``."""
    kind = _REGISTRY.get(message.type)
    if kind is None:
        raise ValueError(
            f"unknown message type {message.type!r}; registered: {', '.join(registered_types())}"
        )
    wire = {"v": message.v, "type": message.type, "epoch": message.epoch, "iter": message.iteration,
            "stage": message.stage, "src": message.src, "body": kind.dump(message.body)}
    data = msgpack.packb(wire, use_bin_type=True)
    if len(data) > max_bytes:
        raise ValueError(f"{message.type!r} message is {len(data)} bytes, over the {max_bytes}-byte cap")
    return data


def _reject_ext(code: int, data: bytes) -> Any:
    raise DecodeError("ext_type", f"msgpack extension type {code} is not allowed")


def decode(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Parse and validate one message; :class:`DecodeError` for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError("not_bytes", f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise DecodeError("too_large", f"{len(data)} bytes > cap {max_bytes}")
    if len(data) == 0:
        raise DecodeError("empty", "zero-length frame")
    limit = len(data)
    try:
        wire = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext, timestamp=0,
            max_str_len=limit, max_bin_len=limit, max_array_len=limit,
            max_map_len=limit, max_ext_len=limit,
        )
    except DecodeError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack raises many types for bad input
        raise DecodeError("not_msgpack", f"{type(e).__name__}: {str(e)[:120]}") from None
    if not isinstance(wire, dict):
        raise DecodeError("not_a_map", f"top level is {type(wire).__name__}")
    keys = set(wire)
    if keys != _ENVELOPE:
        missing, extra = sorted(_ENVELOPE - keys), sorted(str(k) for k in keys - _ENVELOPE)
        raise DecodeError("bad_envelope", f"missing {missing}, unexpected {extra[:5]}")
    if wire["v"] != SCHEMA_VERSION or isinstance(wire["v"], bool):
        raise DecodeError("bad_version",
                          f"schema version {wire['v']!r:.40}, this side speaks {SCHEMA_VERSION}")
    kind = _REGISTRY.get(wire["type"]) if isinstance(wire["type"], str) else None
    if kind is None:
        raise DecodeError("unknown_type", f"type {wire['type']!r:.80}")
    epoch = _ranged(wire["epoch"], 0, _MAX_INT, "epoch")
    iteration = _ranged(wire["iter"], -1, _MAX_INT, "iter")
    stage = _ranged(wire["stage"], PLANNER, _MAX_RANK, "stage")
    src = _ranged(wire["src"], PLANNER, _MAX_RANK, "src")
    try:
        body = kind.parse(wire["body"])
    except Exception as e:  # noqa: BLE001 - a parser bug must not crash the rank either
        raise DecodeError("bad_body", f"{kind.name}: {str(e)[:200]}") from None
    return Message(type=kind.name, body=body, epoch=epoch, iteration=iteration, stage=stage, src=src)


def _ranged(value: Any, low: int, high: int, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise DecodeError("bad_field", f"{name} must be an integer in [{low}, {high}], got {value!r:.40}")
    return value


@dataclass
class Decoder:
    """Decodes frames for one socket; bad ones are counted by reason, logged and dropped.

    Logging is per message for the first ``log_first`` of each reason, then one summary
    line per ``log_every`` further drops, so a flood of garbage cannot flood the log.
    """

    name: str
    max_bytes: int = MAX_MESSAGE_BYTES
    log_first: int = 100
    log_every: int = 1000
    dropped: Counter = field(default_factory=Counter)

    def accept(self, data: Any) -> Message | None:
        try:
            return decode(data, max_bytes=self.max_bytes)
        except DecodeError as e:
            self.drop(e.reason, e.detail)
            return None

    def drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        n = self.dropped[reason]
        if n <= self.log_first:
            log.warning("%s: dropped a bad control message (%s: %s)", self.name, reason, detail)
        elif n % self.log_every == 0:
            log.warning("%s: %d bad control messages dropped for %s so far (latest: %s)", self.name, n,
                        reason, detail)

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())


# ---------------------------------------------------------------- built-in types
def _map(body: Any, keys: set[str], what: str) -> dict[str, Any]:
    if not isinstance(body, dict) or set(body) != keys:
        got = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise ValueError(f"{what} body must be a map with keys {sorted(keys)}, got {str(got)[:120]}")
    return body


def _parse_stats(body: Any) -> tuple[StageRecord, ...]:
    records = _map(body, {"records"}, "stats")["records"]
    if not isinstance(records, list) or not 0 < len(records) <= MAX_STAGES:
        raise ValueError(f"stats records must be a list of 1-{MAX_STAGES} stage records")
    return tuple(StageRecord.from_wire(r) for r in records)


def _dump_stats(records: Any) -> dict[str, Any]:
    return {"records": [r.to_wire() for r in records]}


def _parse_plan(body: Any) -> Plan:
    return Plan.from_wire(_map(body, {"plan"}, "plan")["plan"])


def _parse_hello(body: Any) -> dict[str, Any]:
    """``{"pid", "endpoint"}``, plus ``"key"`` (the daemon inbox's CURVE public key) when CURVE is on."""
    has_key = isinstance(body, dict) and "key" in body
    body = _map(body, {"pid", "endpoint", "key"} if has_key else {"pid", "endpoint"}, "hello")
    if not isinstance(body["pid"], int) or isinstance(body["pid"], bool) or not 0 < body["pid"] < 1 << 31:
        raise ValueError(f"hello pid must be a positive integer, got {body['pid']!r:.40}")
    check_endpoint(body["endpoint"])  # raises ValueError
    if has_key:
        if not isinstance(body["key"], str):
            raise ValueError(f"hello key must be a string, got {type(body['key']).__name__}")
        check_z85_key(body["key"], "hello key")  # raises ValueError
    return body


def _parse_welcome(body: Any) -> dict[str, Any]:
    body = _map(body, {"plan", "num_stages"}, "welcome")
    plan = None if body["plan"] is None else Plan.from_wire(body["plan"])
    stages = body["num_stages"]
    if not isinstance(stages, int) or isinstance(stages, bool) or not 0 < stages <= MAX_STAGES:
        raise ValueError(f"welcome num_stages must be in 1..{MAX_STAGES}, got {stages!r:.40}")
    return {"plan": plan, "num_stages": stages}


def _dump_welcome(body: dict[str, Any]) -> dict[str, Any]:
    plan = body["plan"]
    return {"plan": None if plan is None else plan.to_wire(), "num_stages": body["num_stages"]}


def _parse_text(field_name: str) -> Callable[[Any], str]:
    def parse(body: Any) -> str:
        text = _map(body, {field_name}, field_name)[field_name]
        if not isinstance(text, str) or len(text) > 1000:
            raise ValueError(f"{field_name} must be a string of at most 1000 characters")
        return text

    return parse


def _parse_empty(body: Any) -> None:
    if body is not None and body != {}:
        raise ValueError("this message type carries no body")


def _parse_done(body: Any) -> int:
    last = _map(body, {"last_iter"}, "done")["last_iter"]
    if not isinstance(last, int) or isinstance(last, bool) or not -1 <= last <= _MAX_INT:
        raise ValueError(f"done last_iter must be an integer >= -1, got {last!r:.40}")
    return last


def _parse_alert(body: Any) -> dict[str, Any]:
    body = _map(body, {"stage", "what", "ratio"}, "alert")
    stage, what, ratio = body["stage"], body["what"], body["ratio"]
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < 1 << 31:
        raise ValueError(f"alert stage must be an integer in [0, 2**31), got {stage!r:.40}")
    if not isinstance(what, str) or len(what) > 200:
        raise ValueError("alert what must be a string of at most 200 characters")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0 < ratio < 1e6):
        raise ValueError(f"alert ratio must be a number in (0, 1e6), got {ratio!r:.40}")
    return {"stage": stage, "what": what, "ratio": float(ratio)}


register_type("stats", _parse_stats, _dump_stats)  # a stats vector: stages 0..k of one iteration
register_type("plan", _parse_plan, lambda plan: {"plan": plan.to_wire()})
register_type("hello", _parse_hello)  # planner daemon -> last stage: attach me
register_type("welcome", _parse_welcome, _dump_welcome)  # last stage -> daemon: attached, current plan
register_type("ping", _parse_empty, lambda body: None)  # liveness, both ways between daemon and last stage
register_type("bye", _parse_text("reason"), lambda reason: {"reason": reason})  # the sender leaves
register_type("done", _parse_done, lambda last: {"last_iter": last})  # upstream stage flushed its last stats
# a rank's pulse saw its stage change (speed, trainable parameters): down the
# chain to the daemon, which has every rank measure again
register_type("alert", _parse_alert, lambda body: dict(body))
