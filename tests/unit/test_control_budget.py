"""What an inbox and the migration's messenger keep is bounded: connections, handshakes, waiting messages.

The floods themselves, from other processes, are in ``tests/integration/test_control_exhaustion.py``;
here the parts: the open-file limit, the handshake deadline, the caps on connections, the
pending queue and the migration messages held for later moves (docs/control-plane.md).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest
import zmq

from support.control import wait_for
from support.processes import ROOT, child_env
from vpipe.control.channel import Inbox
from vpipe.control.curve import CurveConfig
from vpipe.control.messages import Message, encode, make
from vpipe.control.pending import PendingMessages
from vpipe.control.zap import ZapGuard
from vpipe.migration import messages as migration
from vpipe.migration.messages import ControlMessenger

# ---------------------------------------------------------------- the open-file limit


def test_opening_an_inbox_raises_the_open_file_limit_to_the_hard_limit():
    program = (
        "import resource\nsoft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\nimport zmq\n"
        "from vpipe.control.channel import Inbox\ncontext = zmq.Context()\n"
        "inbox = Inbox(context, '127.0.0.1', '127.0.0.1', name='t')\n"
        "print(*resource.getrlimit(resource.RLIMIT_NOFILE))\ninbox.close(); context.term()\n"
    )
    out = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=child_env(), capture_output=True,
                         text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    soft, hard = map(int, out.stdout.split())
    assert soft == hard, (soft, hard)  # what a default shell's 1024 would have been


# ---------------------------------------------------------------- the doorman: deadline and caps
@pytest.fixture
def inbox(monkeypatch):
    made: list = []

    def make_inbox(curve: CurveConfig | None = None, **caps: float) -> Inbox:
        from vpipe.control import doorman  # (here: the tests of the other parts run without it)

        for name, value in caps.items():
            monkeypatch.setattr(doorman, name, value)
        context = zmq.Context()
        guard = None if curve is None else ZapGuard(context, curve, name="test inbox")
        box = Inbox(context, "127.0.0.1", "127.0.0.1", name="test inbox", guard=guard)
        made.append((context, guard, box))
        return box

    yield make_inbox
    for context, guard, box in made:
        box.close()
        if guard is not None:
            guard.close()
        context.destroy(linger=0)


def _port(box: Inbox) -> int:
    return int(box.endpoint.rsplit(":", 1)[1])


def test_a_connection_that_says_nothing_is_closed_at_the_handshake_deadline(inbox):
    box = inbox(HANDSHAKE_S=1.0)
    with socket.create_connection(("127.0.0.1", _port(box)), timeout=5) as silent:
        start = time.monotonic()
        assert silent.recv(64)[:1] == b"\xff"  # zmq's greeting: it is listening
        silent.settimeout(6)
        while silent.recv(64):  # until zmq closes it (zmq's own default: 30 s)
            pass
        waited = time.monotonic() - start
    assert 0.5 < waited < 4.0, waited
    assert wait_for(lambda: box.refused["handshake_failed"] >= 1), box.refused


def _closed(sock: socket.socket) -> bool:
    """Whether the inbox closed this raw connection (its greeting read, then end of stream)."""
    sock.settimeout(0.5)
    try:
        while sock.recv(64):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def _silent(box: Inbox, count: int) -> list[socket.socket]:
    """``count`` raw connections that say nothing, each seen by the
    doorman before the next (so in that order)."""
    held = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", _port(box)), timeout=5)
        assert sock.recv(10)[:1] == b"\xff"  # accepted: zmq sent its signature
        held.append(sock)
        time.sleep(0.01)
    return held


def _peer(context: zmq.Context, curve: CurveConfig | None, endpoint: str) -> zmq.Socket:
    peer = context.socket(zmq.PUSH)
    peer.linger = 0
    if curve is not None:
        curve.make_client(peer, curve.public)
    peer.connect(endpoint)
    return peer


def _curve(keyed: bool) -> CurveConfig | None:
    public, secret = zmq.curve_keypair()
    return CurveConfig(public=public, secret=secret, trusted=frozenset({public})) if keyed else None


def _received(box: Inbox, got: list, want: list, timeout_s: float) -> bool:
    def arrived() -> bool:
        got.extend(m.body for m in box.receive())
        return got == want

    return wait_for(arrived, timeout_s=timeout_s)


def test_past_the_quota_of_unauthenticated_connections_the_oldest_make_room(inbox, caplog):
    box = inbox(MAX_UNPROVEN=4)
    with caplog.at_level(logging.WARNING, logger="vpipe.control"):
        held = _silent(box, 10)
        try:
            assert wait_for(lambda: box.evicted["unauthenticated"] >= 6), box.evicted
            closed = [_closed(s) for s in held]
        finally:
            for s in held:
                s.close()
    assert closed == [True] * 6 + [False] * 4  # each newcomer got in, the oldest silent one went for it
    assert box.evicted == Counter(unauthenticated=6)
    cuts = [r.getMessage() for r in caplog.records if "connection(s)" in r.getMessage()]
    assert cuts == ["test inbox: cut 1 connection(s) because 4 had not authenticated; "
                    "newer ones need the room (1 so far)"]  # then at most one line per 10 s


@pytest.mark.parametrize("keyed", [True, False], ids=["curve", "null"])
def test_strangers_that_fill_the_quota_never_keep_a_peer_out_nor_cut_it(inbox, keyed):
    """Issue 56: 8 silent connections from the peers' own address, reopened as they were
    cut, kept every peer out. Now a peer gets in at once, and no number of strangers coming
    after cuts it: one that said nothing goes before one that began a handshake, and a
    connection that authenticated is never cut for a newcomer."""
    curve = _curve(keyed)
    box = inbox(curve, MAX_UNPROVEN=4, HANDSHAKE_S=30.0)  # none closed at the deadline while the test runs
    context = zmq.Context()
    held = _silent(box, 4)
    try:
        # says a ZMTP signature, no more
        talker = socket.create_connection(("127.0.0.1", _port(box)), timeout=5)
        talker.sendall(b"\xff" + bytes(8) + b"\x7f")
        held.append(talker)
        start = time.monotonic()
        peer = _peer(context, curve, box.endpoint)
        ends = peer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        peer.send(encode(make("done", 0, stage=1)))
        got: list = []
        assert _received(box, got, [0], timeout_s=3.0), box.evicted
        waited = time.monotonic() - start
        held += _silent(box, 20)  # many more, as fast as they come: they make room among themselves
        # 2 + 20 - the room the peer left
        assert wait_for(lambda: box.evicted["unauthenticated"] >= 21), box.evicted
        peer.send(encode(make("done", 1, stage=1)))
        assert _received(box, got, [0, 1], timeout_s=3.0), got
        # the silent ones went, the talker stays
        assert [_closed(s) for s in held[:5]] == [True] * 4 + [False]
        assert not ends.poll(0)  # the peer's one connection was never cut
    finally:
        for s in held:
            s.close()
        context.destroy(linger=0)
    assert waited < 1.0, waited  # before: never, while the strangers held their 8 connections
    assert "untrusted_key" not in box.refused


@pytest.mark.parametrize("keyed", [True, False], ids=["curve", "null"])
def test_no_connection_past_the_quota_of_authenticated_ones_ever_delivers(inbox, keyed):
    curve = _curve(keyed)
    box = inbox(curve, MAX_CONNECTIONS=3)
    context = zmq.Context()
    try:
        peers = []
        for i in range(5):  # one at a time, as a rank's peers come: each proven before the next
            peer = _peer(context, curve, box.endpoint)
            peer.send(encode(make("done", i, stage=1)))
            peers.append(peer)
            time.sleep(0.3)
            got = [m.body for m in box.receive(timeout_ms=200)]
            assert got == ([i] if i < 3 else []), (i, got)
        assert box.evicted["inbox_full"] >= 1 and "untrusted_key" not in box.refused  # held at its ZAP check
        peers[0].close()  # a slot frees: the handshake held is admitted
        assert wait_for(lambda: bool(box.receive()), timeout_s=5)
    finally:
        context.destroy(linger=0)


def test_bytes_sent_is_what_the_kernel_counts_on_the_connection():
    from vpipe.control.tcpinfo import bytes_sent

    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=5)
        accepted, _ = server.accept()
        with client, accepted:
            assert bytes_sent(accepted) == 0
            accepted.sendall(b"x" * 1000)
            assert client.recv(2000, socket.MSG_WAITALL) == b"x" * 1000
            assert wait_for(lambda: bytes_sent(accepted) == 1000, timeout_s=2.0), bytes_sent(accepted)
            assert bytes_sent(client) == 1  # a connecting end's count starts with its SYN


# ---------------------------------------------------------------- messages waiting for whoever polls
def test_a_full_pending_queue_makes_room_without_walking_it(monkeypatch):
    """Dropping the oldest message reads each type's head, never its queue (each drop walked it: 5.6 s for
    10,000): a queue that counts what it is asked for, instead of a clock, which a busy machine slows."""
    from collections import deque

    import vpipe.control.pending as pending_module

    reads: Counter = Counter()

    class CountingDeque(deque):
        def __iter__(self):
            reads["walk"] += 1
            return super().__iter__()

        def __getitem__(self, index):
            reads["head" if index in (0, -1) else "inside"] += 1
            return super().__getitem__(index)

    monkeypatch.setattr(pending_module, "deque", CountingDeque)
    pending = PendingMessages("t", Counter())
    pending.asked.add("done")
    pending.add([(make("done", i, stage=1), 40) for i in range(20_000)])  # asked for, so none goes first
    assert reads == Counter(head=10_000)  # one head read per drop, nothing walked
    assert len(pending) == 10_000 and pending.dropped["unclaimed"] == 10_000
    assert [m.body for m in pending.take({"done"})] == list(range(10_000, 20_000))  # the oldest went


def test_the_pending_queue_drops_unasked_types_first_and_returns_arrival_order():
    pending = PendingMessages("t", Counter(), max_count=4)
    pending.add([(make("ping", stage=1), 10), (make("done", 1, stage=1), 10),
                 (make("bye", "x", stage=2), 10)])
    pending.take_first("done", from_rank=7)  # nothing from rank 7, but "done" is asked for now
    pending.add([(make("done", 2, stage=1), 10), (make("done", 3, stage=2), 10)])
    assert pending.dropped["unclaimed"] == 1 and len(pending) == 4  # the ping: nobody asked for pings
    assert pending.take_first("done", from_rank=2).body == 3
    assert [(m.type, m.body) for m in pending.take(None)] == [("done", 1), ("bye", "x"), ("done", 2)]
    assert len(pending) == 0 and pending.bytes == 0


# ---------------------------------------------------------------- migration messages for later moves
class FakePlane:
    def __init__(self) -> None:
        self.inbox: list[Message] = []

    def send(self, peer: int, message: Message) -> bool:
        return True

    def poll(self, timeout_ms: int = 0, *, types=None) -> list[Message]:
        out, self.inbox = self.inbox, []
        return out


def _ack(epoch: int, round_: int = 0, move: int = 1, src: int = 0) -> Message:
    return make("migrate_ack", {"round": round_, "move": move}, epoch=epoch, stage=src)


def test_future_epoch_migration_messages_are_dropped_and_held_ones_bounded(caplog):
    plane = FakePlane()
    messenger = ControlMessenger(plane, rank=1)
    plane.inbox = [_ack(10**9, move=m % 100) for m in range(5000)]  # no plan can jump this far
    plane.inbox += [_ack(5, round_=r, move=m) for r in range(3) for m in range(400)]  # a later epoch: held
    plane.inbox.append(_ack(4, move=7))
    with caplog.at_level(logging.INFO, logger="vpipe.migration"):
        assert messenger.wait_for({"migrate_ack"}, from_rank=0, key=(4, 0, 7), timeout_s=1.0) == (
            "migrate_ack", {"round": 0, "move": 7})
    # the newest but the one taken; the oldest made room
    assert len(messenger._held) == migration.MAX_HELD - 1
    assert messenger.dropped == Counter(future_epoch=5000, too_many=1201 - migration.MAX_HELD)
    assert len([r for r in caplog.records if "migration message(s)" in r.getMessage()]) == 1  # once per 10 s
    assert messenger.wait_for({"migrate_ack"}, from_rank=0, key=(5, 2, 399), timeout_s=0.1) is not None


def test_held_migration_messages_age_out(monkeypatch):
    monkeypatch.setattr(migration, "HELD_S", 0.2)
    plane = FakePlane()
    messenger = ControlMessenger(plane, rank=1)
    plane.inbox = [_ack(5, move=m) for m in range(10)]
    assert messenger.wait_for({"migrate_ack"}, from_rank=0, key=(4, 0, 1), timeout_s=0.05) is None
    assert len(messenger._held) == 10
    time.sleep(0.3)
    assert messenger.wait_for({"migrate_ack"}, from_rank=0, key=(5, 0, 1), timeout_s=0.05) is None  # too old
    assert len(messenger._held) == 0 and messenger.dropped == Counter(too_old=10)


def test_a_flood_of_stale_migration_messages_is_logged_once(caplog):
    plane = FakePlane()
    messenger = ControlMessenger(plane, rank=1)
    plane.inbox = [_ack(3, round_=9, move=m % 50) for m in range(1000)]
    with caplog.at_level(logging.INFO, logger="vpipe.migration"):
        assert messenger.wait_for({"migrate_ack"}, from_rank=0, key=(4, 0, 1), timeout_s=0.2) is None
    assert messenger.stale == 1000 and len(messenger._held) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "vpipe.migration"]
    assert lines == ["rank 1: dropped 1 stale migration message(s) matching no move "
                     "(latest: migrate_ack from "
                     "rank 0, epoch 3 round 9; 1 so far)"], lines  # the other 999: counted, in the next line
