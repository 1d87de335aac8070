"""Who may hold a connection to an inbox: a handshake deadline, a quota, room made for newcomers.

zmq accepts every TCP connection to a bound socket, and each holds a file descriptor. A local
process that opened 1,000 plain TCP connections to a rank's inbox (its port is in the run log
and in ``ss``) used to take the rank past the default open-file limit of 1024; one that held 8
silent connections to each inbox, opening a new one whenever one was cut, kept the run's own
peers out, since they came from the same address (the planner never attached). Now:

* every process that opens an inbox raises its soft ``RLIMIT_NOFILE`` to the hard limit
  (:func:`~vpipe.control.descriptors.raise_open_file_limit`);
* a connection must finish its handshake (the ZMTP greeting, CURVE's and the ZAP check of
  :mod:`vpipe.control.zap`, with or without CURVE) within ``HANDSHAKE_S`` (``ZMQ_HANDSHAKE_IVL``),
  or zmq closes it;
* a :class:`Doorman` thread per inbox follows its connections through zmq's socket monitor
  (``ACCEPTED`` and ``DISCONNECTED`` carry the descriptor) and answers the inbox's ZAP requests.
  Connections not yet authenticated are at most ``MAX_UNPROVEN``: a newcomer past it is let in,
  and the doorman cuts another in its place, from the address that has the most of them: one
  whose peer never sent a ZMTP signature first, else the oldest (a ``shutdown`` through a
  duplicate of its descriptor, checked to be the same connection, after which zmq closes it:
  :mod:`vpipe.control.descriptors`).
  So no number of strangers, silent or trickling bytes, reconnecting as fast as they are cut,
  keeps a peer out: the peer is never the one cut while a stranger that said nothing is there,
  and gets ``MAX_UNPROVEN - 1`` newcomers' time to authenticate otherwise.
* an inbox holds at most ``MAX_CONNECTIONS`` authenticated connections (``DAEMON_CONNECTIONS``
  for the planner daemon's): past them, the ZAP handler holds a handshake unanswered until one
  leaves (or zmq closes it at the deadline, and the peer tries again). So zmq holds at most
  ``MAX_CONNECTIONS x RCVHWM x frame_limit`` bytes of frames (48 MiB with the 1 MiB message cap;
  16 MiB for the daemon), whatever a peer holding the key does.

A connection counts as authenticated once the inbox sent it more than a handshake short of
the ZAP check sends (Linux's ``TCP_INFO``, :mod:`vpipe.control.tcpinfo`: READY goes only after
ZAP said yes), once a frame from it was read (``ZMQ_SRCFD``, reported by the inbox through
:meth:`Doorman.saw`), or once it outlives the handshake deadline. Cuts are counted in ``evicted``
by reason, failed handshakes in ``refused``; each reason is logged at once the first time, then
at most once per ``LOG_EVERY_S`` with the count.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from vpipe.control.descriptors import ConnectionDescriptors
from vpipe.control.tcpinfo import bytes_sent
from vpipe.control.zap import HANDSHAKE_EVENTS, ZapGuard, handshake_failure

log = logging.getLogger("vpipe.control")

__all__ = ["HANDSHAKE_S", "MAX_CONNECTIONS", "DAEMON_CONNECTIONS", "MAX_UNPROVEN", "RCVHWM", "RCVBUF",
           "LOG_EVERY_S", "Doorman"]

HANDSHAKE_S = 3.0  # greeting + CURVE + ZAP within this (ZMQ_HANDSHAKE_IVL; zmq's default is 30 s)
# authenticated connections a rank's inbox holds (its few peers: neighbours, the daemon's two)
MAX_CONNECTIONS = 12
DAEMON_CONNECTIONS = 4  # the planner daemon's (its one peer is the last stage)
MAX_UNPROVEN = 16  # connections not yet authenticated an inbox holds, from every address together
RCVHWM = 2  # frames zmq queues per connection (1 stalls the CURVE handshake in libzmq 4.3.5)
RCVBUF = 256 << 10  # the kernel's receive buffer per connection (SO_RCVBUF): what waits behind zmq's frames
LOG_EVERY_S = 10.0
# What an inbox sends during a handshake (ZMTP 3.0, RFC 23; CURVE, RFC 26): its
# signature at once, the rest of its greeting once the peer's signature came, CURVE's
# WELCOME after a valid HELLO, READY only once ZAP admitted.
SIGNATURE_BYTES = 10
GREETING_BYTES = 64
WELCOME_BYTES = 170
_PROVEN_AFTER_S = 1.0  # alive this long past the handshake deadline: zmq let it finish its handshake
_APPROVAL_S = 1.0  # a ZAP admission counts this long, or until its connection is seen authenticated
_WAKE_MS = 250
_EVENTS_PER_TURN = 64  # monitor events taken before the ZAP requests are served again
# TCP keepalive on accepted connections: a dead peer host's connection closes after about 90 s
_KEEPALIVE = ((zmq.TCP_KEEPALIVE, 1), (zmq.TCP_KEEPALIVE_IDLE, 60), (zmq.TCP_KEEPALIVE_INTVL, 10),
              (zmq.TCP_KEEPALIVE_CNT, 3))
_MONITOR_QUEUE = 100_000  # monitor events waiting for the doorman (about 100 bytes each)
_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_MONITOR_STOPPED
    | HANDSHAKE_EVENTS
)
_T = TypeVar("_T")


@dataclass
class _Connection:
    peer: Any  # what getpeername() said: (host, port, ...)
    since: float  # when the doorman saw it accepted
    proven: bool = False
    cut: bool = False


class _Every:
    """The first occurrence is logged at once, then at most one line
    per ``LOG_EVERY_S`` with the count since."""

    def __init__(self) -> None:
        self.next = 0.0
        self.count = 0

    def due(self, now: float) -> int:
        """How many occurred since the last line when a line is due now, else 0."""
        self.count += 1
        if now < self.next:
            return 0
        self.next = now + LOG_EVERY_S
        count, self.count = self.count, 0
        return count


class Doorman:
    """Watches one zmq socket's connections, and answers its ZAP requests, on a thread of its own.

    Create it before the socket binds, :meth:`start` it with the bound port, :meth:`close` it
    before closing the socket. Its thread uses the monitor socket, the ``guard``'s ZAP socket
    and duplicates of connection descriptors, never the watched socket.
    """

    def __init__(self, sock: zmq.Socket, *, name: str, monitor_max_bytes: int, guard: ZapGuard,
                 max_connections: int | None = None) -> None:
        self.name = name
        self.guard = guard
        self.max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
        self.refused: Counter = Counter()  # failed handshakes by reason (replaced, never changed in place)
        self.evicted: Counter = Counter()  # connections cut (or handshakes held), by reason (the same)
        self.connections: dict[int, _Connection] = {}  # descriptor -> connection (the doorman's thread only)
        self.proven_fds: set[int] = set()  # read by the inbox: which descriptors need no report
        self._reports: list[int] = []  # descriptors a frame came from, appended by the inbox's thread
        # ZAP admissions whose connection was not seen authenticated yet
        self._approvals: deque[float] = deque()
        # more than this sent on a connection: READY went, so ZAP admitted it
        self._authenticated_after = GREETING_BYTES + (WELCOME_BYTES if guard.config is not None else 0)
        self._stop = threading.Event()
        self._logs: dict[str, _Every] = {}
        self._descriptors = ConnectionDescriptors()  # before the socket binds: its reserve is open
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.RCVBUF, RCVBUF)  # on the listening socket: its connections inherit it
        for option, value in _KEEPALIVE:  # a peer host that died without closing frees its slot
            sock.setsockopt(option, value)
        address = f"inproc://monitor.vpipe-{id(self):x}"
        sock.monitor(address, _EVENTS)
        self._sock = sock
        self.monitor = sock.context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.MAXMSGSIZE, monitor_max_bytes)
        self.monitor.setsockopt(zmq.RCVHWM, _MONITOR_QUEUE)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.connect(address)
        self._thread = threading.Thread(target=self._run, name=f"vpipe-doorman {name}", daemon=True)

    def start(self, port: int) -> None:
        self._descriptors.port = port
        self._thread.start()

    def saw(self, fd: int) -> None:
        """A frame came from connection ``fd``, so it authenticated (called on the inbox's thread)."""
        if fd not in self.proven_fds:
            self._reports.append(fd)

    def close(self) -> None:
        self._stop.set()
        self._sock.disable_monitor()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self.monitor.close(linger=0)
        self._descriptors.close()

    # ---------------------------------------------------------------- the doorman's thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(self.guard.zap_socket, zmq.POLLIN)
        holding = False
        while not self._stop.is_set():
            try:
                if not poller.poll(_WAKE_MS):
                    self._scan()  # quiet: note the handshakes that finished since
                self._drain()
                self._take_reports()
                self.guard.serve(self._admit, HANDSHAKE_S)
                # a held request: wake for monitor events and the clock only
                if self.guard.holding != holding:
                    holding = self.guard.holding
                    poller.modify(self.guard.zap_socket, 0 if holding else zmq.POLLIN)
            except zmq.ZMQError as e:  # the context is going away
                if not self._stop.is_set():
                    log.warning("%s: stopped watching its connections (%s)", self.name, e)
                return
            except Exception:  # noqa: BLE001 - a bug here must not leave ZAP requests unanswered
                if self._due("error"):
                    log.exception("%s: error while watching its connections", self.name)

    def _drain(self) -> None:
        for _ in range(_EVENTS_PER_TURN):  # then the ZAP requests: a flood of newcomers never starves them
            if self._stop.is_set() or not int(self.monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._take_reports()  # before a DISCONNECTED: the number may come back as another connection
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted(value)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connections.pop(value, None)
                self.proven_fds.discard(value)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._scan(succeeded=True)
            elif kind != zmq.EVENT_MONITOR_STOPPED:
                self._failed(kind, value)

    def _take_reports(self) -> None:
        while self._reports:
            fd = self._reports.pop()
            if fd in self.connections:
                self._prove(fd)

    def _prove(self, fd: int) -> None:
        connection = self.connections[fd]
        if not connection.proven:
            connection.proven = True
            self.proven_fds.add(fd)
            if self._approvals:  # the admission it had now counts as the connection itself
                self._approvals.popleft()

    def _scan(self, succeeded: bool = False) -> None:
        """Prove the connections whose handshakes finished: READY sent (or, where the kernel does not say, the
        only unproven one when a handshake ``succeeded``)."""
        waiting = self._unproven(time.monotonic())
        unknown = False
        for fd in waiting:
            sent = self._sent(fd)
            if sent is not None and sent > self._authenticated_after:
                self._prove(fd)
            unknown = unknown or sent is None
        if succeeded and unknown and len(waiting) == 1 and waiting[0] in self.connections:
            self._prove(waiting[0])

    def _admit(self, first: bool) -> bool:
        """ZAP: may one more connection authenticate? Not while the inbox holds ``max_connections``."""
        now = time.monotonic()
        while self._approvals and now - self._approvals[0] > _APPROVAL_S:
            self._approvals.popleft()
        self._scan()
        held = sum(1 for c in self.connections.values() if not c.cut and self._is_proven(c, now))
        if held + len(self._approvals) < self.max_connections:
            self._approvals.append(now)
            return True
        if first:
            self._count("inbox_full",
                        f"it holds {self.max_connections} authenticated connections; a handshake "
                        f"waits for one to leave", "held")
        return False

    def _failed(self, kind: int, value: int) -> None:
        reason = handshake_failure(kind, value)
        if reason is None:
            return
        self.refused = self.refused + Counter({reason: 1})
        # the guard logs that one, with the key
        if reason != "untrusted_key" and self._due(f"refused {reason}"):
            log.warning("%s: refused a connection whose handshake failed (%s; %d so far)%s", self.name,
                        reason,
                        self.refused[reason], "" if self.guard.config is None else
                        " - a peer without CURVE or with the wrong keys?")

    def _accepted(self, fd: int) -> None:
        now = time.monotonic()
        peer = self._descriptors.peer(fd)
        if peer is None:  # closed already, its number maybe taken by something else
            self.connections.pop(fd, None)
            return
        self.connections[fd] = _Connection(peer, now)
        self.proven_fds.discard(fd)
        waiting = self._unproven(now)
        if len(waiting) > MAX_UNPROVEN:
            self._make_room(fd, waiting)

    def _make_room(self, newcomer: int, waiting: list[int]) -> None:
        """Cut one unauthenticated connection for ``newcomer``: from the address
        with the most, the oldest that never sent a ZMTP signature (the inbox sent
        its own only), else the oldest; ``newcomer`` only alone."""
        sources = Counter(self.connections[fd].peer[0] for fd in waiting)
        source = max(sources, key=sources.__getitem__)
        candidates = sorted((fd for fd in waiting if fd != newcomer
                             and self.connections[fd].peer[0] == source),
                            key=lambda fd: self.connections[fd].since)
        why = f"{MAX_UNPROVEN} had not authenticated; newer ones need the room"
        spoke: int | None = None  # the oldest that began a handshake: cut only when none is silent
        for fd in candidates:  # oldest first, each looked at once: a flood of silent ones costs one look each
            same, sent = self._on(fd, _cut_if_silent)
            if not same:
                continue
            if sent is not None and sent <= SIGNATURE_BYTES:
                self._was_cut(fd, "unauthenticated", why)
                return
            if sent is not None and sent > self._authenticated_after:
                self._prove(fd)  # finished its handshake: never cut for a newcomer
            elif spoke is None:  # (where the kernel does not say, the oldest goes)
                spoke = fd
        self._cut(newcomer if spoke is None else spoke, "unauthenticated", why)

    def _unproven(self, now: float) -> list[int]:
        """Connections not shown to have authenticated."""
        return [fd for fd, c in self.connections.items() if not (c.cut or self._is_proven(c, now))]

    @staticmethod
    def _is_proven(connection: _Connection, now: float) -> bool:
        return connection.proven or now - connection.since > HANDSHAKE_S + _PROVEN_AFTER_S

    def _on(self, fd: int, act: Callable[[socket.socket], _T]) -> tuple[bool, _T | None]:
        """``act`` on connection ``fd`` if it is still the one seen accepted; (False, None), and the
        connection forgotten, when it is gone."""
        same, result = self._descriptors.on(fd, self.connections[fd].peer, act)
        if not same:
            self.connections.pop(fd, None)  # gone already (its DISCONNECTED is on the way)
        return same, result

    def _sent(self, fd: int) -> int | None:
        """Bytes the inbox sent on connection ``fd`` (None: gone, or the kernel does not say)."""
        return self._on(fd, bytes_sent)[1]

    def _cut(self, fd: int, reason: str, why: str) -> None:
        if self._on(fd, lambda sock: sock.shutdown(socket.SHUT_RDWR))[0]:
            self._was_cut(fd, reason, why)

    def _was_cut(self, fd: int, reason: str, why: str) -> None:
        self.connections[fd].cut = True  # zmq sees the connection end and closes its descriptor
        self._count(reason, why, "cut")

    def _count(self, reason: str, why: str, what: str) -> None:
        self.evicted = self.evicted + Counter({reason: 1})
        count = self._due(f"{what} {reason}")
        if count:
            log.warning("%s: %s %d connection(s) because %s (%d so far)", self.name, what, count, why,
                        self.evicted[reason])

    def _due(self, key: str) -> int:
        return self._logs.setdefault(key, _Every()).due(time.monotonic())


def _cut_if_silent(sock: socket.socket) -> int | None:
    """Bytes the inbox sent on ``sock``; cut when its peer never
    sent a ZMTP signature (the inbox sent its own only)."""
    sent = bytes_sent(sock)
    if sent is not None and sent <= SIGNATURE_BYTES:
        sock.shutdown(socket.SHUT_RDWR)
    return sent
