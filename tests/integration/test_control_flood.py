"""A flood of a stage's control inbox: memory stays bounded and training finishes.

A real 2-stage ``vpipe train`` run whose key the test knows (it gives the launcher one, as a
user may). While it trains, one sender holding the key pushes valid ``migrate_handover``
messages of ~700 KB each, which nobody asked for (no move is under way), as fast as the
inbox takes them; another, without the key, pushes garbage. Both are bounded in count and
time, and on loopback only. Stage 0's resident memory may grow by at most
``RSS_BOUND_BYTES`` (docs/control-plane.md: per connection zmq queues 8 frames, a receive
call decodes about 2 MiB, and at most 4 MiB of wire bytes wait decoded).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq

from support.processes import ROOT, child_env, training_pids
from vpipe.control.curve import RUN_SECRET_ENV
from vpipe.control.messages import encode, make
from vpipe.log import read_log

RSS_BOUND_BYTES = 64 << 20
FLOOD_MESSAGES = 1500  # ~1 GB of valid messages at most
FLOOD_S = 6.0
STEPS = 800


def _handover() -> bytes:
    import torch

    import vpipe.migration.messages  # noqa: F401 - registers migrate_handover
    from vpipe.migration.state import pack_layer

    manifest = pack_layer(3, torch.nn.Linear(2, 2), None).manifest
    return encode(make("migrate_handover", {"round": 0, "move": 1, "manifests": [manifest] * 2400}, stage=1))


def _flood(endpoint: str, secret: bytes | None, frame: bytes, stop: threading.Event, sent: list[int]) -> None:
    context = zmq.Context()
    try:
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 16)
        if secret is not None:
            public = zmq.curve_public(secret)
            push.setsockopt(zmq.CURVE_SERVERKEY, public)  # every process of the run has the run's key pair
            push.setsockopt(zmq.CURVE_PUBLICKEY, public)
            push.setsockopt(zmq.CURVE_SECRETKEY, secret)
        push.connect(endpoint)
        deadline = time.monotonic() + FLOOD_S
        while not stop.is_set() and time.monotonic() < deadline and sent[0] < FLOOD_MESSAGES:
            try:
                push.send(frame, zmq.NOBLOCK)
                sent[0] += 1
            except zmq.Again:
                time.sleep(0.002)
    finally:
        context.destroy(linger=0)


def _rank_process(launcher: subprocess.Popen, log_file: Path, rank: int) -> psutil.Process | None:
    pid = training_pids(log_file).get(rank)
    # via the launcher or the starter
    descendants = {p.pid for p in psutil.Process().children(recursive=True)}
    return psutil.Process(pid) if pid in descendants else None


def _endpoints(log_file) -> list[str]:
    records = read_log(log_file) if log_file.exists() else []
    return [r["control_endpoint"] for r in records if r.get("rank") == 0 and "control_endpoint" in r]


@pytest.mark.slow  # ~30 s: a real run under a 6 s flood
def test_a_flood_of_valid_and_garbage_messages_keeps_memory_bounded_and_training_finishes(tmp_path):
    secret = zmq.curve_keypair()[1]
    log_file = tmp_path / "run.log"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "vpipe_lab", "train", "--stages", "2", "--steps", str(STEPS), "--blocks", "2",
         "--d-model", "16", "--seq-len", "8", "--micro-batches", "2", "--monitor-every", "5", "--no-progress",
         "--log-file", str(log_file)],
        cwd=ROOT, env=child_env(**{RUN_SECRET_ENV: secret.decode()}), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 120
        while not (endpoints := _endpoints(log_file)):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
            time.sleep(0.1)
        time.sleep(2.0)  # training
        rank0 = _rank_process(launcher, log_file, 0)
        assert rank0 is not None
        endpoint = endpoints[0]
        baseline = max(_sample(rank0, 1.0))
        keyed, garbage = [0], [0]
        floods = [threading.Thread(target=_flood, args=(endpoint, secret, _handover(), stop, keyed)),
                  threading.Thread(target=_flood, args=(endpoint, None, os.urandom(4096), stop, garbage))]
        for t in floods:
            t.start()
        during = _sample(rank0, FLOOD_S + 1.0)
        stop.set()
        for t in floods:
            t.join(10)
        _, stderr = launcher.communicate(timeout=240)
    finally:
        stop.set()
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, stderr[-3000:]
    assert keyed[0] >= 50, f"the keyed flood got only {keyed[0]} messages out"
    growth = max(during) - baseline
    print(f"flood: {keyed[0]} keyed, {garbage[0]} garbage messages; stage 0 RSS {baseline / 2**20:.0f} MiB, "
          f"+{growth / 2**20:.1f} MiB")
    assert growth < RSS_BOUND_BYTES, (
        f"stage 0 grew {growth / 2**20:.0f} MiB under a flood of {keyed[0]} messages"
    )
    messages = [r["msg"] for r in read_log(log_file) if r.get("rank") == 0]
    # the valid flood: dropped, counted, logged
    assert any("nobody polled for" in m for m in messages), messages
    # the garbage: refused at the handshake. zmq names the mechanism mismatch when stage 0 reads the
    # sender's greeting, and gives no detail when the sender saw the mismatch first and hung up
    # (under load that can be every one of the few attempts a 6 s flood makes)
    refusals = [m for m in messages if "refused a connection whose handshake failed" in m]
    assert any("(mechanism_mismatch;" in m or "(handshake_failed;" in m for m in refusals), messages
    done = [r for r in read_log(log_file) if "vectors" in r]  # the daemon's goodbye
    assert done and done[0]["vectors"] == STEPS // 5  # every stats vector got through the flood


def _sample(process: psutil.Process, seconds: float) -> list[int]:
    samples, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            samples.append(process.memory_info().rss)
        except psutil.NoSuchProcess:  # the run ended
            break
        time.sleep(0.05)
    return samples
