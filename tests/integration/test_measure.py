"""Measured runs: the launcher's timeout, the outside-load sampler, and a failing run's message."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.launch import heartbeat_timeout_from_env, spawn
from vpipe_lab.runtime.measure import RunnableSampler, run_training

BUSY = [sys.executable, "-c", "while True: pass"]


def test_spawn_kills_every_rank_after_its_timeout():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish within 2 s; its 2 ranks were killed"):
        spawn([sys.executable, "-c", "import time; time.sleep(120)"], 2, timeout_s=2)
    assert time.monotonic() - started < 60
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and _alive(p)]
    assert not left, f"still running after the timeout: {left}"


def _alive(process: psutil.Process) -> bool:
    """Whether ``process`` still runs (a killed rank not yet reaped is a zombie, not alive)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _outside_threads(*root_pids: int, seconds: float = 2.0) -> list[float]:
    """Runnable threads outside each root's tree, sampled over the same window (other load counts for all)."""
    samplers = [RunnableSampler(pid, interval_s=0.05).start() for pid in root_pids]
    time.sleep(seconds)
    loads = [sampler.stop() for sampler in samplers]
    assert None not in loads
    return loads  # type: ignore[return-value]


@pytest.mark.skipif(not RunnableSampler.available(), reason="needs /proc/stat (Linux)")
def test_runnable_sampler_counts_busy_threads_outside_the_tree_only():
    """A busy process counts as outside load for another tree, and not for its own."""
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # two busy children: the samplers read the machine's other load at different instants, and under a
    # loaded machine (CI runs two test files at once) that noise once hid most of a single busy thread
    busy = [subprocess.Popen(BUSY) for _ in range(2)]
    try:
        time.sleep(0.5)
        # busy: our children
        seen_from_elsewhere, seen_from_its_tree = _outside_threads(idle.pid, os.getpid())
    finally:
        for p in (idle, *busy):
            p.kill()
            p.wait()
    assert seen_from_elsewhere - seen_from_its_tree > 1.0, (seen_from_elsewhere, seen_from_its_tree)


def test_bad_heartbeat_timeout_is_named_before_any_rank_starts():
    cfg = RunConfig(stages=2, steps=3, blocks=2, d_model=32, progress=False)
    with pytest.raises(ValueError,
                       match=r"VPIPE_HEARTBEAT_TIMEOUT must be a number of seconds above 1, got 'abc'"):
        run_training(cfg, extra_env={"VPIPE_HEARTBEAT_TIMEOUT": "abc"})
    assert heartbeat_timeout_from_env({}) == 10.0
    for bad in ("0", "1", "nan", "inf", "-3"):
        with pytest.raises(ValueError, match="VPIPE_HEARTBEAT_TIMEOUT"):
            heartbeat_timeout_from_env({"VPIPE_HEARTBEAT_TIMEOUT": bad})


def test_a_run_measures_every_step_of_every_rank():
    run = run_training(RunConfig(stages=2, steps=3, blocks=2, d_model=32, progress=False))
    assert len(run.step_s) == 2 and all(len(s) == 3 for s in run.step_s)
    assert [r["layer_ids"] for r in run.ranks] == [[0, 1], [2, 3]]
    assert run.wall_s > sum(run.step_s[0]) and run.outside_threads is not None


def test_a_failing_run_raises_with_what_its_ranks_printed():
    cfg = RunConfig(stages=2, steps=6, blocks=2, d_model=32, progress=False)
    with pytest.raises(RuntimeError, match=r"(?s)vpipe train failed \(exit "
                                           r".*vpipe \[rank 0\]: stopping because rank 1 stopped answering"):
        run_training(cfg, extra_env={"VPIPE_FAULTS": "kill@2:1", "VPIPE_HEARTBEAT_TIMEOUT": "3"})
