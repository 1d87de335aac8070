"""A control inbox in a process of its own, and a peer holding the run's key, for tests that attack inboxes.

The inbox is a ``ControlPlane`` with the run's CURVE key (or none), polled every 100-200 ms like a
rank between steps; it reports what arrived, and when, what it refused and cut, and whether it
could open files all along (tests/integration/test_control_exhaustion.py,
tests/integration/test_control_squatter.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import zmq

from support.processes import ROOT, child_env
from vpipe.control.curve import RUN_SECRET_ENV
from vpipe.control.messages import encode, make

# The inbox under test: prints its endpoint, then every 100 ms (or POLL_S) polls its plane and
# checks it can still open 64 files at once (what a rank needs now and then: a checkpoint, a
# /proc read, a data loader); given on stdin the number of its peers' last message, it goes on
# until that one arrived (30 s at most) and prints what it got (and when each first arrived) as JSON.
INBOX = r"""
import json, os, resource, sys, threading, time
import psutil
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
limit = int(os.environ["TEST_NOFILE"])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit if os.environ.get("TEST_HARD") else hard))
from vpipe.control.channel import ControlPlane

class Store(dict):
    def set(self, key, value): self[key] = value if isinstance(value, bytes) else str(value).encode()
    def get(self, key): return self[key]
    def check(self, keys): return all(k in self for k in keys)
    def wait(self, keys, timeout=None): pass

# CURVE with the run's key from the environment, if given
plane = ControlPlane(Store(), 0, 2, host="127.0.0.1")
print(plane.endpoint, flush=True)
last = []  # the number of the last message its peers send, given with "stop"
threading.Thread(target=lambda: last.append(int(sys.stdin.readline())), daemon=True).start()
me, got, arrived, failures, fds = psutil.Process(), [], {}, [], []
poll_s = float(os.environ.get("POLL_S", "0.1"))
deadline = float("inf")
while not (last and last[0] in got) and time.monotonic() < deadline:
    if last and deadline == float("inf"):
        deadline = time.monotonic() + 30.0
    for m in plane.poll(timeout_ms=1):
        got.append(m.body)
        arrived.setdefault(m.body, time.time())
    try:
        files = [open(os.devnull) for _ in range(64)]
        for f in files: f.close()
    except OSError as e:
        failures.append(repr(e))
    fds.append(me.num_fds())
    time.sleep(poll_s)
print(json.dumps({"got": got, "arrived": arrived, "failures": failures[:3], "failed": len(failures),
                  "max_fds": max(fds), "limit": resource.getrlimit(resource.RLIMIT_NOFILE),
                  "refused": dict(plane.refused), "evicted": dict(getattr(plane, "evicted", {})),
                  "dropped": dict(plane.dropped)}),
      flush=True)
plane.close(linger_ms=0)
"""


class Friend:
    """A peer holding the run's key (None: a run without CURVE): a PUSH
    socket sending numbered ``done`` messages from a thread."""

    def __init__(self, context: zmq.Context, endpoint: str, secret: bytes | None, first: int) -> None:
        self.socket = context.socket(zmq.PUSH)
        self.socket.linger = 0
        if secret is not None:
            public = zmq.curve_public(secret)
            self.socket.curve_serverkey, self.socket.curve_publickey = public, public
            self.socket.curve_secretkey = secret
        self.socket.connect(endpoint)
        self.sent: list[int] = []
        self.next = first

    def send(self) -> None:
        # blocks until connected: queued, never lost
        self.socket.send(encode(make("done", self.next, stage=1)))
        self.sent.append(self.next)
        self.next += 1

    def keep_sending(self, stop: threading.Event, every_s: float = 0.05) -> threading.Thread:
        def run() -> None:
            while not stop.is_set():
                self.send()
                time.sleep(every_s)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def start_inbox(secret: bytes | None, nofile: int, *, hard: bool = False,
                poll_s: float = 0.1) -> tuple[subprocess.Popen, str]:
    """The inbox program in a process of its own, with the run's key ``secret`` (None: without CURVE)."""
    env = child_env(TEST_NOFILE=str(nofile), POLL_S=str(poll_s))
    if secret is not None:
        env[RUN_SECRET_ENV] = secret.decode()
    if hard:
        env["TEST_HARD"] = "1"
    inbox = subprocess.Popen([sys.executable, "-c", INBOX], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    endpoint = inbox.stdout.readline().strip()
    assert endpoint.startswith("tcp://127.0.0.1:"), inbox.communicate(timeout=30)[1][-3000:]
    return inbox, endpoint


def finish(inbox: subprocess.Popen, last: int) -> tuple[dict, str]:
    """Tell the inbox its peers' last message and wait for its report (and its log)."""
    out, err = inbox.communicate(f"{last}\n", timeout=60)
    assert inbox.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err
