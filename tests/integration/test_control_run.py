"""Whole runs through `python -m vpipe_lab train`: stats from every stage reach the planner daemon,
its plans reach every stage, and losing the daemon does not stop training."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil

from support.control_runs import MARKER, decisions, planner_env, received
from support.processes import ROOT, child_env, run_vpipe, wait_while_running
from vpipe.log import read_log
from vpipe.monitors.records import GPU_ONLY_FIELDS, StageRecord


def test_four_stages_every_sampled_iteration_reaches_the_planner_and_plans_come_back(tmp_path):
    out, log_file = tmp_path / "planner.jsonl", tmp_path / "run.log"
    proc = run_vpipe("train", "--stages", "4", "--steps", "30", "--monitor-every", "3", "--no-progress",
                     "--blocks", "6", "--d-model", "32", "--seq-len", "16", "--micro-batches", "4",
                     "--planner", MARKER, "--log-file", str(log_file), env=planner_env(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    vectors = received(out)
    assert [v["iteration"] for v in vectors] == list(range(2, 30, 3))
    all_layers = []
    for v in vectors:
        records = [StageRecord.from_wire(r) for r in v["records"]]
        assert [r.stage for r in records] == [0, 1, 2, 3]
        for r in records:
            assert r.iteration == v["iteration"]
            for name, value in vars(r).items():
                if name in GPU_ONLY_FIELDS:
                    assert value is None, name  # a CPU run has no GPU figures
                elif name == "builds":
                    assert value is None  # a monitor without vpipe's layer manager: it would build anything
                else:
                    assert value is not None, name
            assert r.step_s > 0 and r.device_resident_bytes > 0 and r.device_peak_bytes > 0
            assert r.host_rss_bytes > 0 and r.param_bytes > 0 and r.optimizer_bytes > 0
            for layer in r.layers:
                assert layer.fwd_calls == 4 and layer.bwd_calls == 4
                assert layer.fwd_s > 0 and layer.bwd_s > 0
                assert layer.activation_bytes > 0 and layer.param_bytes > 0 and layer.optimizer_bytes > 0
        all_layers.append([lid for r in records for lid in r.layer_ids])
    assert all(layers == list(range(8)) for layers in all_layers)

    got = {rank: [r for r in decisions(log_file, "plan_received") if r["rank"] == rank] for rank in range(4)}
    sent = decisions(log_file, "plan_sent")
    assert sent and all(r["role"] == "planner" for r in sent)
    for rank, plans in got.items():
        assert plans, f"stage {rank} received no plan"
        epochs = [p["epoch"] for p in plans]
        assert epochs == sorted(set(epochs))
        assert all(p["reason"].startswith("marker ") for p in plans)
        assert plans[0]["stage_layers"] == [[0, 1], [2, 3], [4, 5], [6, 7]][rank]
    # every plan a stage got came through its downstream neighbour
    for rank in range(3):
        assert {p["epoch"] for p in got[rank]} <= {p["epoch"] for p in got[rank + 1]}




def test_killed_planner_is_reported_training_finishes_and_a_restarted_one_resumes(tmp_path):
    out, log_file = tmp_path / "planner.jsonl", tmp_path / "run.log"
    env = planner_env(out)  # the kill is seen as the process exiting, not by a timeout
    launcher = subprocess.Popen(
        [sys.executable, "-m", "vpipe_lab", "train", "--stages", "2", "--steps", "600", "--monitor-every",
         "5",
         "--blocks", "2", "--d-model", "32", "--seq-len", "16", "--micro-batches", "2", "--micro-batch-size",
         "2",
         "--no-progress", "--planner", MARKER, "--log-file", str(log_file)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    restarted = None
    try:
        wait_while_running(lambda: received(out), 120, "the first stats at the planner", launcher)
        started = decisions(log_file, "planner_started")[0]
        first_pid, endpoint = started["pid"], started["endpoint"]
        assert {v["pid"] for v in received(out)} == {first_pid}
        os.kill(first_pid, signal.SIGKILL)
        wait_while_running(lambda: decisions(log_file, "planner_lost"), 60, "planner_lost", launcher)
        seen_before = len(received(out))
        # the command the run logged for a daemon started by hand: the run's key file and the server key
        command = next(r["manual_command"] for r in read_log(log_file) if "manual_command" in r)
        secret_file = re.search(r"VPIPE_CURVE_RUN_SECRET_FILE=(\S+) ", command).group(1)
        server_key = re.search(r"--server-key='([^']+)'", command).group(1)
        assert f"--connect {endpoint}" in command
        restarted = subprocess.Popen(
            [sys.executable, "-m", "vpipe_lab", "planner", "--connect", endpoint,
             f"--server-key={server_key}",
             "--planner", MARKER, "--log-file", str(log_file)], cwd=ROOT,
            env=dict(env, VPIPE_CURVE_RUN_SECRET_FILE=secret_file), stderr=subprocess.PIPE, text=True,
        )
        wait_while_running(lambda: any(v["pid"] == restarted.pid for v in received(out)), 60,
              "stats at the restarted planner", launcher)
        _, stderr = launcher.communicate(timeout=240)
        restarted.wait(timeout=30)
    finally:
        for p in (launcher, restarted):
            if p is not None and p.poll() is None:
                p.kill()
    assert launcher.returncode == 0, stderr[-3000:]
    assert restarted.returncode == 0  # it left on the run's bye
    lost = decisions(log_file, "planner_lost")
    assert len(lost) == 1 and lost[0]["pid"] == first_pid and lost[0]["rank"] == 1
    attached = [r["pid"] for r in decisions(log_file, "planner_attached")]
    assert attached == [first_pid, restarted.pid]
    after = [v for v in received(out)[seen_before:] if v["pid"] == restarted.pid]
    assert len(after) >= 2 and all(len(v["records"]) == 2 for v in after)
    assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE


def test_a_planner_that_reorders_layers_is_caught_by_the_daemon_and_the_run_trains_on(tmp_path):
    log_file = tmp_path / "run.log"
    proc = run_vpipe("train", "--stages", "2", "--steps", "12", "--monitor-every", "2", "--no-progress",
                     "--blocks", "2", "--d-model", "32", "--seq-len", "16", "--micro-batches", "2", "--vpipe",
                     "--planner", "support.control_planners:reordering", "--log-file", str(log_file),
                     env=planner_env(tmp_path / "unused.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = decisions(log_file, "planner_error")
    assert errors and all("plan reorders layers" in r["error"] for r in errors)
    assert not decisions(log_file, "plan_sent") and not decisions(log_file, "plan_applied")


def test_a_local_process_without_the_runs_key_cannot_take_over_the_planner_link(tmp_path):
    """The single-host default: the control plane admits only this run's own key (made by the launcher)."""
    import zmq

    from vpipe.control.messages import PLANNER, encode, make
    from vpipe.plan import Plan

    log_file = tmp_path / "run.log"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "vpipe_lab", "train", "--stages", "2", "--steps", "60", "--vpipe", "--blocks",
         "2",
         "--d-model", "16", "--seq-len", "8", "--no-progress", "--log-file", str(log_file)],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    context = zmq.Context()
    try:
        def last_stage_inbox() -> list[str]:
            return [r["control_endpoint"] for r in (read_log(log_file) if log_file.exists() else [])
                    if r.get("rank") == 1 and "control_endpoint" in r]

        wait_while_running(lambda: last_stage_inbox(), 120, "the last stage's control inbox", launcher)
        forger = context.socket(zmq.PUSH)
        forger.setsockopt(zmq.LINGER, 0)
        forger.connect(last_stage_inbox()[0])
        hello = make("hello", {"pid": 4242, "endpoint": "tcp://127.0.0.1:9"}, stage=PLANNER)
        plan = make("plan", Plan(epoch=2**62, stages=((0, 1), (2, 3))), epoch=2**62, stage=PLANNER)
        for _ in range(20):
            for message in (hello, plan):
                try:
                    forger.send(encode(message), zmq.NOBLOCK)
                except zmq.Again:
                    pass
            time.sleep(0.05)
        _, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        context.destroy(linger=0)
    assert launcher.returncode == 0, stderr[-3000:]
    assert not [r for r in decisions(log_file, "planner_attached") if r.get("pid") == 4242]
    assert not [r for r in decisions(log_file, "plan_received") if r.get("epoch") == 2**62]
    curve_on = [r for r in read_log(log_file) if "control_endpoint" in r]
    assert curve_on and all(r["curve"] for r in curve_on)  # every inbox is a CURVE server with the run's key
