"""Starting a run's ranks from one warm interpreter instead of one cold interpreter each.

A rank spends most of its start importing torch's pipelining (about 5 s of CPU, more than a
short run trains). The spawner therefore starts one *warm starter* per run: a process that
imports torch once, then forks every rank from that state. Each rank is still a real
process with its own torchrun-style environment, working directory, umask, ``sys.argv`` and
exit code; it runs its program exactly as ``python PROGRAM`` would (a script, ``-m module`` or
``-c code``). The spawner talks to the starter over a Unix socket (one JSON message per
request or report; a request carries the rank's stdout and stderr descriptors) and handles
each rank through :class:`WarmRank`, the part of ``subprocess.Popen`` it uses.

A starter made with ``listen=True`` also serves other launchers on this host: ``spawn``
finds its socket in ``VPIPE_WARM_STARTER`` (the test suite keeps one starter per test process
and every ``vpipe train`` it runs forks its ranks there, instead of each importing torch
again). Such ranks are children of the starter, not of their launcher; a launcher that goes
takes its own ranks with it.

Forking after CUDA is touched is unsafe, so where an NVIDIA device exists ranks start cold
(one interpreter each), as they also do with ``VPIPE_COLD_START=1``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

COLD_START_ENV = "VPIPE_COLD_START"
SHARED_STARTER_ENV = "VPIPE_WARM_STARTER"  # the socket of a starter made with listen=True
_PRELOAD = ("torch", "torch.distributed.pipelining", "numpy", "vpipe._attach", "vpipe_lab.runtime.trainer")


def warm_start_possible(argv: Sequence[str], environ: dict[str, str]) -> bool:
    """Whether ``argv`` can be forked from a warm interpreter: a Python program, CPU only, not turned off."""
    if environ.get(COLD_START_ENV, "") not in ("", "0"):
        return False
    if Path("/dev/nvidiactl").exists() or not hasattr(os, "fork"):
        return False
    return len(argv) >= 2 and os.path.realpath(argv[0]) == os.path.realpath(sys.executable)


class StarterLink:
    """One launcher's connection to a warm starter: :meth:`start` forks a rank there, :meth:`collect` takes in
    exit codes, :meth:`close` hangs up (the starter then kills the ranks this link started that still run)."""

    def __init__(self, connected: socket.socket) -> None:
        self._socket = connected
        self.exit_codes: dict[int, int] = {}
        self.lost = False  # the starter ended while this link was open: nobody reports its ranks' exits

    def start(self, argv: Sequence[str], env: dict[str, str], stdout: Any = None,
              stderr: Any = None) -> WarmRank:
        """Fork one rank running ``argv`` (a Python command line) with ``env``; return its handle.

        ``stdout`` and ``stderr`` as for ``subprocess.Popen``: None (this process's), DEVNULL, or a file.
        """
        request = json.dumps({"argv": list(argv), "env": env, "cwd": os.getcwd(), "umask": _umask()}).encode()
        with _descriptor(stdout, 1) as out, _descriptor(stderr, 2) as err:
            socket.send_fds(self._socket, [request], [out, err])
        while self._socket.fileno() >= 0:
            for reply in self._read(timeout_s=1.0):
                if "pid" in reply:
                    return WarmRank(self, reply["pid"])
        raise RuntimeError("the warm starter ended before starting a rank")

    def collect(self, timeout_s: float = 0.0) -> None:
        """Take in the exit codes the starter has reported so far."""
        list(self._read(timeout_s))

    def close(self) -> None:
        self._socket.close()

    @property
    def closed(self) -> bool:
        return self._socket.fileno() < 0

    def _read(self, timeout_s: float) -> Iterator[dict[str, Any]]:
        while self._socket.fileno() >= 0 and select.select([self._socket], [], [], timeout_s)[0]:
            try:
                message = self._socket.recv(65536)
            except ConnectionResetError:
                message = b""
            if not message:
                self._socket.close()  # the starter has gone
                self.lost = True
                return
            reply = json.loads(message)
            if "exited" in reply:
                self.exit_codes[reply["exited"]] = reply["code"]
            yield reply
            timeout_s = 0.0


def connect(address: str) -> StarterLink:
    """A link to the starter listening at ``address`` (OSError if there is none)."""
    connected = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connected.connect(address)
    except OSError:
        connected.close()
        raise
    return StarterLink(connected)


class WarmStarter(StarterLink):
    """A warm starter process and its owner's link to it.

    One starter can serve many runs one after another (a test session keeps one): each
    request carries the rank's whole environment and its stdout and stderr descriptors. With
    ``listen=True`` other launchers reach it at :attr:`address` (:func:`connect`); it ends, with
    every rank it started, when this object closes.
    """

    def __init__(self, env: dict[str, str], *, listen: bool = False) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        super().__init__(ours)
        passed = [theirs]
        self.address: str | None = None
        self._directory: tempfile.TemporaryDirectory | None = None
        if listen:  # bound and listening here, so a launcher can connect as soon as it learns the address
            self._directory = tempfile.TemporaryDirectory(prefix="vpipe-starter-")  # 0700: this user's only
            self.address = os.path.join(self._directory.name, "socket")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(self.address)
            listener.listen(16)
            passed.append(listener)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "vpipe_lab.runtime.warm_start", *(str(s.fileno()) for s in passed)],
            env=env, stdin=subprocess.DEVNULL, pass_fds=[s.fileno() for s in passed])
        for s in passed:
            s.close()
        self.pid = self._proc.pid

    def close(self) -> None:
        """End the starter (it kills any rank still running when its socket closes) and wait for it."""
        super().close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._directory is not None:
            self._directory.cleanup()


@contextlib.contextmanager
def _descriptor(target: Any, default: int) -> Iterator[int]:
    """The file descriptor a rank's stream goes to, as ``subprocess.Popen`` reads ``stdout=``/``stderr=``."""
    if target is None:
        yield default
    elif target == subprocess.DEVNULL:
        with open(os.devnull, "wb") as devnull:
            yield devnull.fileno()
    elif isinstance(target, int) and target >= 0:
        yield target
    elif hasattr(target, "fileno"):
        target.flush()
        yield target.fileno()
    else:
        raise ValueError("a warm-started rank's output goes to a file, DEVNULL or this "
                         f"process's, not {target!r}")


class WarmRank:
    """A forked rank, handled like the ``subprocess.Popen`` of a cold one (poll, wait, kill, signals)."""

    def __init__(self, starter: StarterLink, pid: int) -> None:
        self._starter = starter
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        code = self._starter.exit_codes.get(self.pid)
        if code is None and self._starter.lost:
            # the starter that would report its exit is gone (killed): the rank dies with it (it asked the
            # kernel to, at fork), and is ended here in case it has not yet; it counts as killed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGKILL)
            code = self._starter.exit_codes[self.pid] = -signal.SIGKILL
        return code

    @property
    def starter_lost(self) -> bool:
        """Whether the starter ended while this rank ran (killed with it)."""
        return self._starter.lost

    def poll(self) -> int | None:
        if self.returncode is None:
            self._starter.collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            self._starter.collect(timeout_s=0.1)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass  # it ended; the starter reports how

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ----------------------------------------------------------------- the starter process
def _serve(owner_fd: int, listener_fd: int | None = None) -> dict[str, Any]:
    """Fork a rank per request, report pids and exit codes to whoever asked; return only in a forked rank.

    Each connection (the owner's, and any accepted on the listener) has its own ranks: when one
    closes, its launcher has gone and nobody will wait for them, so they are killed. When the
    owner closes, every rank is, and the starter ends.
    """
    for name in _PRELOAD:
        __import__(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to pass on, to the ranks
    owner = socket.socket(fileno=owner_fd)
    listener = socket.socket(fileno=listener_fd) if listener_fd is not None else None
    ranks: dict[socket.socket, set[int]] = {owner: set()}  # connection -> the ranks it started
    orphans: set[int] = set()  # killed because their launcher went; reaped, reported to nobody
    while owner in ranks or orphans:
        waiting = [*ranks, *([listener] if listener is not None and owner in ranks else [])]
        for connection in select.select(waiting, [], [], 0.05)[0]:
            if connection is listener:
                ranks[connection.accept()[0]] = set()
                continue
            if connection not in ranks:
                continue  # closed just now, with the owner
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
            if message:
                pid = os.fork()
                if pid == 0:
                    _die_with_starter()
                    for other in [*ranks, *([listener] if listener is not None else [])]:
                        other.close()
                    os.dup2(fds[0], 1)
                    os.dup2(fds[1], 2)
                    return {**json.loads(message), "_fds": fds}
                ranks[connection].add(pid)
                _report(connection, {"pid": pid})
            for descriptor in fds:
                os.close(descriptor)
            if not message:  # its launcher has gone
                gone = [connection] if connection is not owner else list(ranks)
                for closed in gone:
                    orphans |= _kill_all(ranks.pop(closed))
                    closed.close()
        for connection, pids in ranks.items():
            for pid, code in _reaped(pids).items():
                _report(connection, {"exited": pid, "code": code})
        _reaped(orphans)
    sys.exit(0)


def _die_with_starter() -> None:
    """Ask the kernel to kill this forked rank when the starter dies (``kill -9`` of the starter leaves no
    rank training on as an orphan). Linux's ``prctl(PR_SET_PDEATHSIG)``; elsewhere the launcher ends them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _reaped(pids: set[int]) -> dict[int, int]:
    """Remove from ``pids`` those that have exited; return their exit codes."""
    done = {}
    for pid in list(pids):
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            pids.discard(pid)
            done[pid] = os.waitstatus_to_exitcode(status)
    return done


def _kill_all(pids: set[int]) -> set[int]:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def _report(connection: socket.socket, reply: dict[str, Any]) -> None:
    try:
        connection.send(json.dumps(reply).encode())
    except OSError:
        pass  # the launcher has just gone; its hang-up is read next


def _umask() -> int:
    """This process's umask, read without changing it where Linux says it (``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _become(request: dict[str, Any]) -> None:
    """Turn this forked process into ``python ARGV`` with the request's environment and directory."""
    for descriptor in request["_fds"]:
        if descriptor not in (1, 2):
            os.close(descriptor)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _follow_pythonpath(os.environ.get("PYTHONPATH", ""), request["env"].get("PYTHONPATH", ""))
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request.get("umask", 0o022))  # the launcher's, as a rank it started itself would have
    random.seed()  # a cold interpreter seeds from the OS; forked ranks must not share a sequence
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    args = list(request["argv"][1:])
    while args and args[0] == "-u":
        args.pop(0)
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - python -c
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
        runpy.run_path(args[0], run_name="__main__")
    sys.exit(0)


def _follow_pythonpath(started_with: str, wanted: str) -> None:
    """Give ``sys.path`` the request's ``PYTHONPATH`` entries where
    the starter had its own (right after [0])."""
    if started_with == wanted:
        return
    old = set(filter(None, started_with.split(os.pathsep)))
    sys.path[1:] = [entry for entry in wanted.split(os.pathsep) if entry] + [e for e in sys.path[1:]
                                                                             if e not in old]


if __name__ == "__main__":
    _become(_serve(*(int(fd) for fd in sys.argv[1:3])))
