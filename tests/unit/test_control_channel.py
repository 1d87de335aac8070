"""The control plane's sockets: endpoints in the TCPStore, loopback binding, validated inboxes."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist
import zmq

from support.control import poll_until
from vpipe.control.channel import ControlPlane, Outbox, endpoint_key
from vpipe.control.messages import encode, frame_limit, make
from vpipe.control.netaddr import check_endpoint, control_host, route_address, tcp_endpoint


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
    yield s
    del s


@pytest.fixture
def planes(store, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("VPIPE_CONTROL_HOST", raising=False)
    made = [ControlPlane(store, rank, 3, lookup_timeout_s=2.0) for rank in range(3)]
    yield made
    for plane in made:
        plane.close(linger_ms=0)




def test_endpoints_are_published_in_the_store_and_bound_to_loopback(planes, store):
    for plane in planes:
        published = store.get(endpoint_key(plane.rank)).decode()
        assert published == plane.endpoint
        assert published.startswith("tcp://127.0.0.1:")
        bound = plane.inbox.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert bound.startswith("tcp://127.0.0.1:"), bound
        assert plane.inbox.socket.getsockopt(zmq.MAXMSGSIZE) == frame_limit(plane.max_message_bytes)


def test_send_and_poll_keep_order_per_sender(planes):
    a, b, c = planes
    for i in range(5):
        assert a.send(1, make("done", i, iteration=i, stage=0))
    c.send(1, make("ping", stage=2))
    got = poll_until(b, 6)
    assert [m.body for m in got if m.src == 0] == [0, 1, 2, 3, 4]
    assert [m.type for m in got if m.src == 2] == ["ping"]
    assert b.poll() == []


def test_recv_filters_by_type_and_sender_and_keeps_the_rest_for_poll(planes):
    a, b, c = planes
    a.send(1, make("ping", stage=0))
    c.send(1, make("done", 7, stage=2))
    a.send(1, make("done", 3, stage=0))
    message = b.recv("done", from_rank=0, timeout_s=5)
    assert (message.src, message.body) == (0, 3)
    rest = poll_until(b, 2)
    assert sorted((m.type, m.src) for m in rest) == [("done", 2), ("ping", 0)]


def test_recv_times_out_naming_the_peer(planes):
    with pytest.raises(TimeoutError, match="rank 1: no 'plan' message from rank 2 within 0.2 s"):
        planes[1].recv("plan", from_rank=2, timeout_s=0.2)


def test_bad_frames_are_dropped_counted_and_never_raise(planes):
    plane = planes[1]
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.connect(plane.endpoint)
    try:
        raw.send(b"\xc1garbage")
        raw.send_multipart([b"a", b"b"])
        raw.send(encode(make("ping", stage=0))[:-1])  # truncated
        # over the socket cap: zmq cuts this sender off
        raw.send(b"x" * (frame_limit(plane.max_message_bytes) + 1))
        planes[0].send(1, make("ping", stage=0))  # others still get through (the garbage is never returned)
        got = poll_until(plane, 1)
        assert [(m.type, m.src) for m in got] == [("ping", 0)]
        deadline = time.monotonic() + 5
        while plane.dropped.total() < 3 and time.monotonic() < deadline:
            plane.poll(timeout_ms=50)
        assert plane.dropped == {"not_msgpack": 2, "multipart": 1}
    finally:
        raw.close(linger=0)
        ctx.term()


def test_sending_to_a_vanished_peer_never_blocks():
    ctx = zmq.Context()
    try:
        outbox = Outbox(ctx, "tcp://127.0.0.1:9", queue=3, linger_ms=0)  # nobody listens there
        start = time.monotonic()
        results = [outbox.send(make("ping", stage=0)) for _ in range(50)]
        assert time.monotonic() - start < 2.0
        assert results.count(False) >= 40
        outbox.close(linger_ms=0)
    finally:
        ctx.term()


def test_named_peers_and_unknown_peers(planes):
    a, b, _ = planes
    a.connect("observer", b.endpoint)
    assert a.send("observer", make("ping", stage=0))
    assert poll_until(b, 1)[0].type == "ping"
    with pytest.raises(KeyError, match="no control peer named 'nobody'"):
        a.send("nobody", make("ping", stage=0))


def test_lookup_of_a_rank_that_never_published_times_out(store):
    plane = ControlPlane(store, 0, 5, lookup_timeout_s=0.3)
    try:
        with pytest.raises(TimeoutError, match="rank 4 did not publish its control endpoint"):
            plane.send(4, make("ping", stage=0))
        with pytest.raises(ValueError, match="outside"):
            plane.endpoint_of(5)
    finally:
        plane.close(linger_ms=0)


def test_control_host_is_loopback_or_the_interface_towards_the_rendezvous():
    assert control_host(environ={"MASTER_ADDR": "127.0.0.1"}) == ("127.0.0.1", "127.0.0.1")
    assert control_host(environ={"MASTER_ADDR": "localhost"}) == ("127.0.0.1", "127.0.0.1")
    assert control_host("0.0.0.0", environ={"MASTER_ADDR": "localhost"}) == ("0.0.0.0", "127.0.0.1")
    assert control_host("10.1.2.3", environ={"MASTER_ADDR": "127.0.0.1"}) == ("10.1.2.3", "10.1.2.3")
    try:
        outward = route_address("192.0.2.1")  # TEST-NET-1: routed (if at all) like any remote host
    except ValueError:
        pytest.skip("this machine has no route off the host")
    bind, advertise = control_host(environ={"MASTER_ADDR": "192.0.2.1"})
    assert bind == advertise == outward
    assert bind not in ("0.0.0.0", "::", "*")
    with pytest.raises(ValueError, match="cannot resolve"):
        route_address("no-such-host.invalid")


def test_endpoints_are_checked():
    assert check_endpoint("tcp://127.0.0.1:5555") == ("127.0.0.1", 5555)
    assert check_endpoint(tcp_endpoint("::1", 80)) == ("::1", 80)
    for bad in ("tcp://127.0.0.1", "ipc:///tmp/x", "tcp://host:99999", "tcp://a b:1", 5, "tcp://*:5"):
        with pytest.raises(ValueError):
            check_endpoint(bad)
