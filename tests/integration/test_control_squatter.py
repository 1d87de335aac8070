"""A local squatter on the control inboxes never keeps the run's own peers out (issue 56).

The squatter (``tests/support/squatter.py``, a process of its own) holds raw TCP connections to
each inbox from 127.0.0.1, the peers' own address, half silent and half trickling a ZMTP greeting
one byte every 3 s, and opens a new one at once whenever one is cut. Before, with 8 per inbox it
held the inbox's 8 places for connections that had not authenticated (the daemon's inbox held 4
connections in all), so every peer was cut as it came: the planner never attached, no plan was
applied, and a run took 86.7 s instead of 27.0 s. Now a newcomer takes the place of the oldest
stranger (docs/control-plane.md, "Connections"): the peer gets through within 3 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import zmq

from support.inboxes import Friend, finish, start_inbox
from support.processes import ROOT, child_env, run_ranks
from vpipe.log import read_log

SQUATTER = ROOT / "tests" / "support" / "squatter.py"
GET_IN_S = 3.0  # issue 56: with the squatter there, a peer gets in (the planner attaches) within this


def _squat(*args: str) -> subprocess.Popen:
    squatter = subprocess.Popen([sys.executable, str(SQUATTER), *args], stdout=subprocess.PIPE, text=True)
    assert json.loads(squatter.stdout.readline()) == {"ready": True}
    return squatter


def _report(squatter: subprocess.Popen) -> dict:
    squatter.terminate()
    out, _ = squatter.communicate(timeout=30)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize(("keyed", "per_endpoint"), [(True, 8), (False, 64)], ids=["curve-8", "null-64"])
def test_a_squatter_on_the_peers_own_address_never_keeps_a_peer_out(keyed, per_endpoint):
    secret = zmq.curve_keypair()[1] if keyed else None
    inbox, endpoint = start_inbox(secret, 4096)
    context = zmq.Context()
    stop = threading.Event()
    squatter = _squat("--endpoint", endpoint, "--per-endpoint", str(per_endpoint))
    try:
        assert json.loads(squatter.stdout.readline()) == {"holding": endpoint}  # it holds all its connections
        friend = Friend(context, endpoint, secret, 0)  # a peer from the same address, coming after
        sent_at = time.time()
        sender = friend.keep_sending(stop, every_s=0.05)
        time.sleep(1.0)
        stop.set()
        sender.join(5)
        result, _ = finish(inbox, friend.sent[-1])  # (the squatter squats on until the inbox is gone)
        report = _report(squatter)
    finally:
        stop.set()
        for process in (inbox, squatter):
            if process.poll() is None:
                process.kill()
        context.destroy(linger=0)
    waited = result["arrived"]["0"] - sent_at if "0" in result["arrived"] else float("inf")
    print(f"{per_endpoint} squatting connections ({'CURVE' if keyed else 'no CURVE'}): the peer's first "
          f"message arrived after {waited:.2f} s; squatter {report}; inbox evicted {result['evicted']}")
    assert waited < GET_IN_S  # before: cut as it came, for as long as the squatter stayed
    assert sorted(result["got"]) == friend.sent  # and every message after it
    assert report["opened"] >= per_endpoint


def test_with_a_squatter_on_every_inbox_the_planner_attaches_and_plans_are_applied(tmp_path):
    """A real run (slow: 10-40 s on 2 cores), the tutorial trainer
    on 2 ranks with the one line and its daemon."""
    log_file = tmp_path / "run.log"
    # the issue's: 8 per inbox, as they appear
    squatter = _squat("--log", str(log_file), "--per-endpoint", "8")
    started = time.monotonic()
    try:
        run_ranks([str(ROOT / "examples" / "train_tutorial.py"), "--vpipe", "--steps", "60"], 2,
                  tmp_path / "ranks.txt", child_env(VPIPE_LOG_FILE=str(log_file)), timeout_s=400)
        wall = time.monotonic() - started
        report = _report(squatter)
    finally:
        if squatter.poll() is None:
            squatter.kill()
    log = read_log(log_file)
    inboxes = {r["control_endpoint"]: r for r in log if "control_endpoint" in r}
    daemon = next(r for r in inboxes.values() if r.get("rank") is None)  # its inbox opened then
    attached = [r for r in log if r.get("event") == "planner_attached"]
    applied = {r["rank"] for r in log if r.get("event") == "plan_applied"}
    planner_started = next(r for r in log if r.get("event") == "planner_started")
    print(f"squatter {report}; planner attached {attached[0]['t'] - daemon['t']:.2f} s "
          "after its inbox opened "
          f"({attached[0]['t'] - planner_started['t']:.2f} s after it was started); plans applied on ranks "
          f"{sorted(applied)}; {wall:.1f} s in all" if attached else f"never attached; squatter {report}")
    # both ranks' inboxes and the daemon's
    assert set(report["endpoints"]) == set(inboxes) and len(inboxes) == 3
    assert report["opened"] >= 3 * 8
    assert attached and attached[0]["t"] - daemon["t"] < GET_IN_S  # before: never
    assert applied == {0, 1}  # before: training finished, no plan ever applied

