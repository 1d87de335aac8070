"""Starting ranks: torchrun-compatible environment, process group, and a one-host spawner.

A rank reads what torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), so ``torchrun --nnodes N ... -m vpipe train`` works across hosts. For one
host, :func:`spawn` plays torchrun's part: it hosts the rendezvous store itself (so the
store survives any rank, like torchrun's agent store) and starts one child per rank with
that environment, then ends the others if one fails.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from vpipe.checkpoint import CheckpointError
from vpipe.control.curve import RUN_SECRET_ENV, RunKeys, new_run_secret, remove_private_key_files
from vpipe.control.keys import KeyFileError
from vpipe.control.netaddr import control_host
from vpipe.files import FileCheckError
from vpipe.rank.environment import check_environment
from vpipe_lab.runtime.outputs import OutputInUseError
from vpipe_lab.runtime.warm_start import (
    SHARED_STARTER_ENV,
    StarterLink,
    WarmStarter,
    connect,
    warm_start_possible,
)
from vpipe_lab.runtime.watchdog import Watchdog, stderr_line

log = logging.getLogger("vpipe.runtime")  # the run log keeps vpipe.* loggers

__all__ = ["RankEnv", "Distributed", "rank_env", "init_distributed", "spawn"]


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # the store is hosted by a launcher/agent, not by rank 0

    @property
    def is_multi_host(self) -> bool:
        return self.master_addr not in ("127.0.0.1", "localhost", "::1")


def rank_env(environ: dict[str, str] | None = None) -> RankEnv | None:
    """The torchrun-style environment of this process, or None when not launched as a rank."""
    env = os.environ if environ is None else environ
    if "RANK" not in env:
        return None
    try:
        rank = int(env["RANK"])
        world = int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", env["RANK"]))
        port = int(env["MASTER_PORT"])
        addr = env["MASTER_ADDR"]
    except KeyError as e:
        raise ValueError(f"RANK is set but {e.args[0]} is missing from the environment") from None
    except ValueError as e:
        raise ValueError(f"bad torchrun environment: {e}") from None
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    return RankEnv(rank, world, local, addr, port, env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


@dataclass
class Distributed:
    """What a rank gets from :func:`init_distributed`."""

    env: RankEnv
    store: Any
    watchdog: Watchdog
    device: torch.device

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def finish(self) -> None:
        """Normal end of this rank: tell the peers, then leave the process group."""
        self.watchdog.finish()
        if dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(
    backend: str | None = None,
    *,
    timeout_s: float = 300.0,
    heartbeat_timeout_s: float | None = None,
) -> Distributed:
    """Join the run described by the environment: store, process group, watchdog."""
    # imported here, not at the top: the launcher process (``spawn``) must not pay for torch's pipelining
    from vpipe.tensor_manager.copy_engine import comm_process_group_options

    env = rank_env()
    if env is None:
        raise RuntimeError(
            "not launched as a rank: RANK/WORLD_SIZE are unset (use torchrun or `vpipe train`)"
        )
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=env.rank == 0 and not env.agent_store,
        timeout=timeout,
    )
    hb_timeout = heartbeat_timeout_s or heartbeat_timeout_from_env()
    watchdog = Watchdog(store, env.rank, env.world_size, timeout_s=hb_timeout)
    watchdog.announce()
    # pipeline sends/receives on high-priority NCCL streams: they go before the tensor manager's swap copies
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout,
                            pg_options=comm_process_group_options(backend))
    watchdog.start()
    return Distributed(env=env, store=store, watchdog=watchdog, device=device)


def heartbeat_timeout_from_env(environ: dict[str, str] | None = None) -> float:
    """``VPIPE_HEARTBEAT_TIMEOUT`` in seconds (default 10): how long a silent peer counts as alive."""
    raw = (os.environ if environ is None else environ).get("VPIPE_HEARTBEAT_TIMEOUT", "10")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 1.0 < seconds < float("inf"):  # the watchdog beats every 0.5 s; nan fails the test too
        raise ValueError(f"VPIPE_HEARTBEAT_TIMEOUT must be a number of seconds above 1, got {raw!r}")
    return seconds


EXIT_INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for a process ended by Ctrl-C
INTERRUPT_GRACE_S = 5.0  # how long ranks passed a SIGINT / SIGTERM get to end before they are killed


def run_rank(ctx: Distributed, main: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``main`` on this rank; on failure name the culprit and end the process non-zero."""
    try:
        result = main(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - every failure must end the rank cleanly
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C (passed on by the launcher): asked for, not a failure
            ctx.watchdog.record_interrupt()
            stderr_line(f"vpipe [rank {ctx.rank}]: interrupted")
            exit_now(EXIT_INTERRUPTED)
        message = ctx.watchdog.record_failure(exc)
        if not is_peer_caused(message) and not _explains_itself(exc):
            log.exception("rank %d failed", ctx.rank)
        stderr_line(f"vpipe [rank {ctx.rank}]: {message}")
        exit_now(1)
    ctx.finish()
    return result


def _explains_itself(exc: BaseException) -> bool:
    """vpipe's own errors about the user's input (a budget, a
    checkpoint, a stage shape): one line, no traceback."""
    from vpipe.stage.blocks import BlockContainerError
    from vpipe.tensor_manager.budget import MemoryBudgetError
    from vpipe.tensor_manager.pool import HostPoolFullError

    return isinstance(exc, (MemoryBudgetError, HostPoolFullError, CheckpointError, BlockContainerError,
                            KeyFileError,
                            FileCheckError, OutputInUseError))


def is_peer_caused(message: str) -> bool:
    return message.startswith("stopping because")


# --------------------------------------------------------------------- spawner
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_store(host: str, world_size: int) -> tuple[Any, socket.socket | None]:
    """The run's rendezvous store, listening on ``host`` only (loopback for a run on one host).

    A TCPStore given only a port listens on every interface, so anyone on the network could
    write to it (a ``vpipe/fail`` key ends the run). Handing it a socket already bound to
    ``host`` keeps it there. Returns the store and the listening socket (keep both alive).
    """
    timeout = datetime.timedelta(seconds=600)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(max(128, 4 * world_size))
    try:
        store = dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True,
                              wait_for_workers=False,
                              timeout=timeout, master_listen_fd=listener.fileno())
    # a torch without master_listen_fd: the old way, on every interface
    except (TypeError, RuntimeError) as e:
        listener.close()
        log.warning("rendezvous store listens on every interface (%s)", e)
        return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                             timeout=timeout), None
    return store, listener


