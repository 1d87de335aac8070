"""The last stage's side of the planner daemon: start it, watch it, feed it stats.

The daemon is a separate process so that planning never blocks training. It attaches by
sending ``hello`` (with its own inbox endpoint) to the last stage's inbox, which answers
``welcome`` with the current plan; from then on it gets every full stats vector and
sends ``ping`` every heartbeat. The link only looks at the daemon between steps, never
waits for it, and declares it lost (decision ``planner_lost``, a warning) when it has
been silent for ``timeout_s`` or its process has exited; training goes on with the
current plan. Any daemon that says ``hello`` later, a restarted one or one started by
hand with ``vpipe planner --connect ENDPOINT``, attaches again (``planner_attached``).
With CURVE on, the daemon's hello carries its inbox's public key, which must be trusted.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from vpipe.control.channel import PLANNER_CONNECT_KEY, ControlPlane
from vpipe.control.curve import RUN_SECRET_FILE_ENV, RunKeys, log_due
from vpipe.control.messages import Message, make
from vpipe.control.netaddr import check_endpoint
from vpipe.log import decision
from vpipe.monitors.records import StageRecord
from vpipe.plan import Plan

log = logging.getLogger("vpipe.control")

__all__ = ["PlannerLink", "daemon_arguments", "manual_command"]

_PEER = "planner"


def daemon_arguments(endpoint: str, planner: str, *, parent_pid: int, heartbeat_s: float,
                     server_key: bytes | None, log_file: str | None,
                     planner_config: Mapping[str, Any] | None = None) -> list[str]:
    """The daemon's command-line arguments for a daemon this stage starts itself."""
    args = ["--connect", endpoint, "--planner", planner, "--parent-pid", str(parent_pid),
            "--heartbeat", str(heartbeat_s)]
    # one word, as the key below; JSON of plain values (ValueError if it is not)
    if planner_config is not None:
        args.append(f"--planner-config={json.dumps(planner_config, allow_nan=False, separators=(',', ':'))}")
    if server_key is not None:  # one word: a Z85 key may begin with '-', which argparse takes for an option
        args.append(f"--server-key={server_key.decode()}")
    if log_file:
        args += ["--log-file", log_file]
    return args


def manual_command(endpoint: str, server_key: bytes | None, secret_file: str | None = None) -> str:
    """The shell command, logged at start, that attaches a daemon started by hand."""
    key = f" --server-key='{server_key.decode()}'" if server_key is not None else ""  # Z85 has no quote
    env = f"{RUN_SECRET_FILE_ENV}={secret_file} " if secret_file else ""
    return f"{env}vpipe planner --connect {endpoint}{key}"


