"""What the control plane exposes: a size cap on every socket, and listening only where it must.

The listening sockets are read from the operating system (psutil), not from vpipe's own
idea of what it bound.
"""

from __future__ import annotations

import datetime
import ipaddress

import psutil
import pytest
import torch.distributed as dist
import zmq

from support.control import LAYERS, Recorder, config, keypairs, poll_until, pump, start_daemon, wait_for
from vpipe.control.agent import StageAgent
from vpipe.control.channel import ControlPlane
from vpipe.control.curve import PUBLIC_ENV, SECRET_ENV
from vpipe.control.messages import MAX_MESSAGE_BYTES, encode, frame_limit, make
from vpipe.control.netaddr import check_endpoint
from vpipe.control.planner_link import PlannerLink
from vpipe.plan import Plan


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for name in ("VPIPE_CONTROL_HOST", SECRET_ENV, PUBLIC_ENV):
        monkeypatch.delenv(name, raising=False)
    s = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
    yield s
    del s


def listening() -> set[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on, as the kernel sees them."""
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def port_of(endpoint: str) -> int:
    return check_endpoint(endpoint)[1]


# ---------------------------------------------------------------- size caps
def test_every_socket_is_capped_and_only_inproc_helpers_are_not(store, monkeypatch):
    """Record every zmq socket made while planes, agents, the planner link and the daemon run (CURVE on)."""
    created: list[zmq.Socket] = []
    original = zmq.Context.socket

    def recording(self, *args, **kwargs):
        sock = original(self, *args, **kwargs)
        created.append(sock)
        return sock

    monkeypatch.setattr(zmq.Context, "socket", recording)
    pairs = keypairs(3)
    planes = [ControlPlane(store, r, 2, lookup_timeout_s=2.0, curve=config(pairs[r], pairs))
              for r in range(2)]
    link = PlannerLink(planes[1], stage_index=1, num_stages=2, timeout_s=5.0, heartbeat_s=0.1)
    plan = Plan(epoch=0, stages=LAYERS[:2])
    agents = [StageAgent(planes[0], stage_index=0, num_stages=2, plan=plan),
              StageAgent(planes[1], stage_index=1, num_stages=2, plan=plan, planner=link)]
    daemon, thread, _ = start_daemon(planes[1].endpoint, Recorder(), curve=config(pairs[2], pairs),
                                     server_key=pairs[1][0])
    plans: dict[int, list] = {0: [], 1: []}
    try:
        assert wait_for(lambda: link.attached, step=lambda: pump(agents, 0, False, plans))
        pump(agents, 1, True, plans, rounds=3)  # stats 0 -> 1 -> daemon, plans daemon -> 1 -> 0
        assert wait_for(lambda: plans[0], step=lambda: pump(agents, 2, False, plans))
        endpoints = {s: s.getsockopt(zmq.LAST_ENDPOINT).decode() for s in created if not s.closed}
        caps = {s: s.getsockopt(zmq.MAXMSGSIZE) for s in endpoints}
    finally:
        for agent in agents:  # pipeline order: stage 0 says done first
            agent.finish(timeout_s=2.0)
        thread.join(timeout=10)
        for p in planes:
            p.close(linger_ms=0)
    tcp = [s for s, ep in endpoints.items() if ep.startswith("tcp://")]
    # 3 inboxes (2 ranks, daemon); outboxes 0->1 (stats), 1->0 (plans),
    # 1->daemon, daemon->1 and its heartbeat's
    assert sorted(s.type for s in tcp) == sorted([zmq.PULL] * 3 + [zmq.PUSH] * 5)
    assert all(caps[s] == frame_limit(MAX_MESSAGE_BYTES) for s in tcp)
    others = [s for s in endpoints if s not in tcp]
    assert others and all(endpoints[s].startswith("inproc://") for s in others), set(endpoints.values())
    monitors = [s for s in others if endpoints[s].startswith("inproc://monitor.")]
    assert len(monitors) == 3 and all(caps[s] == frame_limit(MAX_MESSAGE_BYTES) for s in monitors)


def test_oversized_frames_are_dropped_and_counted_never_delivered(store):
    inbox = ControlPlane(store, 0, 2, lookup_timeout_s=2.0, max_message_bytes=4096)
    peer = ControlPlane(store, 1, 2, lookup_timeout_s=2.0, max_message_bytes=256)
    context = zmq.Context()
    raw = context.socket(zmq.PUSH)
    raw.linger = 0
    raw.connect(inbox.endpoint)
    try:
        assert inbox.inbox.socket.getsockopt(zmq.MAXMSGSIZE) == 8192
        raw.send(b"\x80" + b"x" * 4096)  # over the message cap, within the socket's: read, counted, dropped
        raw.send(encode(make("done", 1, stage=1)))
        got = poll_until(inbox, 1)
        assert [(m.type, m.body) for m in got] == [("done", 1)]  # the same connection goes on
        assert inbox.dropped == {"too_large": 1}
        raw.send(b"y" * 8193)  # over the socket cap: zmq cuts the sender off without reading it
        assert peer.send(0, make("done", 2, stage=1))
        got = poll_until(inbox, 2, timeout_s=1.5)
        assert [(m.type, m.body) for m in got] == [("done", 2)]
        assert inbox.dropped == {"too_large": 1}
        with pytest.raises(ValueError, match="'bye' message is [0-9]+ bytes, over the 256-byte cap"):
            peer.send(0, make("bye", "x" * 300, stage=1))  # and vpipe never sends one
    finally:
        raw.close(0)
        context.term()
        for p in (inbox, peer):
            p.close(linger_ms=0)


# ---------------------------------------------------------------- binding
def daemon_and_planes(store, **plane_kwargs):
    planes = [ControlPlane(store, r, 2, lookup_timeout_s=2.0, curve=None, **plane_kwargs) for r in range(2)]
    daemon, thread, _ = start_daemon(planes[1].endpoint, Recorder(), curve=None)
    return planes, daemon, thread


def close_all(planes, daemon, thread) -> None:
    planes[1].connect("daemon", daemon.inbox.endpoint)  # the daemon leaves on bye
    planes[1].send("daemon", make("bye", "test over", stage=1))
    thread.join(timeout=10)
    assert not thread.is_alive()
    for p in planes:
        p.close(linger_ms=0)


def test_on_one_host_every_control_socket_listens_on_loopback_only(store):
    before = listening()
    planes, daemon, thread = daemon_and_planes(store)
    try:
        new = listening() - before
        inboxes = [p.endpoint for p in planes] + [daemon.inbox.endpoint]
        assert all(ep.startswith("tcp://127.0.0.1:") for ep in inboxes)
        assert new == {("127.0.0.1", port_of(ep)) for ep in inboxes}  # nothing else, nothing on 0.0.0.0
    finally:
        close_all(planes, daemon, thread)


def test_all_interfaces_only_when_asked_for_and_loopback_still_advertised(store, monkeypatch):
    monkeypatch.setenv("VPIPE_CONTROL_HOST", "0.0.0.0")
    before = listening()
    plane = ControlPlane(store, 0, 1, curve=None)
    try:
        assert plane.endpoint.startswith("tcp://127.0.0.1:")
        assert listening() - before == {("0.0.0.0", port_of(plane.endpoint))}
    finally:
        plane.close(linger_ms=0)


def non_loopback_ipv4() -> str:
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    pytest.skip("this machine has no non-loopback IPv4 address")


def test_with_a_remote_rendezvous_the_inbox_listens_on_that_interface_only(store, monkeypatch):
    """MASTER_ADDR on another interface of this host: bound there, not on all interfaces, not on loopback."""
    address = non_loopback_ipv4()
    monkeypatch.setenv("MASTER_ADDR", address)
    before = listening()
    planes, daemon, thread = daemon_and_planes(store)
    try:
        inboxes = [p.endpoint for p in planes] + [daemon.inbox.endpoint]
        assert all(check_endpoint(ep)[0] == address for ep in inboxes)
        assert listening() - before == {(address, port_of(ep)) for ep in inboxes}
    finally:
        close_all(planes, daemon, thread)


# ---------------------------------------------------------------- what nobody asks for
def test_unsolicited_valid_messages_are_bounded_in_bytes_and_the_drops_are_counted(store):
    import vpipe.migration.messages  # noqa: F401 - registers migrate_handover
    from vpipe.control.channel import MAX_PENDING_BYTES, Outbox

    plane = ControlPlane(store, 0, 2)
    sender = Outbox(zmq.Context.instance(), plane.endpoint)
    manifest = {"layer": 0, "spec": "x" * 900_000, "entries": []}  # valid, and nearly 1 MB on the wire
    try:
        for _ in range(150):  # 135 MB that no protocol step asked for (no move is under way)
            assert sender.send(make("migrate_handover", {"round": 0, "move": 0, "manifests": [manifest]},
                                    stage=1))
        got = []
        deadline = __import__("time").monotonic() + 20
        while plane.inbox.decoder.dropped["unclaimed"] < 100 and __import__("time").monotonic() < deadline:
            got += plane.poll(timeout_ms=50, types={"stats"})  # the stage agent's kind of poll
        assert got == []
        assert (
            plane.pending.bytes <= MAX_PENDING_BYTES
            and len(plane.pending) <= MAX_PENDING_BYTES // 900_000 + 1
        )
        assert plane.inbox.decoder.dropped["unclaimed"] >= 100  # counted (and logged) as dropped
    finally:
        sender.close(linger_ms=0)
        plane.close(linger_ms=0)
