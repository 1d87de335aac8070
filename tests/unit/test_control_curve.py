"""CURVE on the control plane: trusted peers talk, everyone else is refused and nothing of theirs arrives."""

from __future__ import annotations

import datetime
import logging
import os
import re

import pytest
import torch.distributed as dist
import zmq

from support.control import LAYERS, Recorder, config, keypairs, poll_until, pump, start_daemon, wait_for
from vpipe.control.agent import StageAgent
from vpipe.control.channel import FROM_SETTINGS, ControlPlane, curve_key_key, endpoint_key
from vpipe.control.curve import PUBLIC_ENV, SECRET_ENV
from vpipe.control.keys import write_keypair
from vpipe.control.messages import PLANNER, encode, make
from vpipe.control.planner_link import PlannerLink
from vpipe.plan import Plan


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("VPIPE_CONTROL_HOST", raising=False)
    for name in (SECRET_ENV, PUBLIC_ENV):
        monkeypatch.delenv(name, raising=False)
    s = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
    yield s
    del s


@pytest.fixture
def opened():
    made: list = []
    yield made
    for p in reversed(made):
        p.close(linger_ms=0)


def plane(store, rank, world, opened, curve) -> ControlPlane:
    p = ControlPlane(store, rank, world, lookup_timeout_s=2.0, curve=curve)
    opened.append(p)
    return p


def raw_push(context: zmq.Context, endpoint: str, curve_keys=None, server_key=None) -> zmq.Socket:
    """A peer that is not vpipe: a bare PUSH socket, without CURVE or with keys of its own."""
    sock = context.socket(zmq.PUSH)
    sock.linger = 0
    if curve_keys is not None:
        sock.curve_publickey, sock.curve_secretkey = curve_keys
        sock.curve_serverkey = server_key
    sock.connect(endpoint)
    return sock


def intrude(sock: zmq.Socket, message: bytes) -> None:
    """Send as an intruder would. Once the inbox has refused the handshake, zmq has no pipe to queue on and a
    plain send would block for ever; whether the frame left or not, it must never arrive."""
    try:
        sock.send(message, zmq.NOBLOCK)
    except zmq.Again:
        pass


def test_curve_is_off_by_default(store, opened):
    p = plane(store, 0, 1, opened, curve=FROM_SETTINGS)
    assert p.curve is None and p.guard is None
    assert p.inbox.socket.getsockopt(zmq.MECHANISM) == zmq.NULL
    assert not store.check([curve_key_key(0)])


def test_trusted_peers_exchange_messages_encrypted(store, opened):
    pairs = keypairs(3)
    planes = [plane(store, r, 3, opened, config(pairs[r], pairs)) for r in range(3)]
    for r, p in enumerate(planes):
        assert store.get(curve_key_key(r)) == pairs[r][0]
        assert p.inbox.socket.getsockopt(zmq.MECHANISM) == zmq.CURVE
        assert p.inbox.socket.getsockopt(zmq.CURVE_SERVER) == 1
    for r, p in enumerate(planes):
        assert p.send((r + 1) % 3, make("done", r, stage=r))
    for r, p in enumerate(planes):
        got = poll_until(p, 1)
        assert [(m.type, m.src, m.body) for m in got] == [("done", (r - 1) % 3, (r - 1) % 3)]
        assert all(o.socket.getsockopt(zmq.MECHANISM) == zmq.CURVE for o in p._peers.values())
        assert p.refused == {} and p.guard.refused == {}


def test_planes_configured_by_the_process_settings_talk(store, opened, tmp_path, monkeypatch):
    _, secret = write_keypair(tmp_path / "mine", "host")
    other_public, _ = write_keypair(tmp_path / "theirs", "other")
    monkeypatch.setenv(SECRET_ENV, str(secret))
    monkeypatch.setenv(PUBLIC_ENV, str(other_public))
    a, b = plane(store, 0, 2, opened, FROM_SETTINGS), plane(store, 1, 2, opened, FROM_SETTINGS)
    assert a.curve is not None and a.curve == b.curve and len(a.curve.trusted) == 2
    assert a.send(1, make("ping", stage=0))
    assert [m.type for m in poll_until(b, 1)] == ["ping"]


