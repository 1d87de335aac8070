"""A stage's agent: stats go down the pipeline to the planner, plans come back up.

This piggybacks on the pipeline's own order, as in vPipe: no all-gather, no barrier.
After each step, :meth:`StageAgent.after_step` (never blocking) takes this stage's record
of a sampled iteration, appends it to the vector of stages ``0..k-1`` that came from
upstream for the same iteration, and sends ``0..k`` downstream; the last stage hands
the full vector to the planner daemon. Plans travel the other way: a stage accepts a
plan whose epoch is newer than its own, passes it upstream, and returns it. Every stage
receives the whole plan (it is small, and a layer manager needs its neighbours' layers
to diff placements); its own part is ``plan.stages[stage_index]``. Older or equal epochs
are dropped with a log line.

Lag: in a flush pipeline stage k+1 finishes a step before stage k, so the vector for
iteration i reaches stage k+1 after stage k+1 has finished step i, and is forwarded at
its next ``after_step``: the planner sees iteration i roughly ``p-1`` steps later, and a
plan made from it reaches stage 0 up to ``p-1`` steps after that. Asynchronous schedules
may deliver in either order; records and vectors wait for each other (a bounded number
of iterations). :meth:`StageAgent.finish` drains the last sampled iterations at the end
of training, in pipeline order, so the planner sees every one of them.

Ranks are stages here (one stage per rank): stage k's neighbours are ranks k-1 and k+1.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from vpipe.control.channel import ControlPlane
from vpipe.control.messages import PLANNER, Message, make
from vpipe.control.planner_link import PlannerLink
from vpipe.log import decision
from vpipe.monitors.records import StageRecord
from vpipe.plan import MAX_EPOCH_STEP, Plan

log = logging.getLogger("vpipe.control")

__all__ = ["StageAgent", "AGENT_TYPES"]

# what the agent takes from the inbox
AGENT_TYPES = frozenset({"stats", "plan", "done", "hello", "ping", "bye", "alert"})



class StageAgent:
    """One rank's agent in the chain of ranks (``stage_index`` is the rank; see ``stage_ranks``).

    With one stage per rank, rank k runs stage k. Under a multi-stage schedule
    ``stage_ranks[v]`` is the rank of (virtual) stage ``v``; the chain still runs rank 0 ->
    last rank, each rank adding the records of its own stages, and the last rank puts the
    vector in stage order before the planner sees it.
    """

    def __init__(
        self,
        plane: ControlPlane,
        *,
        stage_index: int,
        num_stages: int,
        plan: Plan | None = None,
        planner: PlannerLink | None = None,
        keep: int = 16,
        stage_ranks: Sequence[int] | None = None,
    ) -> None:
        ranks = tuple(range(num_stages)) if stage_ranks is None else tuple(stage_ranks)
        if len(ranks) != num_stages:
            raise ValueError(f"{len(ranks)} stage ranks for {num_stages} stages")
        num_ranks = max(ranks) + 1
        if not 0 <= stage_index < num_ranks:
            raise ValueError(f"stage {stage_index} is outside 0..{num_ranks - 1}")
        is_last = stage_index == num_ranks - 1
        if planner is not None and not is_last:
            raise ValueError("only the last stage talks to the planner daemon")
        self.plane = plane
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.local_stages = [v for v, r in enumerate(ranks) if r == stage_index]
        # the stages whose records come from upstream, in the order the chain adds them
        self._upstream_stages = [v for rank in range(stage_index) for v, r in enumerate(ranks) if r == rank]
        self.planner = planner
        self.plan = plan  # the plan in force on this rank (the session tells of each commit)
        self.latest_received: Plan | None = None  # the newest plan that arrived here (kept apart: see epoch)
        self.keep = keep
        self.upstream = stage_index - 1 if stage_index > 0 else None
        self.downstream = None if is_last else stage_index + 1
        self.rejected: Counter = Counter()  # valid messages that made no sense here, by reason
        self.vectors_forwarded = 0
        self._own: dict[int, tuple[StageRecord, ...]] = {}
        self._from_upstream: dict[int, tuple[StageRecord, ...]] = {}
        self._upstream_done: int | None = None
        self._last_iteration = -1

    @property
    def newest(self) -> Plan | None:
        """The newest plan this rank knows: the one in force, or one that arrived since and is still to apply.
        ``welcome`` reports it (the planner numbers its next plan after it)."""
        received, committed = self.latest_received, self.plan
        if received is None or (committed is not None and committed.epoch >= received.epoch):
            return committed
        return received

    @property
    def epoch(self) -> int:
        """The newest epoch this rank knows: an arriving plan must be newer. Committing a plan older than
        one that arrived meanwhile (plans queue for their step boundary) never sets it back."""
        newest = self.newest
        return newest.epoch if newest is not None else 0

    def plan_changed(self, plan: Plan) -> None:
        """A plan took effect on this rank (the session tells): it is the plan in force."""
        self.plan = plan

    # ---------------------------------------------------------------- per step
    def after_step(self, iteration: int, record: StageRecord | Sequence[StageRecord] | None) -> list[Plan]:
        """Forward what is ready, return the plans that arrived; never waits.

        ``record`` is this rank's record of a sampled iteration (one per stage it runs, in
        stage order), or None.
        """
        self._last_iteration = max(self._last_iteration, iteration)
        records = (record,) if isinstance(record, StageRecord) else tuple(record or ())
        if records:
            self._own[records[0].iteration] = records
            self._trim(self._own, "own record")
        plans = self._handle_all(self.plane.poll(types=AGENT_TYPES))
        self._forward_ready()
        if self.planner is not None:
            self.planner.tick()
        return plans

    def finish(self, timeout_s: float = 60.0) -> list[Plan]:
        """End of training: wait for upstream's last stats (up to ``timeout_s``; 0: none, as a process that
        dies of an exception does: its upstream may wait on it, in the pipeline, before it sends them),
        forward them, tell downstream we are done."""
        plans: list[Plan] = []
        deadline = time.monotonic() + timeout_s
        while self.upstream is not None and self._upstream_done is None and timeout_s > 0:
            if time.monotonic() > deadline:
                log.warning("stage %d: stage %d did not finish its stats within %.0f s; sending what arrived",
                            self.stage_index, self.upstream, timeout_s)
                break
            plans += self._handle_all(self.plane.poll(timeout_ms=100, types=AGENT_TYPES))
            self._forward_ready()
        plans += self._handle_all(self.plane.poll(types=AGENT_TYPES))
        self._forward_ready()
        if self._own:
            log.info("stage %d: no upstream stats for iterations %s at the end; dropped",
                     self.stage_index, sorted(self._own))
        if self.downstream is not None:
            self.plane.send(self.downstream, make("done", self._last_iteration, epoch=self.epoch,
                                                  iteration=self._last_iteration, stage=self.stage_index))
        if self.planner is not None:
            # a daemon still starting up gets a moment to attach and take the backlog
            attach_by = min(deadline, time.monotonic() + 10.0)
            while self.planner.starting and time.monotonic() < attach_by:
                plans += self._handle_all(self.plane.poll(timeout_ms=100, types=AGENT_TYPES))
            self.planner.close()
        return plans

    def alert(self, iteration: int, stage: int, what: str, ratio: float) -> None:
        """This rank's pulse saw ``stage`` change: tell the planner (down the chain), never waiting."""
        self._pass_alert(make("alert", {"stage": stage, "what": what, "ratio": ratio}, epoch=self.epoch,
                              iteration=iteration, stage=self.stage_index))

    def _pass_alert(self, message: Message) -> None:
        if self.downstream is not None:
            self.plane.send(self.downstream, message)
        elif self.planner is not None:
            self.planner.send_alert(message)

    # ---------------------------------------------------------------- stats
    def _forward_ready(self) -> None:
        for iteration in sorted(self._own):
            if self.upstream is None:
                vector: tuple[StageRecord, ...] = self._own.pop(iteration)
            elif iteration in self._from_upstream:
                vector = self._from_upstream.pop(iteration) + self._own.pop(iteration)
            else:
                continue
            if self.downstream is None:
                vector = tuple(sorted(vector, key=lambda rec: rec.stage))  # stage order for the planner
            self._send_vector(iteration, vector)

    def _send_vector(self, iteration: int, vector: tuple[StageRecord, ...]) -> None:
        if self.downstream is not None:
            sent = self.plane.send(self.downstream, make("stats", vector, epoch=self.epoch,
                                                         iteration=iteration,
                                                         stage=self.stage_index))
        elif self.planner is not None:
            sent = self.planner.send_stats(vector, iteration, self.epoch)
        else:
            sent = False
        if sent:
            self.vectors_forwarded += 1
        else:
            self.rejected["vector_not_sent"] += 1
            log.debug("stage %d: stats of iteration %d not sent (no planner attached or peer queue full)",
                      self.stage_index, iteration)

    def _take_vector(self, message: Message) -> None:
        vector: tuple[StageRecord, ...] = message.body
        expected = self._upstream_stages
        problem = None
        if len(vector) != len(expected):
            problem = f"has {len(vector)} records, stage {self.stage_index} expects {len(expected)}"
        elif any(r.stage != s or r.iteration != message.iteration for s, r in zip(expected, vector)):
            problem = f"records are not stages {_stages(expected)} of iteration {message.iteration}"
        if problem:
            self._reject("bad_vector", f"stats vector from rank {message.src} {problem}")
            return
        self._from_upstream[message.iteration] = vector
        self._trim(self._from_upstream, "upstream vector")

    def _trim(self, pending: dict[int, Any], what: str) -> None:
        while len(pending) > self.keep:
            oldest = min(pending)
            del pending[oldest]
            log.info("stage %d: dropped the %s of iteration %d (no partner within %d sampled iterations)",
                     self.stage_index, what, oldest, self.keep)

    # ---------------------------------------------------------------- plans
    def _take_plan(self, plan: Plan, message: Message) -> Plan | None:
        if plan.epoch <= self.epoch:
            self._reject("stale_plan", f"plan epoch {plan.epoch} from {_who(message)} is not newer than "
                         f"the current epoch {self.epoch}; dropped")
            return None
        # one forged epoch 2**63-1 would make every real plan stale
        if plan.epoch > self.epoch + MAX_EPOCH_STEP:
            self._reject("bad_plan", f"plan epoch {plan.epoch} from {_who(message)} jumps more than "
                         f"{MAX_EPOCH_STEP} past the current epoch {self.epoch}; dropped")
            return None
        if plan.num_stages != self.num_stages:
            self._reject("bad_plan", f"plan epoch {plan.epoch} has {plan.num_stages} stages, "
                         f"the pipeline has {self.num_stages}; dropped")
            return None
        self.latest_received = plan
        if self.upstream is not None:
            self.plane.send(self.upstream, make("plan", plan, epoch=plan.epoch, iteration=message.iteration,
                                                stage=self.stage_index))
        decision("plan_received", f"stage {self.stage_index} received plan epoch {plan.epoch}",
                 stage=self.stage_index, epoch=plan.epoch, layers_per_stage=plan.counts(),
                 stage_layers=[lid for v in self.local_stages for lid in plan.stages[v]], reason=plan.reason,
                 from_iteration=message.iteration)
        return plan

    # ---------------------------------------------------------------- dispatch
    def _handle_all(self, messages: list[Message]) -> list[Plan]:
        plans = []
        for message in messages:
            plan = self._handle(message)
            if plan is not None:
                plans.append(plan)
        return plans

    def _handle(self, message: Message) -> Plan | None:
        kind, src = message.type, message.src
        if kind == "stats" and self.upstream is not None and src == self.upstream:
            self._take_vector(message)
        elif kind == "plan" and src == (PLANNER if self.downstream is None else self.downstream):
            return self._take_plan(message.body, message)
        elif kind == "alert" and self.upstream is not None and src == self.upstream:
            self._pass_alert(make("alert", message.body, epoch=message.epoch, iteration=message.iteration,
                                  stage=self.stage_index))
        elif kind == "done" and self.upstream is not None and src == self.upstream:
            self._upstream_done = message.body
        elif kind in ("hello", "ping", "bye") and self.planner is not None and src == PLANNER:
            self.planner.handle(message, self.newest)
        else:
            self._reject("unexpected", f"{kind!r} message from {_who(message)} makes no sense on stage "
                         f"{self.stage_index}; dropped")
        return None

    def _reject(self, reason: str, text: str) -> None:
        self.rejected[reason] += 1
        if self.rejected[reason] <= 100 or self.rejected[reason] % 1000 == 0:
            log.warning("stage %d: %s", self.stage_index, text)


def _stages(stages: Sequence[int]) -> str:
    if stages == list(range(len(stages))):
        return f"0..{len(stages) - 1}"
    return ", ".join(map(str, stages))


def _who(message: Message) -> str:
    return "the planner" if message.src == PLANNER else f"rank {message.src}"
