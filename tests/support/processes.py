"""Starting real processes: the ``vpipe`` command, rank programs, and waiting on what they write."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
WORKERS = TESTS / "workers"


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: one thread, unbuffered, no inherited rank, ``support`` importable,
    and ranks that a `vpipe train` in it spawns forked from this test process's warm starter."""
    from vpipe_lab.runtime.warm_start import SHARED_STARTER_ENV

    env = _base_env()
    starter = warm_starter()
    if starter is not None and starter.address is not None:
        env[SHARED_STARTER_ENV] = starter.address
    env.update(extra)
    return env


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(TESTS), env.get("PYTHONPATH")]))
    return env


def run_vpipe(*args: str, timeout: float = 240,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m vpipe_lab ARGS`` (the `vpipe` command);
    return the finished process, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "vpipe_lab", *args],
        cwd=ROOT, env=env or child_env(), capture_output=True, text=True, timeout=timeout,
    )


_STARTER: list = []


def warm_starter():
    """This test process's warm starter (forks ranks with torch imported), kept for every run, its own and
    those of the `vpipe train` processes it starts; None with a GPU."""
    from vpipe_lab.runtime.warm_start import WarmStarter, warm_start_possible

    if not _STARTER:
        env = _base_env()
        _STARTER.append(WarmStarter(env, listen=True) if warm_start_possible([sys.executable, "-"], env)
                        else None)
        if _STARTER[0] is not None:
            atexit.register(_STARTER[0].close)
    return _STARTER[0]


def run_worker(tmp_path: Path, worker: str, scenario: str, ranks: int, timeout_s: float = 240) -> dict:
    """Run ``tests/workers/WORKER.py SCENARIO OUT`` on ``ranks``
    real ranks; its JSON result plus the log records."""
    from vpipe.log import read_log

    out, log_file = tmp_path / f"{scenario}.json", tmp_path / f"{scenario}.log"
    run_ranks([str(WORKERS / f"{worker}.py"), scenario, str(out)], ranks, tmp_path / f"{scenario}.txt",
              child_env(VPIPE_LOG_FILE=str(log_file)), timeout_s=timeout_s)
    result = json.loads(out.read_text())
    result["log"] = read_log(log_file) if log_file.exists() else []
    return result


def run_ranks(program: list[str], ranks: int, output: Path, env: dict[str, str] | None = None,
              timeout_s: float = 300) -> None:
    """Run a Python program (a trainer script or a rank program: its path and arguments) on
    ``ranks`` ranks with the environment and rendezvous store torchrun gives its ranks, forked from
    this test process's warm starter (torchrun's agent and cold ranks cost about 12 s of CPU a run,
    more than most runs here train; test_launch and a few trainer tests run torchrun itself). Fails
    with the end of the ranks' output (kept in ``output``)."""
    from vpipe_lab.runtime.launch import spawn

    with output.open("w") as sink:
        code = spawn([sys.executable, *program], ranks, extra_env=child_env() if env is None else env,
                     timeout_s=timeout_s, stdout=sink, stderr=sink, starter=warm_starter())
    assert code == 0, output.read_text()[-3000:]


def wait_while_running(condition: Callable[[], object], timeout_s: float, what: str,
                       launcher: subprocess.Popen) -> None:
    """Poll ``condition`` while ``launcher`` runs; fail naming ``what`` if it ends first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if launcher.poll() is not None:
            pytest.fail(f"the run ended (code {launcher.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def ranks_training(log_file: Path) -> int:
    """How many ranks of a `vpipe train` run have logged that they started training."""
    return len(training_pids(log_file))


def training_pids(log_file: Path) -> dict[int, int]:
    """Rank -> process id of each rank of a `vpipe train` run that has logged that it started training."""
    from vpipe.log import read_log

    records = read_log(log_file) if log_file.exists() else []
    return {r["rank"]: r["pid"] for r in records if "training layers" in r["msg"]}


def assert_death_mid_move_stops_everyone(tmp_path: Path, stderr_of: Callable[[], str], worker: str,
                                         dead: int = 3, ranks: int = 4) -> None:
    """Run ``tests/workers/WORKER.py fault`` with ``VPIPE_FAULTS=migration_die@DEAD``: world
    rank ``dead`` dies as a forced move's layer reaches it. Every other rank must stop
    within 90 s naming it, nobody may finish the move, and no result may be written.
    ``stderr_of`` reads the ranks' stderr (pytest's ``capfd``)."""
    from vpipe.log import read_log
    from vpipe_lab.runtime.launch import spawn

    log_file = tmp_path / "fault.log"
    started = time.monotonic()
    code = spawn([sys.executable, str(WORKERS / f"{worker}.py"), "fault", str(tmp_path / "fault.json")],
                 ranks,
                 extra_env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]),
                            "VPIPE_LOG_FILE": str(log_file),
                            "VPIPE_FAULTS": f"migration_die@{dead}", "VPIPE_HEARTBEAT_TIMEOUT": "5"},
                 timeout_s=120)
    stderr = stderr_of()
    assert code != 0
    assert time.monotonic() - started < 90
    for r in (r for r in range(ranks) if r != dead):
        said = [ln for ln in stderr.splitlines() if ln.startswith(f"vpipe [rank {r}]:")]
        assert said and f"rank {dead} stopped answering (dead or hung)" in said[-1], (r, stderr[-3000:])
    log = read_log(log_file)
    assert [r for r in log if r.get("event") == "migration_start" and r["rank"] == dead]  # it died mid-move
    assert not [r for r in log if r.get("event") == "migration_done"]  # nobody dropped or took the layer
    assert not (tmp_path / "fault.json").exists()


def run_saved_runs(tmp: Path, worker: str, ranks: int) -> list[dict]:
    """Run ``tests/workers/WORKER.py OUT`` on ``ranks`` ranks, each saving its runs (name -> {"state": ...,
    ...}) to ``OUT.rankR.pt``: each rank's runs, their states as dicts."""
    import torch

    run_ranks([str(WORKERS / f"{worker}.py"), str(tmp / "runs")], ranks, tmp / "ranks.txt")
    loaded = [torch.load(tmp / f"runs.rank{r}.pt", weights_only=True) for r in range(ranks)]
    for rank in loaded:
        for run in rank.values():
            run["state"] = dict(run["state"])
    return loaded
