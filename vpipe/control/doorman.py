"""Who may hold a connection to an inbox: a handshake deadline, caps on connections, the open-file limit.

zmq accepts every TCP connection to a bound socket, and each holds a file descriptor. A local
process that opened 1,000 plain TCP connections to a rank's inbox (its port is in the run log
and in ``ss``) used to take the rank past the default open-file limit of 1024, and
``OSError: [Errno 24] Too many open files`` ended the run. Now:

* every process that opens an inbox raises its soft ``RLIMIT_NOFILE`` to the hard limit
  (:func:`raise_open_file_limit`);
* a connection must finish the ZMTP greeting and, with CURVE, the CURVE handshake and the
  ZAP check within ``HANDSHAKE_S`` (``ZMQ_HANDSHAKE_IVL``), or zmq closes it;
* a :class:`Doorman` thread per inbox follows its connections through zmq's socket monitor
  (``ACCEPTED`` and ``DISCONNECTED`` carry the descriptor). A newcomer is cut at once when
  the inbox already holds ``MAX_CONNECTIONS`` connections, or when its source address already
  has ``MAX_UNPROVEN_PER_SOURCE`` connections not yet shown to have authenticated: a
  ``shutdown`` through a duplicate of its descriptor, checked to be the same connection,
  after which zmq closes it. Connections already held are never cut for a newcomer.

The doorman's thread also answers the inbox's ZAP requests (with CURVE on), always after
taking in every monitor event waiting: a connection's ``ACCEPTED`` comes before its ZAP
request, so a newcomer over a cap is cut before it can authenticate and never carries a frame.
(Cutting a connection that already did is no use: the frames zmq queued for it stay until read.)

So an inbox holds at most ``MAX_CONNECTIONS`` authenticated connections (``DAEMON_CONNECTIONS``
for the planner daemon's), and zmq at most ``RCVHWM`` frames for each: ``MAX_CONNECTIONS x
RCVHWM x frame_limit`` bytes (48 MiB with the 1 MiB message cap; 16 MiB for the daemon),
whatever a peer holding the key does.

A connection counts as proven once a frame from it was read (``ZMQ_SRCFD``, reported by the
inbox through :meth:`Doorman.saw`), once zmq reports a handshake success while it is the only
unproven one, or once it outlives the handshake deadline. Cuts are counted in ``evicted`` by
reason, failed handshakes in ``refused`` by reason; each reason is logged at once the first
time, then at most once per ``LOG_EVERY_S`` with the count.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from vpipe.control.curve import HANDSHAKE_EVENTS, CurveGuard, handshake_failure

log = logging.getLogger("vpipe.control")

__all__ = ["HANDSHAKE_S", "MAX_CONNECTIONS", "DAEMON_CONNECTIONS", "MAX_UNPROVEN_PER_SOURCE", "RCVHWM", "RCVBUF",
           "LOG_EVERY_S", "Doorman", "raise_open_file_limit"]

HANDSHAKE_S = 10.0  # greeting + CURVE + ZAP within this (ZMQ_HANDSHAKE_IVL; zmq's default is 30 s)
MAX_CONNECTIONS = 12  # connections a rank's inbox holds (it has a handful of peers: neighbours, the daemon's two)
DAEMON_CONNECTIONS = 4  # the planner daemon's (its one peer is the last stage)
MAX_UNPROVEN_PER_SOURCE = 8  # connections from one address not yet shown to have authenticated
RCVHWM = 2  # frames zmq queues per connection (1 stalls the CURVE handshake in libzmq 4.3.5)
RCVBUF = 256 << 10  # the kernel's receive buffer per connection (SO_RCVBUF): what waits behind zmq's frames
LOG_EVERY_S = 10.0
_PROVEN_AFTER_S = HANDSHAKE_S + 1.0  # alive this long after being seen: zmq let it finish its handshake
_WAKE_MS = 250
# TCP keepalive on accepted connections: a dead peer host's connection closes after about 90 s
_KEEPALIVE = ((zmq.TCP_KEEPALIVE, 1), (zmq.TCP_KEEPALIVE_IDLE, 60), (zmq.TCP_KEEPALIVE_INTVL, 10),
              (zmq.TCP_KEEPALIVE_CNT, 3))
_MONITOR_QUEUE = 100_000  # monitor events waiting for the doorman (about 100 bytes each)
_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_MONITOR_STOPPED
           | HANDSHAKE_EVENTS)


def raise_open_file_limit() -> tuple[int, int] | None:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; (before, after), or None when unchanged."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:  # e.g. macOS refuses more than OPEN_MAX under an unlimited hard limit
        log.debug("could not raise the open-file limit from %d to %d: %s", soft, target, e)
        return None
    log.info("raised the open-file limit (RLIMIT_NOFILE) from %d to %d, the hard limit", soft, target)
    return soft, target


@dataclass
class _Connection:
    peer: Any  # what getpeername() said: (host, port, ...)
    since: float  # when the doorman saw it accepted
    proven: bool = False
    cut: bool = False


class _Every:
    """The first occurrence is logged at once, then at most one line per ``LOG_EVERY_S`` with the count since."""

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
    """Watches one zmq socket's connections on a thread of its own; see the module's docstring.

    Create it before the socket binds, :meth:`start` it with the bound port, :meth:`close` it
    before closing the socket. Its thread uses the monitor socket, the ``guard``'s ZAP socket
    and duplicates of connection descriptors, never the watched socket.
    """

    def __init__(self, sock: zmq.Socket, *, name: str, monitor_max_bytes: int, guard: CurveGuard | None,
                 max_connections: int | None = None) -> None:
        self.name = name
        self.guard = guard
        self.max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
        self.refused: Counter = Counter()  # failed handshakes by reason (replaced, never changed in place)
        self.evicted: Counter = Counter()  # connections cut, by reason (the same)
        self.connections: dict[int, _Connection] = {}  # descriptor -> connection (the doorman's thread only)
        self.proven_fds: set[int] = set()  # read by the inbox: which descriptors need no report
        self._reports: list[int] = []  # descriptors a frame came from, appended by the inbox's thread
        self._port = 0
        self._stop = threading.Event()
        self._logs: dict[str, _Every] = {}
        self._reserve = _open_reserve()  # closed to make room for a duplicate at the open-file limit
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
        self._port = port
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
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None

    # ---------------------------------------------------------------- the doorman's thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.monitor, zmq.POLLIN)
        if self.guard is not None:
            poller.register(self.guard.zap_socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                poller.poll(_WAKE_MS)
                self._drain()  # first: every connection a waiting ZAP request can be about is known, maybe cut
                if self.guard is not None:
                    self.guard.serve()
                self._take_reports()
            except zmq.ZMQError as e:  # the context is going away
                if not self._stop.is_set():
                    log.warning("%s: stopped watching its connections (%s)", self.name, e)
                return
            except Exception:  # noqa: BLE001 - a bug here must not leave ZAP requests unanswered
                if self._due("error"):
                    log.exception("%s: error while watching its connections", self.name)

    def _drain(self) -> None:
        while not self._stop.is_set() and int(self.monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._take_reports()
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted(value)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connections.pop(value, None)
                self.proven_fds.discard(value)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                waiting = self._unproven(time.monotonic())
                if len(waiting) == 1:  # the only one it can be
                    self._prove(waiting[0])
            elif kind != zmq.EVENT_MONITOR_STOPPED:
                self._failed(kind, value)

    def _take_reports(self) -> None:
        while self._reports:
            fd = self._reports.pop()
            if fd in self.connections:
                self._prove(fd)

    def _prove(self, fd: int) -> None:
        self.connections[fd].proven = True
        self.proven_fds.add(fd)

    def _failed(self, kind: int, value: int) -> None:
        reason = handshake_failure(kind, value)
        if reason is None:
            return
        self.refused = self.refused + Counter({reason: 1})
        if reason != "untrusted_key" and self._due(f"refused {reason}"):  # the guard logs that one, with the key
            log.warning("%s: refused a connection whose handshake failed (%s; %d so far)%s", self.name, reason,
                        self.refused[reason], "" if self.guard is None else
                        " - a peer without CURVE or with the wrong keys?")

    def _accepted(self, fd: int) -> None:
        now = time.monotonic()
        peer = self._peer(fd)
        if peer is None:  # closed already, its number maybe taken by something else
            self.connections.pop(fd, None)
            return
        self.connections[fd] = _Connection(peer, now)
        self.proven_fds.discard(fd)
        if sum(1 for c in self.connections.values() if not c.cut) > self.max_connections:
            self._cut(fd, "inbox_full", f"it holds {self.max_connections} connections")
        elif sum(1 for f in self._unproven(now) if self.connections[f].peer[0] == peer[0]) > MAX_UNPROVEN_PER_SOURCE:
            self._cut(fd, "source_full", f"{MAX_UNPROVEN_PER_SOURCE} from {peer[0]} have not authenticated")

    def _unproven(self, now: float) -> list[int]:
        """Connections not shown to have authenticated."""
        return [fd for fd, c in self.connections.items()
                if not (c.cut or c.proven or now - c.since > _PROVEN_AFTER_S)]

    def _peer(self, fd: int) -> Any:
        """The peer address of connection ``fd`` if it is one of this socket's, else None."""
        sock = self._duplicate(fd)
        try:
            return sock.getpeername() if sock is not None and sock.getsockname()[1] == self._port else None
        except (OSError, IndexError, TypeError):
            return None
        finally:
            self._release(sock)

    def _cut(self, fd: int, reason: str, why: str) -> None:
        connection = self.connections[fd]
        sock = self._duplicate(fd)
        try:  # the very connection (the duplicate pins it): its number may have been reused since
            same = sock is not None and sock.getsockname()[1] == self._port and sock.getpeername() == connection.peer
            if same and sock is not None:
                sock.shutdown(socket.SHUT_RDWR)  # zmq sees the connection end and closes its descriptor
        except (OSError, IndexError, TypeError):
            same = False
        finally:
            self._release(sock)
        if not same:
            self.connections.pop(fd, None)  # gone already (its DISCONNECTED is on the way)
            return
        connection.cut = True
        self.evicted = self.evicted + Counter({reason: 1})
        count = self._due(f"cut {reason}")
        if count:
            log.warning("%s: cut %d new connection(s) because %s (%d so far)", self.name, count, why,
                        self.evicted[reason])

    def _due(self, key: str) -> int:
        return self._logs.setdefault(key, _Every()).due(time.monotonic())

    def _duplicate(self, fd: int) -> socket.socket | None:
        """A socket object on a duplicate of ``fd``, None when it is closed or no socket."""
        try:
            dup = os.dup(fd)
        except OSError as e:
            if e.errno != errno.EMFILE or self._reserve is None:
                return None
            os.close(self._reserve)  # at the limit: the reserve makes room for the duplicate
            self._reserve = None
            try:
                dup = os.dup(fd)
            except OSError:
                return None
        try:
            return socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            return None

    def _release(self, sock: socket.socket | None) -> None:
        if sock is not None:
            sock.close()  # the duplicate only: zmq's descriptor stays open
        if self._reserve is None:
            self._reserve = _open_reserve()


def _open_reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None
