"""The planner the daemon runs on live statistics: stats vectors -> layer graph -> SRP proposal.

A daemon started with ``vpipe.planner.online:srp`` calls the :class:`OnlinePlanner` that
entry made it with each full stats vector (one record per stage) and the plan the pipeline
runs. Per-layer costs are smoothed over the recent
samples (an exponential average, so one noisy iteration cannot trigger a move). Each stage's
device may be slower than the others (:mod:`vpipe.planner.speeds`): its factor is fitted from
blocks of one kind measured on different stages, kept only when every recent sample agrees,
and every time is divided by its stage's factor before interchangeable blocks (same kind,
same saved and sent bytes, training or frozen alike) are pooled, so noise is not imbalance
and a slower device is. The time the end stages spend outside their blocks (embeddings,
heads) is the least of its last few samples, since a busy core only ever adds time. When a
rank's pulse saw its stage change (:meth:`OnlinePlanner.alerted`), the next samples replace
the smoothed costs and the factors are learnt again. All that is turned
into a :class:`~vpipe.graph.LayerGraph` in the pipeline's execution order, and handed to
:class:`~vpipe.planner.proposals.SRPPlanner`, whose hysteresis, cooldown and gain-versus-migration
test decide whether anything changes (a move costs what the ranks measured the last one to take,
per byte, when that is more than the link's estimate); a plan for speed goes only once the next sample
confirms it (:mod:`vpipe.planner.online_confirmation`). Every imbalance it sees and every plan it makes is a
decision in the run's log.

Configuration is data: ``vpipe.attach`` describes the pipeline (schedule, micro-batches,
budget, the user's ``planner_options``) as :class:`OnlineConfig` fields, and the daemon it
starts receives them as ``--planner-config JSON`` and hands them to :meth:`srp.configured
<SRPEntry.configured>`, which checks them and makes the daemon its own :class:`OnlinePlanner`
(a daemon started with no ``--planner-config`` gets one with the defaults, from
:meth:`srp.for_daemon <SRPEntry.for_daemon>`). The planner's state (smoothed costs, pending
proposals) belongs to the daemon that made it, never to this module: two daemons in one
process plan apart.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from vpipe.graph import LayerGraph, LayerNode
from vpipe.log import decision
from vpipe.monitors.records import StageRecord
from vpipe.plan import Plan, Policy
from vpipe.planner.cost_model import Hardware, stage_time
from vpipe.planner.online_config import OnlineConfig, as_tuple
from vpipe.planner.online_confirmation import ProposalConfirmation, known_change
from vpipe.planner.online_memory import kept_shares, shared_budgets
from vpipe.planner.proposals import SRPPlanner, placeable_partitions
from vpipe.planner.speeds import (
    SpeedSamples,
    describe_speeds,
    fit_stage_speeds,
    interchangeable,
    pooled_costs,
    steady_speeds,
)

log = logging.getLogger("vpipe.planner.online")

__all__ = ["OnlineConfig", "OnlinePlanner", "SRPEntry", "srp"]

_UNCHANGED = 0.01  # per-layer cost moves under this (relative) since the last search: nothing new to plan
# the stages' time outside their blocks is one number per end, with no
# interchangeable blocks to pool it with: the least of its last samples, since a busy
# core only ever adds time (a preempted sample is not a heavier head)
_OUTSIDE_SAMPLES = 3
# samples after attach that say nothing of the stages' speeds (start-up work runs beside them)
_WARM_SAMPLES = 1
# a stage is as slow as it was in all of this many samples (noise hits a sample, a device all)
_SPEED_SAMPLES = 3
# ... and in this many when less than speeds.STRONG slower (shared cores look like that)
_WEAK_SPEED_SAMPLES = 6
# a pulse names a change after several steps at the new level: samples
# of the last steps before its alert saw it
_ALERT_LAG = 2
# samples for which a moved block's time before its move still says how fast its old stage was
_MOVED_SAMPLES = 10


class OnlinePlanner:
    """Smooths per-layer statistics and asks the SRP planner for proposals."""

    def __init__(self, config: OnlineConfig | None = None) -> None:
        self.config = config or OnlineConfig()
        self._hardware = Hardware(copy_bytes_per_s=self.config.copy_bytes_per_s,
                                  net_bytes_per_s=self.config.net_bytes_per_s)
        self._costs: dict[int, list[float]] = {}  # layer id -> [fwd_s, bwd_s] per micro-batch, smoothed
        # the first and last stages' modules outside their blocks: [fwd_s, bwd_s] per micro-batch, param bytes
        self._outside: dict[str, list[float]] = {}
        self._outside_recent: dict[str, deque[list[float]]] = {}
        self._outside_bytes: dict[str, int] = {}
        self._samples = 0
        self._epoch: int | None = None  # of the last vector observed
        # after an alert: the first sample of a newer epoch replaces the costs
        self._fresh_after: int | None = None
        self._stage_of: dict[int, int] = {}  # where each block was measured last
        # blocks that moved lately: where they ran before and what they took there (their device's evidence)
        self._moved: dict[int, tuple[int, float, int]] = {}
        self.speeds: tuple[float, ...] | None = None  # each stage's time factor, as last fitted
        # placements moved away from since the last alert
        self._left: set[tuple[tuple[int, ...], ...]] = set()
        self._speed_samples = SpeedSamples(_WEAK_SPEED_SAMPLES)  # the last samples' factors
        self._alerted = False  # since the last alert, fewer samples name a slower stage
        self._froze = False  # a pulse reported blocks frozen since the last plan went
        self._planned_speeds: tuple[float, ...] | None = None  # the stages' factors when the last plan went
        # epoch -> bytes, of the moves sent whose cost no sample has told yet
        self._moving: dict[int, int] = {}
        self._reported_speeds: tuple[float, ...] | None = None
        self._srp: Any = None
        self._srp_key: tuple[Any, ...] | None = None
        self._last_search: tuple[Plan, list[tuple[float, int]], Any] | None = None
        self._confirmation = ProposalConfirmation(self.config)  # plans for speed wait for a second search

    def __call__(self, vector: list[StageRecord], current: Plan | None) -> Plan | None:
        if current is None or len(vector) != current.num_stages:
            return None
        if any(rec.epoch < current.epoch for rec in vector):
            return None  # measured before the newest plan took effect: judge that plan on its own stats first
        records = {lr.layer_id: lr for rec in vector for lr in rec.layers}
        edited = vector[0].epoch > current.epoch or set(records) != set(current.layer_ids)
        if edited:
            current = self._observed_placement(vector, current)  # layers were added or removed meanwhile
            if current is None:
                return None
        self._observe(vector, current)
        if self._samples < self.config.warmup_samples:
            return None
        graph = self._graph(current, records, kept_shares(vector))
        # on a CPU a swap is a copy the step waits for: it costs its time, however much compute is beside it
        overlap = not all(rec.device.startswith("cpu") for rec in vector)
        if overlap != self._hardware.copies_overlap:
            self._hardware = replace(self._hardware, copies_overlap=overlap)
        self._report_imbalance(vector, current, graph)
        planner = self._planner(graph, records, current)
        if self.config.stage_ranks is not None and self.config.memory_budget is not None:
            shared = shared_budgets(self.config.memory_budget, planner.setup, graph, current, vector,
                                     self.config.in_flight_together)
            planner.budgets = planner.setup.budgets(shared)
        unchanged = self._unchanged_since_last_search(graph, current)
        if planner.in_cooldown(vector[-1].iteration) or (unchanged and not self._confirmation.waiting):
            return None  # too soon after a plan, or the same numbers as last time: the daemon idles
        started = time.perf_counter()
        last_proposal = planner.last_proposal_step
        placeable = placeable_partitions(vector, current)
        proposal = planner.propose(graph, current, vector[-1].iteration, placeable=placeable)
        if proposal is not None and not edited and proposal.plan.stages in self._left:
            # back to a placement this run left, with no change seen since (no alert): what made it worse then
            # still holds, and moving back and forth costs every move twice. Speeds learnt since do not count:
            # on shared cores a stage's factor measured on one block swings with the load (a 2x rank went 4,4
            # -> 7,1 -> 4,4 -> 7,1 in CI when they did); a recovery is the pulse's to report
            log.info("planner: iteration %d would move back to %s, left earlier with no "
                     "change seen since; staying",
                     vector[-1].iteration, proposal.plan.counts())
            planner.last_proposal_step = last_proposal
            proposal = None
        if proposal is None:
            self._confirmation.drop()  # nothing to gain now: a later proposal starts its count again
            return None
        at_once = edited or known_change(self._froze, self.speeds, self._planned_speeds)
        proposal = self._confirmation.confirmed(
            proposal, vector[-1].iteration, at_once=at_once,
            reprice=lambda earlier: planner.reprice(graph, current, earlier, placeable))
        seconds = time.perf_counter() - started
        if proposal is None:
            planner.last_proposal_step = last_proposal  # nothing was sent: no cooldown starts
            return None
        speeds = self.speeds if self.speeds is not None and len(self.speeds) == current.num_stages else None
        plan = replace(proposal.plan, stage_speeds=speeds)
        self._froze, self._planned_speeds = False, self.speeds
        if plan.stages != current.stages:
            self._left.add(current.stages)
            self._moving[plan.epoch] = proposal.migration_bytes
        changed = {lid: pol.value for lid, pol in plan.policies.items() if pol != current.policy(lid)}
        slow = f" ({describe_speeds(speeds)})" if speeds is not None and any(f > 1.0 for f in speeds) else ""
        decision(
            "plan", f"epoch {plan.epoch}: {proposal.reason}{slow}",
            epoch=plan.epoch, iteration=vector[-1].iteration, old_stages=[list(s) for s in current.stages],
            new_stages=[list(s) for s in plan.stages], policies_changed=changed,
            predicted_step_s_before=proposal.before_step_s, predicted_step_s_after=proposal.after_step_s,
            predicted_stage_s_before=list(proposal.stage_s_before),
            predicted_stage_s_after=list(proposal.stage_s_after),
            expected_gain=proposal.gain, migration_bytes=proposal.migration_bytes,
                 migration_s=proposal.migration_s,
            stage_speeds=None if speeds is None else list(speeds), planner_s=seconds,
        )
        return plan

    def alerted(self, stage: int, ratio: float, iteration: int) -> None:
        """A rank's pulse saw ``stage`` change at ``iteration`` (the daemon has every rank
        measure again): what was measured before (speed samples, a proposal made on them, where
        moved blocks ran) says nothing of the devices now, and a placement left may be right
        again. Samples of the last ``_ALERT_LAG`` steps saw the change and are kept: a
        neighbour's pulse may fire a few steps after the change it follows."""
        since = iteration - _ALERT_LAG
        self._confirmation.drop_before(since)
        self._moved.clear()
        self._left.clear()
        self._speed_samples.drop_before(since)
        self._alerted = True
        self._froze = self._froze or ratio == 1.0  # a pulse reports a freeze with ratio 1.0
        self._fresh_after = self._epoch if self._epoch is not None else -1

    def _unchanged_since_last_search(self, graph: Any, current: Plan) -> bool:
        """Whether the last search saw this plan and costs within
        ``_UNCHANGED`` of these (then it found nothing)."""
        costs = [(n.fwd_s + n.bwd_s, n.act_bytes) for n in graph.nodes]
        last, self._last_search = self._last_search, (current, costs, self.speeds)
        if last is None or last[0] != current or len(last[1]) != len(costs) or last[2] != self.speeds:
            return False
        return all(abs(a - b) <= _UNCHANGED * max(b, 1e-12) and x == y
                   for (a, x), (b, y) in zip(costs, last[1]))

    @staticmethod
    def _observed_placement(vector: list[StageRecord], current: Plan) -> Plan | None:
        """The placement the stages report (after layer edits the planner did not make)."""
        if len({rec.epoch for rec in vector}) != 1:
            return None  # an edit happened between the stages' records: wait for a clean vector
        stages = tuple(tuple(rec.layer_ids) for rec in vector)
        if any(not layers for layers in stages):
            return None
        policies = {lid: current.policy(lid) for layers in stages for lid in layers
                    if lid in current.layer_ids}
        return Plan(epoch=vector[0].epoch, stages=stages, policies=policies, reason="observed")

    # ---------------------------------------------------------------- statistics
    def _observe(self, vector: list[StageRecord], current: Plan) -> None:
        # the first sample after a rank saw its stage change (a device slowed down or recovered, blocks froze)
        # replaces the smoothed costs: waiting for an average to catch up is what made moves late; the
        # confirmation of proposals keeps one noisy sample from moving anything
        fresh = self._fresh_after is not None and vector[0].epoch > self._fresh_after
        a = 1.0 if fresh else self.config.smoothing
        if fresh:
            self._fresh_after = None
        self._epoch = vector[0].epoch
        for lid in list(self._moved):
            stage, cost, left = self._moved[lid]
            self._moved.update({lid: (stage, cost, left - 1)} if left > 1 else {})
            if left <= 1:
                del self._moved[lid]
        for rec in vector:
            for lr in rec.layers:
                fwd = lr.fwd_per_call_s
                bwd = lr.bwd_per_call_s
                if current.policy(lr.layer_id) is Policy.RECOMPUTE:
                    bwd = max(0.0, bwd - fwd)  # the backward we measured re-ran the forward
                old = self._costs.get(lr.layer_id)
                was = self._stage_of.get(lr.layer_id)
                if old is not None and was is not None and was != rec.stage:
                    self._moved[lr.layer_id] = (was, old[0] + old[1], _MOVED_SAMPLES)
                    old = None
                self._stage_of[lr.layer_id] = rec.stage
                self._costs[lr.layer_id] = [fwd, bwd] if old is None else [
                    (1 - a) * old[0] + a * fwd, (1 - a) * old[1] + a * bwd]
        for end, rec in (("first", vector[0]), ("last", vector[-1])):
            calls = rec.outside_calls
            recent = self._outside_recent.setdefault(end, deque(maxlen=_OUTSIDE_SAMPLES))
            recent.append([rec.outside_fwd_s / calls, rec.outside_bwd_s / calls] if calls else [0.0, 0.0])
            self._outside[end] = [min(s[i] for s in recent) for i in (0, 1)]
            self._outside_bytes[end] = rec.outside_param_bytes
        # the first samples run beside start-up work (the daemon, allocators)
        if self._samples >= _WARM_SAMPLES:
            self._speed_samples.add(vector[-1].iteration, self._sample_speeds(vector))
        self._note_move_cost(vector)
        self._samples += 1

    def _graph(self, current: Plan, records: dict[int, Any],
               shares: dict[int, float] | None = None) -> LayerGraph:
        order = current.layer_ids
        # the first layer is always on the first stage and the last on the last: they carry those stages'
        # embeddings and heads, which never move (a contiguous partition cannot separate them)
        stage_of = {lid: k for k, layers in enumerate(current.stages) for lid in layers}
        speeds = self._fit_speeds(current.num_stages)
        # every time in the graph is the reference device's: a stage's measured times over its factor
        extra = {lid: [0.0, 0.0, 0] for lid in order}
        for end, lid in (("first", order[0]), ("last", order[-1])):
            fwd, bwd = (t / speeds[stage_of[lid]] for t in self._outside.get(end, [0.0, 0.0]))
            extra[lid] = [extra[lid][0] + fwd, extra[lid][1] + bwd,
                          extra[lid][2] + self._outside_bytes.get(end, 0)]
        normal = {lid: [t / speeds[stage_of[lid]] for t in self._costs[lid]] for lid in order}
        costs = pooled_costs(order, records, normal)
        nodes = [
            LayerNode(id=lid, name=str(lid), fwd_s=costs[lid][0] + extra[lid][0],
                      bwd_s=costs[lid][1] + extra[lid][1],
                      act_bytes=int(round(records[lid].activation_bytes * (shares or {}).get(lid, 1.0))),
                      param_bytes=records[lid].param_bytes + int(extra[lid][2]), order=i)
            for i, lid in enumerate(order)
        ]
        edges = [(a, b, records[a].output_bytes) for a, b in zip(order, order[1:])]
        return LayerGraph(name="live", nodes=nodes, edges=edges)

    def _note_move_cost(self, vector: list[StageRecord]) -> None:
        """What the last move this planner sent cost the ranks (the slowest), per byte:
        later moves are weighed against their gain with it."""
        moved = self._moving.pop(vector[0].epoch, None)
        seconds = max(rec.move_s for rec in vector)
        if moved and seconds > 0 and self._srp is not None:
            self._srp.measured_s_per_byte = seconds / moved
            log.info("planner: moving %.1f MB took %.1f ms", moved / 1e6, seconds * 1e3)

    def _sample_speeds(self, vector: list[StageRecord]) -> tuple[float, ...]:
        """This sample's stage factors: interchangeable blocks on different stages,
        and blocks that moved (their time now against their smoothed time where they
        ran before), fitted by :mod:`vpipe.planner.speeds`."""
        stage_of = {lr.layer_id: rec.stage for rec in vector for lr in rec.layers}
        now = {lr.layer_id: lr.fwd_per_call_s + lr.bwd_per_call_s for rec in vector for lr in rec.layers}
        observations = [(interchangeable(lr) or ("block", lr.layer_id), rec.stage, now[lr.layer_id])
                        for rec in vector for lr in rec.layers]
        for lid, (stage, cost, _) in self._moved.items():
            if lid in stage_of:
                observations += [(("moved", lid), stage, cost), (("moved", lid), stage_of[lid], now[lid])]
        return fit_stage_speeds(observations, len(vector), dead_band=0.0)

    def _fit_speeds(self, num_stages: int) -> tuple[float, ...]:
        """Each stage's time factor: the least of the last samples' (a busy core slows one stage in some
        samples, a slower device in every one), reported in the run's log when it changes."""
        samples = self._speed_samples.of(num_stages)
        # after a rank saw its stage change, two samples that agree suffice: the change is known, not guessed
        speeds = steady_speeds(samples, num_stages, needed=2 if self._alerted else _SPEED_SAMPLES,
                               weak_needed=_WEAK_SPEED_SAMPLES)
        if len(samples) >= _SPEED_SAMPLES:
            self._alerted = False
        self.speeds = speeds
        last = self._reported_speeds
        if last is None and any(f > 1.0 for f in speeds) or last is not None and (
                len(last) != len(speeds) or any(abs(a / b - 1.0) > 0.25 for a, b in zip(speeds, last))):
            self._reported_speeds = speeds
            decision("stage_speed", describe_speeds(speeds), role="planner", stage_speeds=list(speeds),
                     epoch=self._epoch)
        return speeds

    def _planner(self, graph: Any, records: dict[int, Any], current: Plan) -> Any:
        params = sum(r.param_bytes for r in records.values())
        state = sum(r.optimizer_bytes for r in records.values())
        # gradients (one copy of the parameters) and optimizer state, relative to the parameters
        factor = round(1.0 + state / params, 2) if params else 2.0
        uneven = self.speeds if self.speeds is not None and any(f != 1.0 for f in self.speeds) else None
        key = (current.num_stages, factor, self.config.allow_moves, self._hardware.copies_overlap, uneven)
        if self._srp is None or self._srp_key != key:
            hardware = replace(self._hardware, optimizer_factor=factor)
            last = self._srp.last_proposal_step if self._srp is not None else None
            rate = self._srp.measured_s_per_byte if self._srp is not None else None
            self._srp = SRPPlanner(current.num_stages, self.config.schedule, self.config.micro_batches,
                                   self.config.memory_budget, hardware,
                                   horizon_steps=self.config.horizon_steps,
                                   min_gain=self.config.min_gain, cooldown_steps=self.config.cooldown_steps,
                                   allow_moves=self.config.allow_moves,
                                   in_flight_counts=as_tuple(self.config.in_flight),
                                   stage_ranks=as_tuple(self.config.stage_ranks), stage_speeds=uneven)
            self._srp.last_proposal_step, self._srp.measured_s_per_byte = last, rate
            self._srp_key = key
        return self._srp

    def _report_imbalance(self, vector: list[StageRecord], current: Plan, graph: Any) -> None:
        speeds = self.speeds or (1.0,) * current.num_stages
        times = [speeds[k] * stage_time(graph, list(layers), {lid: current.policy(lid) for lid in layers},
                                        self._hardware) for k, layers in enumerate(current.stages)]
        mean = sum(times) / len(times)
        if mean > 0 and max(times) / mean - 1.0 > self.config.imbalance_threshold:
            decision(
                "imbalance",
                f"slowest stage {times.index(max(times))} is {max(times) / mean - 1.0:.0%} over the mean",
                iteration=vector[-1].iteration,
                epoch=current.epoch,
                stage_times_s=times,
                layers_per_stage=current.counts(),
            )


class SRPEntry:
    """The daemon's planner function ``vpipe.planner.online:srp``: it
    makes each daemon an :class:`OnlinePlanner` of its own.

    The daemon hands ``--planner-config`` to :meth:`configured`, which returns the planner made with
    it; without configuration it asks :meth:`for_daemon` for one with :class:`OnlineConfig`'s defaults.
    The entry holds no planner (a planner remembers samples: one shared by the module would mix two
    daemons' runs), so it does not plan when called itself.
    """

    def __call__(self, vector: list[StageRecord], current: Plan | None) -> Plan | None:
        raise TypeError("vpipe.planner.online:srp makes planners, one per daemon: plan with "
                        "srp.for_daemon() or srp.configured(config)")

    @staticmethod
    def for_daemon() -> OnlinePlanner:
        """A daemon's own online planner, with :class:`OnlineConfig`'s defaults."""
        return OnlinePlanner()

    @staticmethod
    def configured(config: Mapping[str, Any]) -> OnlinePlanner:
        """The online planner with ``config``'s :class:`OnlineConfig` fields (checked here)."""
        return OnlinePlanner(OnlineConfig.from_mapping(config))


srp = SRPEntry()
