"""The control plane's sockets: one validated inbox per process, one outbox per peer.

Each rank binds a zmq PULL socket (its inbox) on the control host (see
:mod:`vpipe.control.netaddr`) and publishes the endpoint in the run's c10d TCPStore under
``vpipe/ctl/ep/<rank>``; to talk to a peer it connects a PUSH socket to the peer's inbox.
PUSH/PULL keeps per-sender order, which the stats and plan forwarding rely on. Sends
never block (a full queue to a dead peer drops the message, counted and logged), and
every received frame goes through :class:`~vpipe.control.messages.Decoder`. The sockets
carry small control messages only; tensors travel over torch.distributed.

Size caps, on every socket: a frame up to ``max_message_bytes`` is decoded; one up to
:func:`~vpipe.control.messages.frame_limit` (twice that) is read, counted ``too_large``
and dropped; zmq itself cuts the connection of a peer sending more (``maxmsgsize``),
so nothing larger is ever allocated.

With CURVE on (:mod:`vpipe.control.curve`) inboxes are CURVE servers behind the
context's :class:`~vpipe.control.zap.ZapGuard`, outboxes CURVE clients that connect
only to trusted server keys, published under ``vpipe/ctl/key/<rank>``. Without CURVE an
inbox still has a ZAP handler of its own, which admits every NULL handshake.

Each inbox has a :class:`~vpipe.control.doorman.Doorman`: a handshake deadline, a quota of
connections that have not authenticated (a newcomer past it takes the place of one of them)
and one of authenticated connections, and the counts (and logs) of the connections refused
at the handshake or cut.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections import Counter
from collections.abc import Collection
from typing import Any

import zmq

from vpipe.control.curve import CurveConfig, RunKeys
from vpipe.control.descriptors import raise_open_file_limit
from vpipe.control.doorman import Doorman
from vpipe.control.messages import MAX_MESSAGE_BYTES, Decoder, Message, encode, frame_limit
from vpipe.control.netaddr import check_endpoint, control_host, tcp_endpoint
from vpipe.control.pending import MAX_PENDING_BYTES, PendingMessages
from vpipe.control.zap import NULL_DOMAIN, ZapGuard

log = logging.getLogger("vpipe.control")

__all__ = ["MAX_PENDING_BYTES", "Inbox", "Outbox", "ControlPlane", "endpoint_key", "curve_key_key",
           "PLANNER_CONNECT_KEY", "FROM_SETTINGS"]

PLANNER_CONNECT_KEY = "vpipe/ctl/planner"  # the endpoint a standalone planner daemon connects to
_WILDCARDS = ("0.0.0.0", "::", "*")
# ``curve=FROM_SETTINGS``: CURVE as this process's settings configure it (off when unset)
FROM_SETTINGS = "settings"


def endpoint_key(rank: int) -> str:
    return f"vpipe/ctl/ep/{rank}"


def curve_key_key(rank: int) -> str:
    """Store key of a rank's CURVE server public key (set before its endpoint, only with CURVE on)."""
    return f"vpipe/ctl/key/{rank}"


def resolve_curve(curve: CurveConfig | str | None) -> CurveConfig | None:
    if curve == FROM_SETTINGS:
        return RunKeys.of_process().curve()
    if curve is not None and not isinstance(curve, CurveConfig):
        raise TypeError(f"curve must be a CurveConfig, None or {FROM_SETTINGS!r}, got {curve!r:.60}")
    return curve


