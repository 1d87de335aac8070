"""Real ``vpipe train`` runs as measurements: steady-state step time and how busy the machine was.

A shared machine makes wall times lie: another user's processes take cores away. Each
run therefore also reports ``external_cores``, the CPU time that processes other than
this one and its children used during the run, in cores (system-wide busy time from
psutil minus the children's and our own CPU time), so callers can tell a quiet
measurement from a disturbed one and repeat the disturbed ones.

CPU time cannot tell how many threads competed for the cores once they were all busy
(three outside threads and two ranks on two cores use two cores, as do one and two). The
scheduler shares the cores between runnable threads, so each run also reports
``outside_threads``: the mean number of runnable threads that are not the run's own,
sampled from ``/proc`` ten times a second (Linux only; None elsewhere).
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from vpipe_lab.runtime.config import RunConfig

__all__ = ["MeasuredRun", "train_argv", "run_training", "CpuWindow", "RunnableSampler", "steady_step_s"]

ROOT = Path(__file__).resolve().parents[2]


def train_argv(cfg: RunConfig) -> list[str]:
    """``vpipe train`` arguments that reproduce ``cfg`` (the fields the CLI exposes)."""
    argv = ["train", "--model", cfg.model, "--blocks", str(cfg.blocks), "--d-model", str(cfg.d_model),
            "--n-heads", str(cfg.n_heads), "--seq-len", str(cfg.seq_len), "--dropout", str(cfg.dropout),
            "--stages", str(cfg.stages), "--schedule", cfg.schedule, "--micro-batches",
            str(cfg.micro_batches),
            "--micro-batch-size", str(cfg.micro_batch_size), "--steps", str(cfg.steps), "--lr", str(cfg.lr),
            "--optimizer", cfg.optimizer, "--seed", str(cfg.seed), "--no-progress"]
    if cfg.block_types is not None:
        raise ValueError("block_types cannot be given on the command line")
    if cfg.partition is not None:
        argv += ["--partition", ",".join(map(str, cfg.partition))]
    if cfg.vpipe:
        argv += ["--vpipe", "--policy", cfg.policy]
        if cfg.memory_budget is not None:
            argv += ["--memory-budget", str(cfg.memory_budget)]
        if not cfg.planning:
            argv.append("--no-planning")
        if cfg.monitor_every:
            argv += ["--monitor-every", str(cfg.monitor_every)]
        if cfg.moves:
            argv += ["--moves", ";".join(f"{m['step']}:{','.join(map(str, m['partition']))}"
                                         for m in cfg.moves)]
    if cfg.nas:
        argv += ["--nas", json.dumps(cfg.nas)]
    if cfg.log_file:
        argv += ["--log-file", cfg.log_file]
    return argv


class CpuWindow:
    """CPU time used by other processes between ``start()`` and ``stop()``, in cores."""

    def start(self) -> CpuWindow:
        self._wall = time.perf_counter()
        self._busy = _system_busy_s()
        self._ours = _own_cpu_s()
        return self

    def stop(self) -> float:
        wall = time.perf_counter() - self._wall
        busy = _system_busy_s() - self._busy
        ours = _own_cpu_s() - self._ours
        return max(0.0, busy - ours) / wall if wall > 0 else 0.0


class RunnableSampler:
    """Mean number of runnable threads outside a process tree, sampled every ``interval_s`` on a thread.

    ``procs_running`` in ``/proc/stat`` counts every runnable thread, the sampler's own read
    included; the tree's runnable processes (state ``R``) are subtracted.
    """

    REFRESH_EVERY = 10  # samples between two listings of the tree's processes

    def __init__(self, root_pid: int, interval_s: float = 0.1) -> None:
        self._root = root_pid
        self._interval = interval_s
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vpipe-runnable-sampler", daemon=True)

    @staticmethod
    def available() -> bool:
        return Path("/proc/stat").exists()

    def start(self) -> RunnableSampler:
        self._thread.start()
        return self

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join()
        return statistics.fmean(self._samples) if self._samples else None

    def _run(self) -> None:
        tree: list[psutil.Process] = []
        for sample in itertools.count():
            if self._stop.wait(self._interval):
                return
            try:
                if sample % self.REFRESH_EVERY == 0:  # walking /proc for the tree costs more than the samples
                    root = psutil.Process(self._root)
                    tree = [root, *root.children(recursive=True)]
                ours = sum(_is_running(p) for p in tree)
                running = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                               if line.startswith("procs_running"))
            except (psutil.Error, OSError, StopIteration):
                continue  # the tree is starting or ending
            self._samples.append(max(0, running - 1 - ours))


def _is_running(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_RUNNING
    except psutil.Error:  # ended since the tree was listed
        return False


def _system_busy_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0) - getattr(t, "guest", 0.0) \
        - getattr(t, "guest_nice", 0.0)


def _own_cpu_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class MeasuredRun:
    """One launch: every rank's per-step wall times and the machine's other load meanwhile."""

    cfg: dict[str, Any]
    step_s: list[list[float]]  # per rank, per step
    external_cores: float
    wall_s: float
    ranks: list[dict[str, Any]] = field(default_factory=list)  # each rank's rankN.json
    # mean runnable threads of other processes (Linux), see RunnableSampler
    outside_threads: float | None = None

    def steady(self, skip: int = 2) -> list[float]:
        """Per step (after ``skip`` warm-up steps), the mean over ranks of the step's wall time."""
        return steady_step_s(self.step_s, skip)

    def to_dict(self) -> dict[str, Any]:
        return {"cfg": self.cfg, "step_s": self.step_s, "external_cores": self.external_cores,
                "wall_s": self.wall_s,
                "outside_threads": self.outside_threads}


