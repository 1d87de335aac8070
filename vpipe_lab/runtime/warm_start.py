"""Starting a run's ranks from one warm interpreter instead of one cold interpreter each.

A rank spends most of its start importing torch's pipelining (about 5 s of CPU, more than a
short run trains). The spawner therefore starts one *warm starter* per run: a process that
imports torch once, then forks every rank from that state. Each rank is still a real
process with its own torchrun-style environment, working directory, ``sys.argv`` and exit
code; it runs its program exactly as ``python PROGRAM`` would (a script, ``-m module`` or
``-c code``). The spawner talks to the starter over a pipe (JSON lines) and handles each
rank through :class:`WarmRank`, the part of ``subprocess.Popen`` it uses.

Forking after CUDA is touched is unsafe, so where an NVIDIA device exists ranks start cold
(one interpreter each), as they also do with ``VPIPE_COLD_START=1``.
"""

from __future__ import annotations

import json
import os
import random
import runpy
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLD_START_ENV = "VPIPE_COLD_START"
_PRELOAD = ("torch", "torch.distributed.pipelining", "numpy", "vpipe._attach", "vpipe_lab.runtime.trainer")


def warm_start_possible(argv: Sequence[str], environ: dict[str, str]) -> bool:
    """Whether ``argv`` can be forked from a warm interpreter: a Python program, CPU only, not turned off."""
    if environ.get(COLD_START_ENV, "") not in ("", "0"):
        return False
    if Path("/dev/nvidiactl").exists() or not hasattr(os, "fork"):
        return False
    return len(argv) >= 2 and os.path.realpath(argv[0]) == os.path.realpath(sys.executable)


class WarmStarter:
    """The launcher's end of one warm starter process; :meth:`start` forks a rank from it."""

    def __init__(self, env: dict[str, str], stdout: Any = None, stderr: Any = None) -> None:
        reply_read, reply_write = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "vpipe_lab.runtime.warm_start", str(reply_write)],
            env=env, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr, pass_fds=(reply_write,),
        )
        os.close(reply_write)
        self._replies = os.fdopen(reply_read, "rb", buffering=0)
        self._buffer = b""
        self.exit_codes: dict[int, int] = {}

    def start(self, argv: Sequence[str], env: dict[str, str]) -> WarmRank:
        """Fork one rank running ``argv`` (a Python command line) with ``env``; return its handle."""
        request = {"argv": list(argv), "env": env, "cwd": os.getcwd()}
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        while True:
            for reply in self._read(timeout_s=1.0):
                if "pid" in reply:
                    return WarmRank(self, reply["pid"])
            if self._proc.poll() is not None:
                raise RuntimeError(f"the warm starter exited with code {self._proc.returncode} before starting a rank")

    def collect(self, timeout_s: float = 0.0) -> None:
        """Take in the exit codes the starter has reported so far."""
        list(self._read(timeout_s))
        if self._proc.poll() is not None:  # it reports every rank before it exits, so nothing is left to read later
            list(self._read(0.0))

    def close(self) -> None:
        """End the starter (it kills any rank still running when its pipe closes) and wait for it."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._replies.close()

    def _read(self, timeout_s: float):
        while select.select([self._replies], [], [], timeout_s)[0]:
            chunk = self._replies.read(65536)
            if not chunk:
                return
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                reply = json.loads(line)
                if "exited" in reply:
                    self.exit_codes[reply["exited"]] = reply["code"]
                yield reply
            timeout_s = 0.0


class WarmRank:
    """A forked rank, handled like the ``subprocess.Popen`` of a cold one (poll, wait, kill, signals)."""

    def __init__(self, starter: WarmStarter, pid: int) -> None:
        self._starter = starter
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self._starter.exit_codes.get(self.pid)

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
def _serve(reply_fd: int) -> dict[str, Any]:
    """Fork a rank per request line on stdin, report pids and exit codes; return only in a forked rank."""
    for name in _PRELOAD:
        __import__(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to pass on, to the ranks
    requests, buffer, open_ = sys.stdin.fileno(), b"", True
    running: set[int] = set()
    while open_ or running:
        if open_ and select.select([requests], [], [], 0.05)[0]:
            chunk = os.read(requests, 65536)
            open_ = bool(chunk)
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os.close(reply_fd)
                    return request
                running.add(pid)
                os.write(reply_fd, json.dumps({"pid": pid}).encode() + b"\n")
            if not open_:  # the launcher has gone: nobody will wait for these ranks
                for pid in running:
                    os.kill(pid, signal.SIGKILL)
        elif not open_:
            time.sleep(0.05)
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                os.write(reply_fd, json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode()
                         + b"\n")
    sys.exit(0)


def _become(request: dict[str, Any]) -> None:
    """Turn this forked process into ``python ARGV`` with the request's environment and directory."""
    sys.stdin.close()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
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


if __name__ == "__main__":
    _become(_serve(int(sys.argv[1])))
