"""An inbox's ZAP handler: every handshake to the inbox ends here, and waits while the inbox is full.

libzmq asks a context's ZAP handler (RFC 27, ``inproc://zeromq.zap.01``) before it lets a
connection's handshake finish. With CURVE, :class:`ZapGuard` admits clients whose public key is
trusted; without CURVE it admits every NULL handshake, but the inbox asks all the same, because:

* the inbox's :class:`~vpipe.control.doorman.Doorman`, on whose thread the guard is served, has
  the last word on every connection that would authenticate: while the inbox holds its quota of
  authenticated connections a request is held, unanswered, and answered once one of them leaves
  (or refused once it has waited ``hold_s``: zmq has closed its connection by then). A refusal
  alone would not do: a CURVE client refused with 300 tries again, a NULL one gives up for good.
* with a ZAP handler libzmq refuses ZMTP 1.0 peers, which have no handshake at all: a raw
  connection trickling bytes that do not begin a ZMTP 3 greeting was otherwise held for good.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import zmq
from zmq.utils import z85

from vpipe.control.curve import CurveConfig, log_due

log = logging.getLogger("vpipe.control")

__all__ = ["ZAP_ENDPOINT", "NULL_DOMAIN", "HANDSHAKE_EVENTS", "ZapGuard", "handshake_failure"]

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
# an inbox without CURVE sets it: libzmq asks ZAP about NULL handshakes only with a domain
NULL_DOMAIN = b"vpipe"
FULL = b"300"  # the status of a request refused because the inbox stayed full (a CURVE client retries)


class ZapGuard:
    """The ZAP handler of one zmq context: admits CURVE clients with a trusted key (or, with ``config`` None,
    every NULL peer), logs the others, and holds a request while the inbox's doorman has no room for it.

    It binds the context's ZAP endpoint at once: it must exist before the context's inbox binds, since
    without a ZAP handler libzmq admits every client. The requests are answered by :meth:`serve`, on the
    thread of the inbox's :class:`~vpipe.control.doorman.Doorman`.
    """

    def __init__(self, context: zmq.Context, config: CurveConfig | None, *, name: str) -> None:
        self.config = config
        self.name = name
        self.refused: Counter = Counter()  # client public key -> refusals
        self._lock = threading.Lock()
        self._held: list[bytes] | None = None  # a request that may authenticate, waiting for room
        self._held_since = 0.0
        self.zap_socket = context.socket(zmq.REP)
        self.zap_socket.setsockopt(zmq.LINGER, 0)
        self.zap_socket.setsockopt(zmq.MAXMSGSIZE, 4096)  # a ZAP request is a few short frames
        self.zap_socket.bind(ZAP_ENDPOINT)

    @property
    def holding(self) -> bool:
        """Whether a request waits for room (the next ones wait behind it, unread)."""
        return self._held is not None

    def serve(self, admit: Callable[[bool], bool] | None = None, hold_s: float = 0.0) -> None:
        """Answer the waiting ZAP requests in turn; only ever called on one thread.

        A request that may authenticate is admitted when ``admit(first)`` says so (``first``: the first time
        it is asked about that request); else it is held, and asked about again at the next call, until it
        is admitted or has waited ``hold_s`` (then refused as ``300``).
        """
        while True:
            request = self._held
            if request is None:
                if not int(self.zap_socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return
                try:
                    request = self.zap_socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
            answer = self._refusal(request)
            if answer is None:
                first = self._held is None
                if admit is None or admit(first):
                    user = b"" if self.config is None else z85.encode(request[6])
                    answer = [b"1.0", request[1], b"200", b"OK", user, b""]
                elif first or time.monotonic() - self._held_since < hold_s:
                    if first:
                        self._held, self._held_since = request, time.monotonic()
                    return
                else:
                    answer = [b"1.0", request[1], FULL, b"the inbox is full", b"", b""]
            self._held = None
            self.zap_socket.send_multipart(answer)

    def _refusal(self, request: list[bytes]) -> list[bytes] | None:
        """The answer that refuses ``request``; None when it may authenticate."""
        if len(request) < 6 or request[0] != b"1.0":
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"malformed ZAP request", b"",
                    b""]
        request_id, domain, mechanism, credentials = request[1], request[2], request[5], request[6:]
        if self.config is None:
            return None if mechanism == b"NULL" else [b"1.0", request_id, b"400", b"NULL only", b"", b""]
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            return [b"1.0", request_id, b"400", b"CURVE only", b"", b""]
        if not self.callback(domain.decode("utf-8", "replace"), z85.encode(credentials[0])):
            return [b"1.0", request_id, b"400", b"untrusted key", b"", b""]
        return None

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: is this client's public key trusted? (called on the thread that serves the guard)"""
        if self.config is not None and key in self.config.trusted:
            return True
        with self._lock:
            self.refused[key] += 1
            n = self.refused[key]
        if log_due(n):
            log.warning("%s: refused a CURVE client with an untrusted public key %s (%d time%s)",
                        self.name, key.decode("ascii", "replace"), n, "" if n == 1 else "s")
        return False

    def close(self) -> None:
        self.zap_socket.close(linger=0)


def handshake_failure(event: int, value: int) -> str | None:
    """The reason a monitored handshake failed, in vpipe's words; None for other events."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # ZAP said no: its status code in value
        return "inbox_full" if value == int(FULL) else "untrusted_key"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return _PROTOCOL_REASONS.get(value, "protocol_error")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "handshake_failed"
    return None


_PROTOCOL_REASONS: dict[int, str] = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "mechanism_mismatch",  # e.g. a client without CURVE
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "cryptographic",  # e.g. a client using the wrong server key
}

HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