def steady_step_s(step_s: list[list[float]], skip: int = 2) -> list[float]:
    """Step 0 runs torch's shape inference and step 1 still warms caches: the steps after are steady."""
    steps = min(len(s) for s in step_s)
    if steps <= skip:
        raise ValueError(f"need more than {skip} steps to measure a steady state, got {steps}")
    return [statistics.fmean(s[i] for s in step_s) for i in range(skip, steps)]


def samples_per_s(step_s: list[list[float]], samples_per_step: int) -> list[float]:
    """Throughput of every step: a step lasts one pipeline period, so its time is the mean over ranks."""
    steps = min(len(s) for s in step_s)
    return [samples_per_step / statistics.fmean(s[i] for s in step_s) for i in range(steps)]


def run_training(cfg: RunConfig, *, timeout_s: float = 600,
                 extra_env: dict[str, str] | None = None) -> MeasuredRun:
    """Run ``vpipe train`` for ``cfg`` (one process per stage, one thread each) and collect its results.

    The ranks are spawned from this process, as ``vpipe train`` would spawn them, so a
    measurement does not pay for a launcher process of its own (torch's import and shutdown).
    """
    from vpipe_lab.runtime.launch import spawn

    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="vpipe-measure-") as out, \
            open(Path(out) / "stderr.txt", "w+") as stderr:
        argv = ["-m", "vpipe_lab", *train_argv(cfg), "--out-dir", out]
        window = CpuWindow().start()
        started = time.perf_counter()
        sampler = RunnableSampler(os.getpid()).start() if RunnableSampler.available() else None
        try:
            code = spawn([sys.executable, *argv], cfg.stages, extra_env=env, timeout_s=timeout_s,
                         stdout=subprocess.DEVNULL, stderr=stderr)
        finally:
            outside = sampler.stop() if sampler else None
        wall = time.perf_counter() - started
        external = window.stop()
        if code:
            stderr.seek(0)
            raise RuntimeError(f"vpipe train failed (exit {code}): "
                               f"{' '.join(argv[2:])}\n{stderr.read()[-3000:]}")
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(cfg.stages)]
    return MeasuredRun(cfg=cfg.to_dict(), step_s=[r["step_s"] for r in ranks], external_cores=external,
                       wall_s=wall, ranks=ranks, outside_threads=outside)
