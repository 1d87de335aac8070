"""Test helpers: control."""

from __future__ import annotations

import logging
import threading
import time

import msgpack
import pytest
import zmq
from hypothesis import strategies as st

from support.monitors import stage_record
from vpipe.control.channel import ControlPlane
from vpipe.control.curve import CurveConfig
from vpipe.control.daemon import PlannerDaemon
from vpipe.control.messages import (
    PLANNER,
    Decoder,
    Message,
    encode,
    make,
)
from vpipe.plan import Plan, Policy


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def wire_of(message: Message) -> dict:
    return msgpack.unpackb(encode(message), raw=False)


def packed(wire) -> bytes:
    return msgpack.packb(wire, use_bin_type=True)


VALID = [
    make("stats", (stage_record(0, 9, (0, 1)), stage_record(1, 9, (2, 3))), epoch=2, iteration=9, stage=1),
    make("plan", Plan(epoch=3, stages=((0, 1), (2, 3)), policies={2: Policy.SWAP}, reason="r"), epoch=3,
         stage=PLANNER),
    make("hello", {"pid": 1234, "endpoint": "tcp://127.0.0.1:5555"}),
    make("welcome", {"plan": None, "num_stages": 4}, stage=3),
    make("welcome", {"plan": Plan(epoch=0, stages=((0,), (1,))), "num_stages": 2}, stage=1),
    make("ping", stage=3),
    make("bye", "training finished", stage=3),
    make("done", 41, iteration=41, stage=0),
]


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)


def assert_dropped_cleanly(data: bytes) -> None:
    """The decoder returns a message or drops the frame, counted and logged; it never raises."""
    decoder = Decoder(name="fuzz")
    captured = Captured()
    logger = logging.getLogger("vpipe.control")
    logger.addHandler(captured)
    try:
        result = decoder.accept(data)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{type(e).__name__} escaped the decoder for {data[:60]!r}: {e}")
    finally:
        logger.removeHandler(captured)
    if result is None:
        assert decoder.total_dropped == 1
        assert len(captured.lines) == 1 and "dropped a bad control message" in captured.lines[0]
    else:
        assert isinstance(result, Message) and decoder.total_dropped == 0


LAYERS = ((0, 1), (2, 3), (4, 5))


class Recorder:
    """A planner that keeps what it got and answers with a marker plan under the next epoch."""

    def __init__(self) -> None:
        self.vectors: list[list] = []

    def __call__(self, vector, current):
        self.vectors.append(vector)
        return Plan(epoch=current.epoch + 1, stages=current.stages, reason=f"marker {vector[0].iteration}")


def start_daemon(endpoint: str, planner, **kwargs) -> tuple[PlannerDaemon, threading.Thread, list]:
    daemon = PlannerDaemon(endpoint, planner, heartbeat_s=0.05, **kwargs)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(daemon.run()), daemon=True)
    thread.start()
    return daemon, thread, result


def pump(agents, iteration, sampled, plans, rounds=1):
    """One pipeline step in flush order: the last stage finishes first."""
    for _ in range(rounds):
        for agent in reversed(agents):
            record = stage_record(agent.stage_index, iteration,
                                  LAYERS[agent.stage_index]) if sampled else None
            plans[agent.stage_index] += agent.after_step(iteration, record)
        time.sleep(0.02)


def wait_for(condition, timeout_s=10.0, step=None):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        if step:
            step()
        time.sleep(0.02)
    return True


def poll_until(plane: ControlPlane, count: int, timeout_s: float = 5.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += plane.poll(timeout_ms=50)
    return got


def keypairs(n: int) -> list[tuple[bytes, bytes]]:
    return [zmq.curve_keypair() for _ in range(n)]


def config(pair: tuple[bytes, bytes], trusted: list[tuple[bytes, bytes]]) -> CurveConfig:
    return CurveConfig(public=pair[0], secret=pair[1], trusted=frozenset([pair[0], *(p for p, _ in trusted)]))
