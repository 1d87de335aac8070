"""The planner daemon: a process of its own that turns stats vectors into plans.

The last stage starts it (``python -m vpipe planner --connect ENDPOINT ...``) or a person
does, against the endpoint the last stage logs and stores under ``vpipe/ctl/planner``.
It binds only its own inbox, on the address that routes to the last stage (loopback on one
host), says ``hello`` until welcomed, then plans each full stats vector, in order, with the
planner function ``planner(vector, current) -> Plan | None`` (an import path such as
``vpipe.planner.online:srp``; an entry with ``for_daemon()`` gives each daemon its own) and
sends back any plan with a newer epoch; past ``backlog`` waiting vectors the oldest are
dropped, logged. A rank's ``alert`` (its stage changed speed) gets a plan of the same placement back.

A planner takes configuration as data: ``--planner-config JSON`` (a JSON object; the last
stage passes the pipeline's shape this way) goes to the planner function's
``configured(config)``, which checks it and returns the planner function to call
(:mod:`vpipe.control.planner_function`, which also checks each plan before it is sent).

With CURVE on (:mod:`vpipe.control.curve`, configured by the environment it inherits, read
once when the command starts) its inbox is a CURVE server like every rank's, and it needs the
last stage's public key (``--server-key``; the last stage passes its own, and logs it).

A heartbeat thread pings the last stage; if the stage stops answering (it declared the
daemon lost, or it is busy for long) the daemon says ``hello`` again, so it re-attaches
by itself. It exits on ``bye``, when the process that started it is gone, or after
``idle_timeout_s`` without hearing from any training run.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import zmq

from vpipe import log as vlog
from vpipe.control.channel import FROM_SETTINGS, Inbox, Outbox, resolve_curve
from vpipe.control.curve import CurveConfig, RunKeys
from vpipe.control.doorman import DAEMON_CONNECTIONS
from vpipe.control.keys import check_z85_key, read_public_file
from vpipe.control.messages import MAX_MESSAGE_BYTES, PLANNER, Message, make
from vpipe.control.netaddr import check_endpoint, control_host
from vpipe.control.planner_function import PlannerFn, load_planner, parse_planner_config, plan_problem
from vpipe.control.priority import to_background
from vpipe.control.zap import ZapGuard
from vpipe.log import decision
from vpipe.monitors.records import StageRecord
from vpipe.plan import Plan
from vpipe.planner import DEFAULT_PLANNER
from vpipe.planner.judge import PlanJudge
from vpipe.settings import process_settings

log = logging.getLogger("vpipe.planner.daemon")

__all__ = ["no_change", "PlannerDaemon", "NO_CHANGE_PLANNER", "register", "build_parser"]

# the planner that never changes the plan: a daemon started by hand
# without --planner, a run that only monitors
NO_CHANGE_PLANNER = "vpipe.control.daemon:no_change"
# steps: alerts within this of the last one that made the ranks measure again ask nothing new
_REMEASURE_GAP = 8


def no_change(vector: list[StageRecord], current: Plan | None) -> Plan | None:
    """A planner that never changes the plan (monitoring only)."""
    return None


class PlannerDaemon:
    def __init__(
        self,
        connect: str,
        planner: PlannerFn,
        *,
        planner_name: str = "",
        heartbeat_s: float = 0.5,
        stage_timeout_s: float = 10.0,
        idle_timeout_s: float = 300.0,
        parent_pid: int | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        backlog: int = 16,
        server_key: bytes | str | None = None,
        curve: CurveConfig | str | None = FROM_SETTINGS,
        host: str | None = None,
    ) -> None:
        stage_host, _ = check_endpoint(connect)
        self.curve = resolve_curve(curve)
        if self.curve is not None and server_key is None:
            raise ValueError(f"CURVE is on: the planner daemon needs the last stage's public key "
                             f"(--server-key, logged by the run next to {connect})")
        self._server_key = None if self.curve is None else self.curve.check_server_key(
            server_key, f"the last stage at {connect}")
        self._max_bytes = max_message_bytes
        self.connect = connect
        # an entry that makes planners (vpipe's srp) gives each daemon
        # its own: a planner remembers its samples
        for_daemon = getattr(planner, "for_daemon", None)
        self.planner: PlannerFn = for_daemon() if callable(for_daemon) else planner
        self.planner_name = planner_name or getattr(planner, "__name__", "planner")
        self.heartbeat_s = heartbeat_s
        self.stage_timeout_s = stage_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.parent_pid = parent_pid
        self.current: Plan | None = None
        self.judge = PlanJudge()
        self._remeasured_at: int | None = None  # the step of the last alert that made the ranks measure again
        self.num_stages: int | None = None
        self.vectors = 0
        self.skipped = 0
        self.backlog = backlog
        self._context = zmq.Context()
        bind, advertise = control_host(host, master_addr=stage_host)
        self.bind_host = bind
        name = "planner daemon inbox"
        self.guard = None if self.curve is None else ZapGuard(self._context, self.curve, name=name)
        self.inbox = Inbox(self._context, bind, advertise, name=name, max_message_bytes=max_message_bytes,
                           guard=self.guard, max_connections=DAEMON_CONNECTIONS)
        self._outbox = self._new_outbox(1000)
        self._attached, self._stop = threading.Event(), threading.Event()
        self._last_heard = time.monotonic()
        self._heartbeat = threading.Thread(target=self._beat, name="vpipe-planner-heartbeat", daemon=True)

    # ---------------------------------------------------------------- main loop
    def run(self) -> int:
        log.info("planner daemon pid %d (%s): inbox %s (bound to %s%s), connecting to %s", os.getpid(),
                 self.planner_name, self.inbox.endpoint, self.bind_host, ", CURVE" if self.curve else "",
                 self.connect, extra={"vpipe_fields": {"control_endpoint": self.inbox.endpoint,
                                                       "bind": self.bind_host,
                                                       "curve": self.curve is not None}})
        self._heartbeat.start()
        try:
            return self._loop()
        finally:
            self.close()

    def _loop(self) -> int:
        while True:
            messages = self.inbox.receive(timeout_ms=200)
            now = time.monotonic()
            if messages:
                self._last_heard = now
            vectors: list[Message] = []
            bye: Message | None = None
            for message in messages:
                if message.type == "welcome":
                    self._welcome(message)
                elif message.type == "stats" and self._attached.is_set():
                    vectors.append(message)
                elif message.type == "alert" and self._attached.is_set():
                    self._remeasure(message)
                elif message.type == "bye":
                    bye = message
                    break  # nothing after bye counts; what came before it is still planned
                elif message.type not in ("ping", "stats", "alert"):
                    log.warning("planner daemon: unexpected %r message from rank %d; dropped",
                                message.type, message.src)
            if len(vectors) > self.backlog:
                self.skipped += len(vectors) - self.backlog
                log.warning("planner daemon: the planner is %d stats vectors behind; planning the newest %d",
                            len(vectors), self.backlog)
                vectors = vectors[-self.backlog:]
            for message in vectors:
                self._plan(message)
            if bye is not None:
                log.info("planner daemon: the training run said bye (%s); exiting after %d stats vectors and "
                         "%.2f s of CPU", bye.body, self.vectors, time.process_time(),
                         extra={"vpipe_fields": {"vectors": self.vectors, "cpu_s": time.process_time()}})
                return 0
            if self._attached.is_set() and now - self._last_heard > self.stage_timeout_s:
                log.info("planner daemon: no word from the last stage for %.0f s; saying hello again",
                         now - self._last_heard)
                self._attached.clear()
            if now - self._last_heard > self.idle_timeout_s:
                log.warning("planner daemon: nothing from %s for %.0f s; exiting", self.connect,
                            self.idle_timeout_s)
                return 1
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("planner daemon: the process that started it (pid %d) is gone; exiting",
                            self.parent_pid)
                return 1

    def _welcome(self, message: Message) -> None:
        self.current = message.body["plan"]
        self.num_stages = message.body["num_stages"]
        if not self._attached.is_set():
            self._attached.set()
            decision("planner_ready", f"planner daemon attached to {self.connect}", role="planner",
                     pid=os.getpid(), planner=self.planner_name, epoch=self.current.epoch if self.current
                     else None)

    def _plan(self, message: Message) -> None:
        vector = list(message.body)
        self.vectors += 1
        if self.num_stages is not None and len(vector) != self.num_stages:
            log.warning("planner daemon: a stats vector of %d stages for a %d-stage pipeline; ignored",
                        len(vector), self.num_stages)
            return
        revert = self.judge.observe(vector, self.current)
        if revert is not None:  # the newest plan made the measured steps slower: undo it first
            self._send(revert, message, vector)
            return
        try:
            plan = self.planner(vector, self.current)
        except Exception as e:  # noqa: BLE001 - a failing planner must not end the daemon
            log.exception("planner %s failed", self.planner_name)
            decision("planner_error", f"planner {self.planner_name} failed: {type(e).__name__}: {e}",
                     role="planner", iteration=message.iteration, error=f"{type(e).__name__}: {e}")
            return
        if plan is None:
            return
        layer_order = [lid for rec in vector for lid in rec.layer_ids]
        problem = plan_problem(plan, self.current, self.num_stages, layer_order)
        if problem:
            decision("planner_error", f"planner {self.planner_name} returned an unusable plan: {problem}",
                     role="planner", iteration=message.iteration, error=problem)
            return
        if self.judge.refuses(plan):
            log.info("planner daemon: epoch %d repeats a plan that made steps slower; not sent", plan.epoch)
            return
        self.judge.sent(plan, self.current)
        self._send(plan, message, vector)

    def _remeasure(self, message: Message) -> None:
        """A rank's pulse saw its stage change: a plan of the same placement (a new
        epoch) has every rank measure its blocks again from one step; several ranks
        seeing one change ask once; the judge hears of it."""
        body, at = message.body, message.iteration
        if self.current is None or self.planner is no_change or (
                self._remeasured_at is not None and 0 <= at - self._remeasured_at < _REMEASURE_GAP):
            return  # nothing plans on what the samples would show, or this change was asked about already
        self._remeasured_at = at
        if callable(alerted := getattr(self.planner, "alerted", None)):
            alerted(body["stage"], body["ratio"], at)
        what = f"stage {body['stage']}: {body['what']}"
        self.current = plan = replace(self.current, epoch=self.current.epoch + 1,
                                      reason=f"re-measure: {what}")
        self.judge.remeasured(plan, body["ratio"])
        self._outbox.send(make("plan", plan, epoch=plan.epoch, iteration=at, stage=PLANNER))
        decision("remeasure",
                 f"{what} at step {at}; every stage measures its blocks again (epoch {plan.epoch})",
                 role="planner", stage=body["stage"], ratio=body["ratio"], epoch=plan.epoch, iteration=at)

    def _send(self, plan: Plan, message: Message, vector: list[StageRecord]) -> None:
        self.current = plan
        self._outbox.send(make("plan", plan, epoch=plan.epoch, iteration=message.iteration, stage=PLANNER))
        decision("plan_sent", f"plan epoch {plan.epoch} sent: {plan.reason or 'no reason given'}",
                 role="planner",
                 epoch=plan.epoch, layers_per_stage=plan.counts(), reason=plan.reason,
                 predicted_step_s=plan.predicted_step_s, from_iteration=message.iteration,
                 stage_step_s=[r.step_s for r in vector], stage_compute_s=[r.compute_s for r in vector])

    # ---------------------------------------------------------------- heartbeat
    def _new_outbox(self, linger_ms: int) -> Outbox:
        return Outbox(self._context, self.connect, max_message_bytes=self._max_bytes, linger_ms=linger_ms,
                      curve=self.curve, server_key=self._server_key)

    def _beat(self) -> None:
        outbox = self._new_outbox(0)
        body: dict[str, Any] = {"pid": os.getpid(), "endpoint": self.inbox.endpoint}
        if self.curve is not None:
            body["key"] = self.curve.public.decode()
        hello = make("hello", body, stage=PLANNER)
        ping = make("ping", stage=PLANNER)
        try:
            while True:
                outbox.send(ping if self._attached.is_set() else hello)
                if self._stop.wait(self.heartbeat_s):
                    break
        finally:
            outbox.close(linger_ms=0)

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=2.0)
        self._outbox.close(linger_ms=1000)
        self.inbox.close()
        if self.guard is not None:
            self.guard.close()
        self._context.term()


# ---------------------------------------------------------------- command line
_HELP = "run the planner daemon against a training run's last stage"


def register(subparsers: Any) -> None:
    """Add ``vpipe planner`` to the CLI."""
    _add_arguments(subparsers.add_parser("planner", help=_HELP))


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m vpipe.control.daemon`` (the same arguments as ``vpipe planner``)."""
    parser = argparse.ArgumentParser(prog="vpipe planner", description=_HELP)
    _add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m vpipe.control.daemon``: the daemon without the full CLI, which imports torch.

    The last stage starts it this way so that it attaches in a fraction of a second.
    """
    args = build_parser().parse_args(argv)
    try:
        return cmd_planner(args)
    except ValueError as e:
        print(f"vpipe: error: {e}", file=sys.stderr)
        return 2


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", required=True, metavar="ENDPOINT",
                   help="the last stage's control endpoint, tcp://HOST:PORT (logged by the run, "
                        "and stored under vpipe/ctl/planner)")
    p.add_argument("--planner", default=NO_CHANGE_PLANNER, metavar="MODULE:FUNCTION",
                   help=f"planner(vector, current) -> Plan | None (default {NO_CHANGE_PLANNER}, "
                        f"which never changes the plan; vpipe.attach's default is {DEFAULT_PLANNER})")
    p.add_argument("--planner-config", default=None, metavar="JSON",
                   help="a JSON object handed to the planner's configured(config) before the first plan (for "
                        f"{DEFAULT_PLANNER}: OnlineConfig fields)")
    p.add_argument("--server-key", default=None, metavar="KEY|FILE",
                   help="with CURVE on: the last stage's public key, Z85 or a public key "
                        "file (logged by the run)")
    p.add_argument("--log-file", default=None, help="append JSON-lines logs (decisions included) here")
    p.add_argument("--heartbeat", type=float, default=0.5, help="seconds between pings (default 0.5)")
    p.add_argument("--idle-timeout", type=float, default=300.0,
                   help="exit after this many seconds without hearing from a run (default 300)")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_planner)


def _server_key(text: str | None) -> bytes | None:
    """``--server-key``: a Z85 key, or the file holding it."""
    if text is None:
        return None
    try:
        return check_z85_key(text, "--server-key")
    except ValueError:
        return read_public_file(text)


def cmd_planner(args: argparse.Namespace, argv: Any = None) -> int:
    check_endpoint(args.connect)
    if not (math.isfinite(args.heartbeat) and math.isfinite(args.idle_timeout)) or args.heartbeat <= 0 \
            or args.idle_timeout <= args.heartbeat:
        raise ValueError(f"--heartbeat ({args.heartbeat}) must be > 0 and below --idle-timeout "
                         f"({args.idle_timeout}), both finite")
    config = None if args.planner_config is None else parse_planner_config(args.planner_config)
    planner = load_planner(args.planner, config)
    server_key = _server_key(args.server_key)  # every argument checked before anything is installed
    settings = process_settings()  # the VPIPE_* variables, read once per process (CURVE, control host)
    curve = RunKeys(settings).curve()
    if args.log_file:
        vlog.configure(args.log_file, rank=None)
    else:
        vlog.log_to_stderr("vpipe planner: ")
    to_background()  # imports done and the planner loaded: from here on, plan below the ranks' priority
    daemon = PlannerDaemon(args.connect, planner, planner_name=args.planner, heartbeat_s=args.heartbeat,
                           stage_timeout_s=max(30.0, 20 * args.heartbeat), idle_timeout_s=args.idle_timeout,
                           parent_pid=args.parent_pid, server_key=server_key, curve=curve,
                           host=settings.control_host)
    return daemon.run()


if __name__ == "__main__":
    from vpipe.control.daemon import main as _main  # the importable module, not a second copy as __main__

    sys.exit(_main())
