"""A local process that squats on control inboxes: raw TCP connections that never authenticate.

``python tests/support/squatter.py --log RUN_LOG [--per-endpoint 8] [--seconds S]`` (or ``--endpoint
tcp://HOST:PORT``, repeatable) holds ``--per-endpoint`` connections to every control inbox the run
log names (each rank's and the planner daemon's, as they appear), half of them silent and half
sending one byte of a valid ZMTP greeting every ``--trickle-s`` seconds (so the handshake never
ends), and opens a new one at once whenever one is cut: what issue 56 measured keeping a run's own
peers out of its inboxes. It says when it first holds all its connections to an endpoint
(``{"holding": ENDPOINT}``), and on SIGTERM, or after ``--seconds``, what it did, each as one JSON line.
"""

from __future__ import annotations

import argparse
import errno
import json
import selectors
import signal
import socket
import time
from dataclasses import dataclass, field

# a ZMTP 3.0 greeting asking for CURVE: sent one byte at a time, it keeps a handshake going and never ends it
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" + bytes(31)
RETRY_S = 0.05  # after a refused connect: the inbox is gone (or not there yet)


@dataclass
class Held:
    sock: socket.socket
    endpoint: str
    trickle: bool
    accepted: bool = False  # the inbox sent its greeting's first bytes (a connection cut at once never is)
    sent: int = 0
    next_byte: float = 0.0


@dataclass
class Squatter:
    per_endpoint: int
    trickle_s: float
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    held: dict[int, Held] = field(default_factory=dict)
    opened: int = 0
    cut: int = 0
    refused: int = 0
    endpoints: dict[str, float] = field(default_factory=dict)  # endpoint -> when a connect may be tried again
    holding: set[str] = field(default_factory=set)  # endpoints it held all its connections to, at least once

    def add(self, endpoint: str) -> None:
        self.endpoints.setdefault(endpoint, 0.0)

    def fill(self, now: float) -> None:
        for endpoint, retry_at in self.endpoints.items():
            if now < retry_at:
                continue
            mine = [h for h in self.held.values() if h.endpoint == endpoint]
            for i in range(len(mine), self.per_endpoint):
                if not self._open(endpoint, trickle=i % 2 == 1, now=now):
                    self.endpoints[endpoint] = now + RETRY_S
                    break

    def _open(self, endpoint: str, *, trickle: bool, now: float) -> bool:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setblocking(False)
        code = sock.connect_ex((host.strip("[]"), int(port)))
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            self.refused += 1
            return False
        self.held[sock.fileno()] = Held(sock, endpoint, trickle, next_byte=now + self.trickle_s)
        self.selector.register(sock, selectors.EVENT_READ)
        self.opened += 1
        return True

    def _say_holding(self, endpoint: str) -> None:
        mine = sum(1 for h in self.held.values() if h.endpoint == endpoint and h.accepted)
        if mine == self.per_endpoint and endpoint not in self.holding:
            self.holding.add(endpoint)
            print(json.dumps({"holding": endpoint}), flush=True)

    def _drop(self, held: Held) -> None:
        self.selector.unregister(held.sock)
        self.held.pop(held.sock.fileno(), None)
        held.sock.close()

    def serve(self, timeout_s: float) -> None:
        """Read and discard what the inboxes send; a connection that ends is counted and reopened at once."""
        now = time.monotonic()
        for key, _ in self.selector.select(timeout_s):
            held = self.held[key.fd]
            try:
                data = held.sock.recv(4096)
            except BlockingIOError:
                continue
            except ConnectionRefusedError:  # nobody listens (yet, or any more): try again a little later
                self.refused += 1
                self.endpoints[held.endpoint] = now + RETRY_S
                self._drop(held)
                continue
            except OSError:
                data = b""
            if data:
                if not held.accepted:
                    held.accepted = True
                    self._say_holding(held.endpoint)
                continue
            self.cut += 1  # cut (at once, or at the handshake deadline): reopened below, at once
            self._drop(held)
        for held in list(self.held.values()):
            if held.trickle and now >= held.next_byte and held.sent < len(GREETING):
                try:
                    held.sock.send(GREETING[held.sent:held.sent + 1])
                    held.sent += 1
                except OSError:
                    pass  # not connected yet, or cut: the selector says which
                held.next_byte = now + self.trickle_s
        self.fill(time.monotonic())


def endpoints_in(log_file: str, offset: int) -> tuple[list[str], int]:
    """Control endpoints in the run log's complete lines from ``offset`` on, and where they end."""
    try:
        with open(log_file, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    found = []
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        try:
            endpoint = json.loads(line).get("control_endpoint")
        except (ValueError, AttributeError):
            continue
        if isinstance(endpoint, str) and endpoint.startswith("tcp://"):
            found.append(endpoint)
    return found, offset + end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", help="the run log to read control endpoints from, as they appear")
    parser.add_argument("--endpoint", action="append", default=[])
    parser.add_argument("--per-endpoint", type=int, default=8)
    parser.add_argument("--trickle-s", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=600.0)
    args = parser.parse_args()
    squatter = Squatter(args.per_endpoint, args.trickle_s)
    for endpoint in args.endpoint:
        squatter.add(endpoint)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    deadline, offset, next_read = time.monotonic() + args.seconds, 0, 0.0
    print(json.dumps({"ready": True}), flush=True)
    while not stop and time.monotonic() < deadline:
        if args.log and time.monotonic() >= next_read:
            found, offset = endpoints_in(args.log, offset)
            for endpoint in found:
                squatter.add(endpoint)
            next_read = time.monotonic() + 0.02
        squatter.serve(0.02)
    print(json.dumps({"endpoints": sorted(squatter.endpoints), "opened": squatter.opened, "cut": squatter.cut,
                      "held": len(squatter.held), "refused": squatter.refused}), flush=True)


if __name__ == "__main__":
    main()