def new_socket(context: zmq.Context, kind: int, max_message_bytes: int, linger_ms: int) -> zmq.Socket:
    """Every socket vpipe opens comes from here, so none lacks the size cap."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, frame_limit(max_message_bytes))
    sock.setsockopt(zmq.LINGER, linger_ms)
    return sock


# What an inbox holds, so that a flood (even from a peer with the run's key) cannot grow memory without bound:
# zmq queues doorman.RCVHWM frames per connection, for at most doorman.MAX_CONNECTIONS connections;
RECEIVE_BYTES = 1 << 20  # frames read and decoded per receive call; the rest wait in zmq
# and at most pending.MAX_PENDING_BYTES of wire bytes wait decoded for whoever polls for their type.


class Inbox:
    """A PULL socket on a random port of ``bind_host``; yields validated messages only.

    With a ``guard`` holding a CURVE configuration it is a CURVE server that the guard's ZAP
    handler protects; without one it makes a guard of its own for NULL handshakes (the
    context's ZAP handler: one such inbox per context). Its :class:`~vpipe.control.doorman.Doorman`
    caps its connections and counts (and logs) the ones refused at the handshake, by reason,
    and the ones it cut.
    """

    def __init__(self, context: zmq.Context, bind_host: str, advertise_host: str, *, name: str,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, guard: ZapGuard | None = None,
                 max_connections: int | None = None) -> None:
        raise_open_file_limit()  # before the first connection takes a descriptor
        self.name = name
        self.socket = new_socket(context, zmq.PULL, max_message_bytes, 0)
        if ":" in bind_host or ":" in advertise_host:
            self.socket.setsockopt(zmq.IPV6, 1)
        own = guard is None
        guard = ZapGuard(context, None, name=name) if guard is None else guard
        self._own_guard = guard if own else None
        self.curve_key = None if guard.config is None else guard.config.public
        if guard.config is not None:
            guard.config.make_server(self.socket)
        else:
            # so libzmq asks the guard about NULL handshakes
            self.socket.setsockopt(zmq.ZAP_DOMAIN, NULL_DOMAIN)
        self.doorman = Doorman(self.socket, name=name, monitor_max_bytes=frame_limit(max_message_bytes),
                               # its thread answers ZAP requests
                               guard=guard, max_connections=max_connections)
        bind = "*" if bind_host in _WILDCARDS else (f"[{bind_host}]" if ":" in bind_host else bind_host)
        try:
            port = self.socket.bind_to_random_port(f"tcp://{bind}")
        except BaseException:
            self.close()
            raise
        self.doorman.start(port)
        self.endpoint = tcp_endpoint(advertise_host, port)
        self.decoder = Decoder(name=name, max_bytes=max_message_bytes)

    @property
    def refused(self) -> Counter:
        """Connections whose handshake failed, by reason (counted by the doorman's thread as they happen)."""
        return self.doorman.refused

    @property
    def evicted(self) -> Counter:
        """Connections the doorman cut (``unauthenticated``) or
        handshakes it held (``inbox_full``), by reason."""
        return self.doorman.evicted

    def receive(self, timeout_ms: int = 0, limit: int = 1000) -> list[Message]:
        """Up to ``limit`` valid messages (about ``RECEIVE_BYTES``),
        waiting at most ``timeout_ms`` for the first."""
        return [message for message, _ in self.receive_sized(timeout_ms, limit)]

    def receive_sized(self, timeout_ms: int = 0, limit: int = 1000,
                      max_bytes: int = RECEIVE_BYTES) -> list[tuple[Message, int]]:
        """:meth:`receive`, with each message's size on the wire; stops once ``max_bytes`` were read."""
        if timeout_ms > 0 and not self.socket.poll(timeout_ms):
            return []
        out: list[tuple[Message, int]] = []
        read = 0
        # (asked of the socket itself: poll(0) builds a Poller at every call, and every rank asks every step)
        while len(out) < limit and read < max_bytes and int(self.socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            read += sum(len(f) for f in frames)
            self.doorman.saw(frames[0].get(zmq.SRCFD))  # a frame came: that connection authenticated
            if len(frames) != 1:
                self.decoder.drop("multipart", f"{len(frames)} frames; control messages are one frame")
                continue
            message = self.decoder.accept(frames[0].buffer)  # (a view: msgpack copies what it keeps)
            if message is not None:
                out.append((message, len(frames[0])))
        return out

    def close(self) -> None:
        self.doorman.close()
        self.socket.close(linger=0)
        if self._own_guard is not None:
            self._own_guard.close()


class Outbox:
    """A PUSH socket connected to one peer's inbox; :meth:`send` never blocks.

    With ``curve`` it is a CURVE client, and ``server_key`` (the peer's) must be trusted.
    """

    def __init__(self, context: zmq.Context, endpoint: str, *, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 queue: int = 1000, linger_ms: int = 1000, curve: CurveConfig | None = None,
                 server_key: bytes | str | None = None) -> None:
        host, _ = check_endpoint(endpoint)
        server = None if curve is None else curve.check_server_key(server_key,
                                                                   f"the control endpoint {endpoint}")
        self.endpoint = endpoint
        self.max_message_bytes = max_message_bytes
        self.socket = new_socket(context, zmq.PUSH, max_message_bytes, linger_ms)
        self.socket.setsockopt(zmq.SNDHWM, queue)
        if ":" in host:
            self.socket.setsockopt(zmq.IPV6, 1)
        if curve is not None and server is not None:
            curve.make_client(self.socket, server)
        self.socket.connect(endpoint)

    def send(self, message: Message) -> bool:
        """Queue one message; False when the peer's queue is full (it is gone or stuck)."""
        data = encode(message, max_bytes=self.max_message_bytes)
        try:
            self.socket.send(data, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self, linger_ms: int | None = None) -> None:
        self.socket.close(linger=linger_ms)


class ControlPlane:
    """One rank's control sockets: its inbox, outboxes to peers, endpoints via the TCPStore.

    ``curve``: a :class:`~vpipe.control.curve.CurveConfig`, None (off), or ``FROM_SETTINGS`` (the default: as
    this process's settings say, on when ``VPIPE_CURVE_SECRET_FILE`` / ``VPIPE_CURVE_PUBLIC_KEYS`` are set).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        host: str | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        lookup_timeout_s: float = 60.0,
        curve: CurveConfig | str | None = FROM_SETTINGS,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        bind, advertise = control_host(explicit=host)
        self.curve = resolve_curve(curve)
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.max_message_bytes = max_message_bytes
        self.lookup_timeout_s = lookup_timeout_s
        self._context = zmq.Context()
        name = f"rank {rank} control inbox"
        self.guard = None if self.curve is None else ZapGuard(self._context, self.curve, name=name)
        self.inbox = Inbox(self._context, bind, advertise, name=name, max_message_bytes=max_message_bytes,
                           guard=self.guard)
        self._peers: dict[int | str, Outbox] = {}
        self.pending = PendingMessages(name, self.inbox.decoder.dropped)  # what nobody polled for yet
        self.send_failures: Counter = Counter()
        if self.curve is not None:
            # before the endpoint: whoever sees one finds both
            store.set(curve_key_key(rank), self.curve.public)
        store.set(endpoint_key(rank), self.inbox.endpoint)
        log.info("rank %d: control inbox at %s (bound to %s%s)", rank, self.inbox.endpoint, bind,
                 ", CURVE" if self.curve else "",
                 extra={"vpipe_fields": {"control_endpoint": self.inbox.endpoint, "bind": bind,
                                         "curve": self.curve is not None}})

    @property
    def endpoint(self) -> str:
        return self.inbox.endpoint

    @property
    def dropped(self) -> Counter:
        """Received messages dropped as invalid, by reason."""
        return self.inbox.decoder.dropped

    @property
    def refused(self) -> Counter:
        """Connections refused at the handshake, by reason (``untrusted_key``, ``mechanism_mismatch`` ...)."""
        return self.inbox.refused

    @property
    def evicted(self) -> Counter:
        """Connections the inbox cut to stay within its caps, by reason (see :mod:`vpipe.control.doorman`)."""
        return self.inbox.evicted

    def endpoint_of(self, rank: int) -> str:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        key = endpoint_key(rank)
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.lookup_timeout_s))
            endpoint = self.store.get(key).decode()
        except Exception as e:  # noqa: BLE001 - c10d raises DistStoreError/RuntimeError on timeout
            raise TimeoutError(
                f"rank {self.rank}: rank {rank} did not publish its control endpoint within "
                f"{self.lookup_timeout_s:.0f} s ({type(e).__name__}: {e})"
            ) from None
        check_endpoint(endpoint)
        return endpoint

    def server_key_of(self, rank: int) -> bytes | None:
        """The CURVE key rank ``rank`` published (call after :meth:`endpoint_of`); checks both ends agree."""
        key = curve_key_key(rank)
        published = self.store.get(key) if self.store.check([key]) else None
        if self.curve is None:
            if published is not None:
                raise ValueError(f"rank {self.rank}: rank {rank} runs its control plane with CURVE but this "
                                 "rank does not: set VPIPE_CURVE_SECRET_FILE and "
                                 "VPIPE_CURVE_PUBLIC_KEYS here too")
            return None
        return self.curve.check_server_key(published, f"rank {rank}")

    # ---------------------------------------------------------------- sending
    def _outbox(self, endpoint: str, server_key: bytes | str | None) -> Outbox:
        return Outbox(self._context, endpoint, max_message_bytes=self.max_message_bytes, curve=self.curve,
                      server_key=server_key)

    def connect(self, name: str, endpoint: str, server_key: bytes | str | None = None) -> None:
        """Add (or re-point) a named peer that is not a rank, e.g.
        ``"planner"`` (its CURVE key with CURVE on)."""
        outbox = self._outbox(endpoint, server_key)  # raises before the old peer is dropped
        self.disconnect(name)
        self._peers[name] = outbox

    def disconnect(self, name: int | str) -> None:
        outbox = self._peers.pop(name, None)
        if outbox is not None:
            outbox.close(linger_ms=0)

    def send(self, peer: int | str, message: Message) -> bool:
        """Send without blocking; False (counted, logged) when the peer's queue is full."""
        outbox = self._peers.get(peer)
        if outbox is None:
            if not isinstance(peer, int):
                raise KeyError(f"no control peer named {peer!r}; connect() it first")
            endpoint = self.endpoint_of(peer)
            outbox = self._peers[peer] = self._outbox(endpoint, self.server_key_of(peer))
        if outbox.send(message):
            return True
        self.send_failures[peer] += 1
        n = self.send_failures[peer]
        if n <= 10 or n % 1000 == 0:
            log.warning("rank %d: control queue to %s is full; dropped a %r message (%d so far)",
                        self.rank, _peer_name(peer), message.type, n)
        return False

    # ---------------------------------------------------------------- receiving
    def poll(self, timeout_ms: int = 0, *, types: Collection[str] | None = None) -> list[Message]:
        """Valid messages received so far (waiting at most ``timeout_ms`` for one); never raises on bad input.

        With ``types``, only messages of those types are returned; the others stay queued
        for whoever polls for them (the stage agent and the migration protocol share one inbox).
        """
        if types is not None:
            self.pending.asked.update(types)  # before adding: what arrives for them is kept first
        self.pending.add(self.inbox.receive_sized(0 if self.pending.has(types) else timeout_ms))
        return self.pending.take(types)

    def recv(self, type: str, *, from_rank: int | None = None, timeout_s: float) -> Message:
        """Block until a ``type`` message (from ``from_rank`` if
        given) arrives; others wait in :meth:`poll`."""
        waiting = self.pending.take_first(type, from_rank)
        if waiting is not None:
            return waiting
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                source = f"rank {from_rank}" if from_rank is not None else "any peer"
                raise TimeoutError(f"rank {self.rank}: no {type!r} message from {source} "
                                   f"within {timeout_s:.1f} s")
            found, others = None, []
            for message, nbytes in self.inbox.receive_sized(min(remaining_ms, 100)):
                if found is None and _matches(message, type, from_rank):
                    found = message
                else:
                    others.append((message, nbytes))
            self.pending.add(others)
            if found is not None:
                return found

    def close(self, linger_ms: int = 1000) -> None:
        """Close every socket; queued outgoing messages get ``linger_ms`` to leave."""
        for outbox in self._peers.values():
            outbox.close(linger_ms=linger_ms)
        self._peers.clear()
        self.inbox.close()
        if self.guard is not None:
            self.guard.close()
        self._context.term()


def _matches(message: Message, type: str, from_rank: int | None) -> bool:
    return message.type == type and (from_rank is None or message.src == from_rank)


def _peer_name(peer: int | str) -> str:
    return f"rank {peer}" if isinstance(peer, int) else str(peer)