class PlannerLink:
    def __init__(
        self,
        plane: ControlPlane,
        *,
        stage_index: int,
        num_stages: int,
        timeout_s: float = 5.0,
        heartbeat_s: float = 0.5,
        log_file: str | None = None,
        backlog: int = 16,
        keys: RunKeys | None = None,
    ) -> None:
        if timeout_s <= heartbeat_s:
            raise ValueError(f"planner timeout {timeout_s} s must exceed the heartbeat {heartbeat_s} s")
        self.plane = plane
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.log_file = log_file
        self.keys = keys if keys is not None else RunKeys.of_process()  # the attach's: what its daemon holds
        self.process: subprocess.Popen | None = None
        self.attached_pid: int | None = None
        self.attached_endpoint: str | None = None
        self.vectors_sent = 0
        self.vectors_dropped = 0  # waited for a daemon longer than the backlog holds
        self._backlog: deque[tuple[int, tuple[StageRecord, ...], int]] = deque()
        self._backlog_size = backlog
        self._last_heard = 0.0
        self._last_sent = 0.0
        self.refused_hellos = 0
        plane.store.set(PLANNER_CONNECT_KEY, plane.endpoint)
        server_key = plane.curve.public if plane.curve else None
        secret_file = self.keys.secret_file() if plane.curve is not None and not self.keys.by_files else None
        self.manual_command = manual_command(plane.endpoint, server_key, secret_file)
        log.info("planner daemons connect to %s (%s)", plane.endpoint, self.manual_command,
                 extra={"vpipe_fields": {"manual_command": self.manual_command}})

    @property
    def attached(self) -> bool:
        return self.attached_endpoint is not None

    @property
    def starting(self) -> bool:
        """A daemon this link started is running but has not attached yet."""
        return not self.attached and self.process is not None and self.process.poll() is None

    # ---------------------------------------------------------------- lifecycle
    def start(self, planner: str, config: Mapping[str, Any] | None = None) -> None:
        """Start a daemon process running ``planner`` (an import path ``module:function``), configured with
        ``config`` (plain JSON values) when given."""
        # the daemon's own entry point, not `-m vpipe planner`: the full CLI imports torch (seconds)
        cmd = [sys.executable, "-m", "vpipe.control.daemon",
               *daemon_arguments(self.plane.endpoint, planner, parent_pid=os.getpid(),
                                 heartbeat_s=self.heartbeat_s,
                                 server_key=self.plane.curve.public if self.plane.curve else None,
                                 log_file=self.log_file, planner_config=config)]
        # its environment: this process's (the settings the daemon reads at its start), not a rank's, with the
        # attach's run key
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "GROUP_RANK")}
        env.update(self.keys.child_env(), OMP_NUM_THREADS="1")
        self.process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)  # it lowers itself when ready
        decision("planner_started", f"started planner daemon pid {self.process.pid} running {planner}",
                 pid=self.process.pid, planner=planner, endpoint=self.plane.endpoint)

    def close(self, wait_s: float = 5.0) -> None:
        """Tell the daemon that training is over and reap the process this link started."""
        if self.attached:
            self.plane.send(_PEER, make("bye", "training finished", stage=self.stage_index))
        if self.process is not None:
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                log.warning("planner daemon pid %d did not exit within %.0f s of bye; terminating it",
                            self.process.pid, wait_s)
                self.process.terminate()
                try:
                    self.process.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process = None
        self.keys.close()  # the key file of the logged manual command

    # ---------------------------------------------------------------- traffic
    def handle(self, message: Message, current: Plan | None) -> None:
        """A ``hello``, ``ping`` or ``bye`` from a daemon."""
        now = time.monotonic()
        if message.type == "hello":
            endpoint, pid = message.body["endpoint"], message.body["pid"]
            host = check_endpoint(endpoint)[0]
            if host not in ("127.0.0.1", "::1", "localhost", check_endpoint(self.plane.endpoint)[0]):
                self.refused_hellos += 1
                if log_due(self.refused_hellos):
                    log.warning(
                        "a planner hello names %s: neither loopback nor this run's interface; ignored",
                        endpoint,
                    )
                return
            if endpoint != self.attached_endpoint:
                previous = self.attached_pid
                try:
                    self.plane.connect(_PEER, endpoint, server_key=message.body.get("key"))
                except ValueError as e:  # its key is not trusted (or missing): do not talk to it
                    self.refused_hellos += 1
                    if log_due(self.refused_hellos):
                        log.warning("planner daemon pid %d at %s not attached: %s", pid, endpoint, e)
                    return
                self.attached_endpoint, self.attached_pid = endpoint, pid
                decision("planner_attached", f"planner daemon pid {pid} attached at {endpoint}",
                         pid=pid, endpoint=endpoint, replaced=previous)
            # hello repeats until welcome arrives: answer every one
            self._send(make("welcome", {"plan": current, "num_stages": self.num_stages},
                            epoch=current.epoch if current else 0, stage=self.stage_index))
            self._last_heard = now
            while self._backlog:
                self._send_vector(*self._backlog.popleft())
        elif message.type == "ping" and self.attached:
            self._last_heard = now
        elif message.type == "bye" and self.attached:
            self._lose(f"the daemon left: {message.body}")

    def send_stats(self, vector: Sequence[StageRecord], iteration: int, epoch: int) -> bool:
        """Hand a full stats vector to the daemon; while none is attached keep the latest few for it."""
        if self.attached:
            return self._send_vector(iteration, tuple(vector), epoch)
        if len(self._backlog) == self._backlog_size:
            dropped_iteration = self._backlog.popleft()[0]
            self.vectors_dropped += 1
            if self.vectors_dropped == 1 or self.vectors_dropped % 100 == 0:
                log.info("no planner daemon attached: stats of iteration %d dropped (%d so "
                         "far); the newest %d wait",
                         dropped_iteration, self.vectors_dropped, self._backlog_size)
        self._backlog.append((iteration, tuple(vector), epoch))
        return True

    def send_alert(self, message: Message) -> bool:
        """Hand a pulse's alert to the daemon (dropped while none is
        attached: the next samples see the change)."""
        return self.attached and self._send(message)

    def _send_vector(self, iteration: int, vector: tuple[StageRecord, ...], epoch: int) -> bool:
        ok = self._send(make("stats", vector, epoch=epoch, iteration=iteration, stage=self.stage_index))
        self.vectors_sent += ok
        return ok

    def tick(self) -> None:
        """Between steps: notice a lost daemon, keep the attached one informed that we live."""
        now = time.monotonic()
        if self.process is not None and self.process.poll() is not None:
            code, pid = self.process.returncode, self.process.pid
            self.process = None
            if self.attached or code != 0:
                self._lose(f"daemon process exited with code {code}", pid)
                return
        if self.attached and now - self._last_heard > self.timeout_s:
            self._lose(f"no message from the daemon for {now - self._last_heard:.1f} s")
            return
        if self.attached and now - self._last_sent > self.heartbeat_s:
            self._send(make("ping", stage=self.stage_index))

    def _send(self, message: Message) -> bool:
        self._last_sent = time.monotonic()
        return self.plane.send(_PEER, message)

    def _lose(self, reason: str, pid: int | None = None) -> None:
        pid = self.attached_pid if self.attached_pid is not None else pid
        log.warning("planner lost (%s); training continues on the current plan", reason)
        decision("planner_lost", f"planner lost: {reason}; training continues on the current plan",
                 pid=pid, reason=reason)
        self.plane.disconnect(_PEER)
        self.attached_endpoint = None
        self.attached_pid = None