def test_a_peer_without_curve_is_refused_and_logged(store, opened, caplog):
    pairs = keypairs(2)
    inbox, friend = (plane(store, r, 2, opened, config(pairs[r], pairs)) for r in range(2))
    context = zmq.Context()
    try:
        raw = raw_push(context, inbox.endpoint)
        with caplog.at_level(logging.WARNING, logger="vpipe.control"):
            intrude(raw, encode(make("done", 666, stage=1)))
            assert wait_for(lambda: inbox.refused.total() >= 1), inbox.refused
            friend.send(0, make("done", 1, stage=1))
            got = poll_until(inbox, 2, timeout_s=1.0)
        assert [(m.type, m.body) for m in got] == [("done", 1)]  # the intruder's never arrives
        # zmq reports a mismatch of mechanisms, or (when the client hangs up first) a failure without detail
        assert set(inbox.refused) <= {"mechanism_mismatch", "handshake_failed"}
        assert inbox.dropped == {}  # refused at the handshake: no frame of it was ever read
        reason = next(iter(inbox.refused))
        assert (f"rank 0 control inbox: refused a connection whose handshake failed ({reason}; 1 so far) - "
                f"a peer without CURVE or with the wrong keys?") in caplog.text
    finally:
        raw.close(0)
        context.term()


def test_a_peer_with_an_unlisted_key_is_refused_and_its_key_logged(store, opened, caplog):
    pairs = keypairs(2)
    inbox, friend = (plane(store, r, 2, opened, config(pairs[r], pairs)) for r in range(2))
    stranger_public, stranger_secret = zmq.curve_keypair()
    context = zmq.Context()
    try:
        raw = raw_push(context, inbox.endpoint, (stranger_public, stranger_secret), pairs[0][0])
        with caplog.at_level(logging.WARNING, logger="vpipe.control"):
            intrude(raw, encode(make("done", 666, stage=1)))
            assert wait_for(lambda: inbox.refused["untrusted_key"] >= 1), inbox.refused
            friend.send(0, make("done", 1, stage=1))
            got = poll_until(inbox, 2, timeout_s=1.0)
        assert [(m.type, m.body) for m in got] == [("done", 1)]
        assert set(inbox.guard.refused) == {stranger_public}
        assert set(inbox.refused) == {"untrusted_key"}
        assert (f"rank 0 control inbox: refused a CURVE client with an untrusted public key "
                f"{stranger_public.decode()} (1 time)") in caplog.text
    finally:
        raw.close(0)
        context.term()


def test_a_client_connects_only_to_trusted_server_keys(store, opened):
    a_pair, b_pair, c_pair = keypairs(3)
    a = plane(store, 0, 3, opened, config(a_pair, [b_pair]))  # does not trust c
    plane(store, 1, 3, opened, config(b_pair, [a_pair]))
    c = plane(store, 2, 3, opened, config(c_pair, [a_pair]))
    assert a.send(1, make("ping", stage=0))
    refusal = f"rank 2 presents CURVE key {c_pair[0].decode()!r}, which is not among the trusted keys"
    with pytest.raises(ValueError, match=re.escape(refusal)):
        a.send(2, make("ping", stage=0))
    with pytest.raises(ValueError, match="published no CURVE key"):
        a.connect("observer", c.endpoint)
    assert 2 not in a._peers and "observer" not in a._peers


def test_curve_and_plain_ranks_refuse_each_other_clearly(store, opened):
    pair = zmq.curve_keypair()
    secure = plane(store, 0, 2, opened, config(pair, []))
    plain = plane(store, 1, 2, opened, None)
    with pytest.raises(ValueError,
                       match="rank 1: rank 0 runs its control plane with CURVE but this rank does not"):
        plain.send(0, make("ping", stage=1))
    with pytest.raises(ValueError, match="rank 1 published no CURVE key, but CURVE is on here"):
        secure.send(1, make("ping", stage=0))
    assert store.get(endpoint_key(1)).decode() == plain.endpoint


