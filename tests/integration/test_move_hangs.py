"""A rank that stops answering in the middle of a move ends the others within the trainer's own timeout.

The trainer (tests/workers/hang_worker.py) passes ``init_process_group(timeout=T)`` and asks
for a block to move; ``VPIPE_FAULTS=migration_stop@1`` has rank 1 stop itself (SIGSTOP) when
the move's announcement reaches it. Rank 0 must name rank 1 in one line and exit non-zero
within T + 10 s of the stop. It used to sit in the move's commit vote for torch's default 30
minutes: the transfer group was made with ``new_group()`` and no timeout.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from support.processes import ROOT, WORKERS, child_env, warm_starter

LINE = "rank 1 stopped answering (dead or hung) during the move of epoch 1 (round 0)"


def _pid(pids: Path, rank: int) -> int | None:
    try:
        return int((pids / f"rank{rank}").read_text())
    except (OSError, ValueError):
        return None


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stop_to_exit(pids: Path, running: threading.Event | subprocess.Popen, limit_s: float,
                  stops: int = 1) -> float:
    """Seconds from rank ``stops`` stopping to the other rank exiting (the stopped one is then killed, as its
    launcher would later)."""
    deadline = time.monotonic() + limit_s
    stopped = None
    while time.monotonic() < deadline:
        other, silent = _pid(pids, 1 - stops), _pid(pids, stops)
        if stopped is None and silent is not None and not _gone(silent) and \
                psutil.Process(silent).status() == psutil.STATUS_STOPPED:
            stopped = time.monotonic()
        if stopped is not None and other is not None and _gone(other):
            elapsed = time.monotonic() - stopped
            psutil.Process(silent).kill()  # type: ignore[arg-type]
            return elapsed
        ended = running.is_set() if isinstance(running, threading.Event) else running.poll() is not None
        assert not ended, f"the run ended before rank {stops} stopped mid-move"
        time.sleep(0.05)
    raise AssertionError(f"rank {stops} never stopped, or rank {1 - stops} was still running "
                         f"{limit_s:.0f} s later")


def test_a_rank_stopped_mid_move_is_named_and_the_other_exits_within_the_timeout(tmp_path):
    from vpipe_lab.runtime.launch import spawn

    timeout_s, pids, out = 4, tmp_path / "pids", tmp_path / "ranks.txt"
    pids.mkdir()
    done, codes = threading.Event(), []
    env = child_env(VPIPE_FAULTS="migration_stop@1")

    def run() -> None:
        with out.open("w") as sink:
            codes.append(spawn([sys.executable, str(WORKERS / "hang_worker.py"), str(timeout_s), str(pids)],
                               2,
                               extra_env=env, timeout_s=120, stdout=sink, stderr=sink,
                               starter=warm_starter()))
        done.set()

    launcher = threading.Thread(target=run, daemon=True)
    launcher.start()
    elapsed = _stop_to_exit(pids, done, 90)
    launcher.join(30)
    said = out.read_text()
    assert codes and codes[0] != 0, said[-3000:]
    assert elapsed < timeout_s + 10, said[-3000:]
    assert LINE in said, said[-3000:]
    print(f"rank 0 exited {elapsed:.1f} s after rank 1 stopped (timeout {timeout_s} s)")


def test_under_torchrun_a_stopped_rank_ends_the_run_within_the_trainers_timeout(tmp_path):
    timeout_s, pids = 20, tmp_path / "pids"
    pids.mkdir()
    env = child_env(VPIPE_FAULTS="migration_stop@1")
    run = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(WORKERS / "hang_worker.py"), str(timeout_s), str(pids)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        elapsed = _stop_to_exit(pids, run, 240)
        said, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    assert elapsed < timeout_s + 10, said[-3000:]
    assert LINE in said, said[-3000:]
    print(f"rank 0 exited {elapsed:.1f} s after rank 1 stopped (timeout {timeout_s} s)")


def test_a_stopped_rank_that_hosts_the_store_still_lets_the_other_exit(tmp_path):
    """Two processes of a trainer's own (no torchrun): rank 0 hosts the store and stops mid-move, so the store
    stops too. The failed vote cannot say who is missing, but rank 1 still exits, naming the move."""
    timeout_s, pids = 4, tmp_path / "pids"
    pids.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = child_env(VPIPE_FAULTS="migration_stop@0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    WORLD_SIZE="2")
    ranks = [subprocess.Popen([sys.executable, str(WORKERS / "hang_worker.py"), str(timeout_s), str(pids),
                               "0"],
                              cwd=ROOT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        elapsed = _stop_to_exit(pids, ranks[1], 240, stops=0)
        said, _ = ranks[1].communicate(timeout=60)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
            rank.communicate()
    assert ranks[1].returncode != 0
    # the store asked 2 s, the keys 2 s, the last stage's stats 5 s
    assert elapsed < timeout_s + 15, said[-3000:]
    assert "the move of epoch 1 (round 0) failed after at most" in said, said[-3000:]
    assert "the store did not say who is missing" in said, said[-3000:]
    print(f"rank 1 exited {elapsed:.1f} s after rank 0, the store's host, stopped (timeout {timeout_s} s)")