def spawn(
    argv: Sequence[str],
    nprocs: int,
    *,
    host: str = "127.0.0.1",
    extra_env: dict[str, str] | None = None,
    grace_s: float = 60.0,
    timeout_s: float | None = None,
    stdout: Any = None,
    stderr: Any = None,
    starter: StarterLink | None = None,
) -> int:
    """Run ``argv`` as ``nprocs`` ranks on this host, torchrun-style; return the run's exit code.

    The store is hosted here, so a dying rank cannot take it down. When a rank exits
    non-zero the others get ``grace_s`` to notice it themselves (they print who died),
    then are killed. Ctrl-C is passed on to every rank (when called from the main thread).
    After ``timeout_s`` every rank is killed and :class:`TimeoutError` raised. ``stdout``
    and ``stderr`` go to every rank (default: this process's). A Python ``argv`` on a CPU-only
    host is forked from one warm interpreter (:mod:`vpipe_lab.runtime.warm_start`): a new
    one per run, ``starter``, kept by the caller for several runs, or the listening starter
    that ``VPIPE_WARM_STARTER`` names.
    """
    if nprocs < 1:
        raise ValueError(f"need at least one rank, got {nprocs}")
    store, _listener = host_store(host, nprocs + 1)
    base = dict(os.environ)
    base.update(extra_env or {})
    heartbeat_timeout_from_env(base)  # bad values are named here, before any rank starts
    settings = check_environment(base)  # every VPIPE_* variable of the library, CURVE key files included
    control_host(settings.control_host, master_addr=host)  # VPIPE_CONTROL_HOST routes to the ranks' store
    keys = RunKeys(settings)
    if not keys.by_files and not keys.given:
        secret = new_run_secret()  # the ranks' control plane admits only this run's key
        if secret is not None:
            base[RUN_SECRET_ENV] = secret  # in the children's environment
    base.update(
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR=host,
        MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", "1"),
    )
    own_starter = starter is None and warm_start_possible(argv, base)
    if own_starter:
        starter = _shared_starter(base) or WarmStarter(base)
    elif not warm_start_possible(argv, base):
        starter = None
    procs: list[Any] = []  # subprocess.Popen, or WarmRank (its poll/wait/kill/send_signal)
    interrupted: list[int] = []  # the signals passed on: the run ends because it was asked to

    def forward_signal(signum: int, _frame: Any) -> None:
        interrupted.append(signum)
        for p in procs:
            p.send_signal(signum)  # a no-op for a rank that has ended

    in_main_thread = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, forward_signal) for s in (signal.SIGINT,
                                                         signal.SIGTERM)} if in_main_thread else {}
    try:
        for rank in range(nprocs):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
            procs.append(starter.start(argv, env, stdout, stderr) if starter is not None
                         else subprocess.Popen(list(argv), env=env, stdout=stdout, stderr=stderr))
        return _wait_all(procs, grace_s, timeout_s, store, interrupted)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if own_starter and starter is not None:
            starter.close()  # kills any rank still running (only after an error here)
        elif starter is not None:
            for p in procs:
                p.kill()  # nothing is left running after an error here
        del store