def test_the_planner_daemon_speaks_curve(store, opened):
    stage_pair, daemon_pair = keypairs(2)
    last = plane(store, 0, 1, opened, config(stage_pair, [daemon_pair]))
    link = PlannerLink(last, stage_index=0, num_stages=1, timeout_s=5.0, heartbeat_s=0.1)
    agent = StageAgent(last, stage_index=0, num_stages=1, plan=Plan(epoch=0, stages=(LAYERS[0],)),
                       planner=link)
    with pytest.raises(ValueError, match="CURVE is on: the planner daemon needs the last stage's public key"):
        start_daemon(last.endpoint, Recorder(), curve=config(daemon_pair, [stage_pair]))
    recorder = Recorder()
    daemon, thread, result = start_daemon(last.endpoint, recorder, curve=config(daemon_pair, [stage_pair]),
                                          server_key=stage_pair[0])
    try:
        plans: dict[int, list] = {0: []}
        assert wait_for(lambda: link.attached, step=lambda: pump([agent], 0, False, plans))
        assert daemon.inbox.socket.getsockopt(zmq.MECHANISM) == zmq.CURVE
        assert last._peers["planner"].socket.getsockopt(zmq.MECHANISM) == zmq.CURVE
        for it in range(1, 4):
            pump([agent], it, True, plans)
        assert wait_for(lambda: len(plans[0]) == 3, step=lambda: pump([agent], 9, False, plans))
        assert [p.reason for p in plans[0]] == ["marker 1", "marker 2", "marker 3"]
        assert link.attached_pid == os.getpid() and link.refused_hellos == 0
    finally:
        agent.finish(timeout_s=2.0)
        thread.join(timeout=10)
    assert result == [0]


def test_a_hello_whose_key_is_not_trusted_does_not_attach(store, opened, caplog):
    stage_pair = zmq.curve_keypair()
    last = plane(store, 0, 1, opened, config(stage_pair, []))
    link = PlannerLink(last, stage_index=0, num_stages=1, timeout_s=5.0, heartbeat_s=0.1)
    untrusted, _ = zmq.curve_keypair()
    hello = make("hello", {"pid": 4242, "endpoint": "tcp://127.0.0.1:9", "key": untrusted.decode()},
                 stage=PLANNER)
    with caplog.at_level(logging.WARNING, logger="vpipe.control"):
        link.handle(hello, None)
        link.handle(make("hello", {"pid": 4243, "endpoint": "tcp://127.0.0.1:9"}, stage=PLANNER), None)
    assert not link.attached and link.refused_hellos == 2 and "planner" not in last._peers
    assert "planner daemon pid 4242 at tcp://127.0.0.1:9 not attached: the control endpoint" in caplog.text
    assert "planner daemon pid 4243 at tcp://127.0.0.1:9 not attached" in caplog.text


def test_a_hello_naming_an_endpoint_off_this_host_is_ignored(store, opened, caplog):
    last = plane(store, 0, 1, opened, None)  # CURVE off: the single-host default
    link = PlannerLink(last, stage_index=0, num_stages=1, timeout_s=5.0, heartbeat_s=0.1)
    with caplog.at_level(logging.WARNING, logger="vpipe.control"):
        link.handle(make("hello", {"pid": 4244, "endpoint": "tcp://203.0.113.9:5555"}, stage=PLANNER), None)
    assert not link.attached and link.refused_hellos == 1 and "planner" not in last._peers
    assert (
        "a planner hello names tcp://203.0.113.9:5555: neither loopback nor this run's interface"
        in caplog.text
    )


def test_key_folders_of_processes_killed_outright_are_removed_by_the_next_one(tmp_path, monkeypatch):
    """A run ended by SIGTERM or a crash skips its exit handlers and
    left /tmp/vpipe-run-*/control.key_secret."""
    import subprocess
    import sys
    import tempfile

    from vpipe.control import curve

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True)
    orphan = tmp_path / f"vpipe-run-{int(dead.stdout)}-abc"
    orphan.mkdir(mode=0o700)
    (orphan / "control.key_secret").write_text("secret\n")
    alive = tmp_path / f"vpipe-run-{os.getpid()}-def"  # this process's own: it still runs
    alive.mkdir(mode=0o700)
    path = curve.private_key_file(zmq.curve_keypair()[1].decode())
    try:
        assert not orphan.exists() and alive.exists()
        assert os.path.basename(os.path.dirname(path)).startswith(f"vpipe-run-{os.getpid()}-")
    finally:
        curve.remove_private_key_files()