def _shared_starter(environ: dict[str, str]) -> StarterLink | None:
    """The starter named by ``VPIPE_WARM_STARTER``, if it is there (else this run starts its own)."""
    address = environ.get(SHARED_STARTER_ENV)
    if not address:
        return None
    try:
        return connect(address)
    except OSError as e:
        log.warning("%s=%s: no warm starter answers there (%s); starting one for this run",
                    SHARED_STARTER_ENV,
                    address, e.strerror or e)
        return None


def _blamed(store: Any, rank: int) -> tuple[int, str] | None:
    """The rank that ``rank``'s failure record blames, with its sentence (None: no record, or itself)."""
    if store is None:
        return None
    try:
        key = f"vpipe/fail/{rank}"
        if not store.check([key]):
            return None
        record = json.loads(store.get(key))
        cause = int(record.get("cause", rank))
    except Exception:  # noqa: BLE001 - a record we cannot read blames nobody
        return None
    return (cause, str(record.get("error", ""))) if cause != rank else None


def _wait_all(procs: list[Any], grace_s: float, timeout_s: float | None = None,
              store: Any = None, interrupted: list[int] | None = None) -> int:
    first_failure: tuple[int, int] | None = None
    blamed: tuple[int, str] | None = None  # a rank the others stopped for, still running (hung or stopped)
    failed_at = 0.0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    asked_at: float | None = None  # when a signal to stop was passed on
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if interrupted and asked_at is None:
            asked_at = time.monotonic()
        if asked_at is not None and time.monotonic() - asked_at > INTERRUPT_GRACE_S:
            for p in procs:
                p.kill()  # asked to stop and still running: not worth the wait of whoever asked
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                p.kill()
                p.wait()
            raise TimeoutError(f"the run did not finish within {timeout_s:g} s; its "
                               f"{len(procs)} ranks were killed")
        for rank, code in enumerate(codes):
            if code not in (None, 0) and first_failure is None:
                first_failure = (rank, code)
                failed_at = time.monotonic()
            if code not in (None, 0) and blamed is None:
                culprit = _blamed(store, rank)
                if culprit is not None and 0 <= culprit[0] < len(procs) and codes[culprit[0]] is None:
                    # every other rank gave up on it: no grace for a rank that does not answer
                    blamed = culprit
                    procs[culprit[0]].kill()
        if first_failure is not None and time.monotonic() - failed_at > grace_s:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    exit_codes: list[int] = [p.returncode for p in procs]  # every rank has exited
    bad = [(r, c) for r, c in enumerate(exit_codes) if c != 0]
    summary = ", ".join(f"rank {r}={c}" for r, c in enumerate(exit_codes))
    if bad and any(getattr(p, "starter_lost", False) for p in procs) and not interrupted:
        print(f"vpipe: run failed; the warm starter that forked the ranks ended, so every rank was stopped "
              f"(exit codes: {summary})", file=sys.stderr, flush=True)
        return 1
    if bad and interrupted:
        name = signal.Signals(interrupted[0]).name
        print(f"vpipe: interrupted ({name}); every rank stopped (exit codes: {summary})", file=sys.stderr,
              flush=True)
        return 128 + interrupted[0]
    if bad and blamed is not None:
        print(f"vpipe: run failed; {blamed[1]}, so it was ended (exit codes: {summary})", file=sys.stderr,
              flush=True)
        return 1
    if bad:
        rank, code = first_failure or bad[0]
        print(f"vpipe: run failed; rank {rank} exited first with code {code} (exit codes: {summary})",
              file=sys.stderr, flush=True)
        return code if code > 0 else 1
    return 0



def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` now, after flushing logs and standard streams.

    A process that imported torch's distributed stack spends about a second in interpreter
    shutdown (torch's operator-library finalizers). A rank or launcher that has left its
    process group and written its results has nothing left for that shutdown to do, so it
    skips it: every launch of a pipeline ends that much sooner.
    """
    remove_private_key_files()  # atexit would have
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
