"""Stats down the pipeline, plans back up: stage agents, the planner link and the daemon in one process.

Every agent has its own real control plane (zmq sockets, endpoints in a real TCPStore);
the daemon runs its real loop on a thread. Steps are driven in a flush pipeline's order
(the last stage finishes a step first), which is what makes vectors arrive late.
"""

from __future__ import annotations

import datetime
import logging
import time

import pytest
import torch.distributed as dist

from support.control import LAYERS, Recorder, pump, start_daemon, wait_for
from support.monitors import stage_record
from vpipe.control.agent import StageAgent
from vpipe.control.channel import ControlPlane, Inbox, Outbox
from vpipe.control.daemon import PlannerDaemon, no_change
from vpipe.control.messages import PLANNER, make
from vpipe.control.planner_function import load_planner
from vpipe.control.planner_link import PlannerLink
from vpipe.plan import Plan


@pytest.fixture
def planes(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    made = [ControlPlane(store, rank, 3, lookup_timeout_s=5.0) for rank in range(3)]
    yield made
    for plane in made:
        plane.close(linger_ms=0)


class Decisions(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(dict(getattr(record, "vpipe_fields", {}), msg=record.getMessage()))

    def named(self, event: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == event]


@pytest.fixture
def decisions():
    handler = Decisions()
    logger = logging.getLogger("vpipe.decisions")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)










def test_stats_reach_the_planner_and_plans_reach_every_stage(planes, decisions):
    plan0 = Plan(epoch=0, stages=LAYERS)
    link = PlannerLink(planes[2], stage_index=2, num_stages=3, timeout_s=2.0, heartbeat_s=0.05)
    agents = [StageAgent(planes[k], stage_index=k, num_stages=3, plan=plan0, planner=link if k == 2 else None)
              for k in range(3)]
    recorder = Recorder()
    daemon, thread, result = start_daemon(planes[2].endpoint, recorder)
    plans: dict[int, list] = {0: [], 1: [], 2: []}
    assert wait_for(lambda: link.attached, step=lambda: agents[2].after_step(0, None))
    for it in range(12):
        pump(agents, it, sampled=it % 3 == 2, plans=plans)
    extra = iter(range(12, 1000))  # a loaded machine may need a few more steps for plans to climb
    assert wait_for(lambda: plans[0], step=lambda: pump(agents, next(extra), sampled=False, plans=plans))
    for agent in agents:  # end of training, in the order the stages finish their last step
        plans[agent.stage_index] += agent.finish(timeout_s=10)
    thread.join(timeout=10)
    assert result == [0], "the daemon should leave on the last stage's bye"

    got = [v[0].iteration for v in recorder.vectors]
    assert got == [2, 5, 8, 11]
    for vector in recorder.vectors:
        assert [r.stage for r in vector] == [0, 1, 2]
        assert len({r.iteration for r in vector}) == 1
        assert [tuple(r.layer_ids) for r in vector] == list(LAYERS)
    for stage, received in plans.items():
        assert received, f"stage {stage} received no plan"
        epochs = [p.epoch for p in received]
        assert epochs == sorted(set(epochs)), epochs
        assert all(p.reason.startswith("marker ") for p in received)
        assert agents[stage].latest_received == received[-1] and agents[stage].plan == plan0  # none committed
    # a plan reaches stage k only through stage k+1
    assert {p.epoch for p in plans[0]} <= {p.epoch for p in plans[1]} <= {p.epoch for p in plans[2]}
    assert len(decisions.named("plan_received")) == sum(len(p) for p in plans.values())
    assert decisions.named("planner_attached") and decisions.named("planner_ready")


def test_stale_and_misshapen_plans_are_dropped_with_a_log_line(planes, caplog):
    plan5 = Plan(epoch=5, stages=LAYERS)
    a0 = StageAgent(planes[0], stage_index=0, num_stages=3, plan=plan5)
    a1 = StageAgent(planes[1], stage_index=1, num_stages=3, plan=plan5)
    with caplog.at_level(logging.WARNING, logger="vpipe.control"):
        planes[2].send(1, make("plan", Plan(epoch=5, stages=LAYERS), epoch=5, stage=2))
        planes[2].send(1, make("plan", Plan(epoch=9, stages=((0, 1, 2), (3, 4, 5))), epoch=9, stage=2))
        planes[2].send(1, make("plan", Plan(epoch=6, stages=LAYERS, reason="newer"), epoch=6, stage=2))
        accepted: list = []
        assert wait_for(lambda: sum(a1.rejected.values()) == 2 and accepted,
                        step=lambda: accepted.extend(a1.after_step(0, None)))  # all three read
    assert [p.epoch for p in accepted] == [6]
    assert a1.rejected == {"stale_plan": 1, "bad_plan": 1}
    text = caplog.text
    assert "plan epoch 5 from rank 2 is not newer than the current epoch 5" in text
    assert "has 2 stages, the pipeline has 3" in text
    upstream: list = []
    assert wait_for(lambda: upstream, step=lambda: upstream.extend(a0.after_step(0, None)))
    assert upstream[0].reason == "newer"


def test_committing_an_older_plan_never_sets_the_received_epoch_back(planes):
    # plans 1 and 2 arrive before the step boundary that applies 1:
    # committing 1 must not make 2 look new again
    plan0, plan1, plan2 = (Plan(epoch=e, stages=LAYERS, reason=f"epoch {e}") for e in range(3))
    a1 = StageAgent(planes[1], stage_index=1, num_stages=3, plan=plan0)
    for plan in (plan1, plan2):
        planes[2].send(1, make("plan", plan, epoch=plan.epoch, stage=2))
    accepted: list = []
    assert wait_for(lambda: len(accepted) == 2, step=lambda: accepted.extend(a1.after_step(0, None)))
    a1.plan_changed(plan1)
    assert a1.plan == plan1 and a1.latest_received == plan2 and a1.epoch == 2
    planes[2].send(1, make("plan", plan2, epoch=2, stage=2))  # a repeat of the newest plan is still stale
    assert wait_for(lambda: a1.rejected["stale_plan"] == 1,
                    step=lambda: accepted.extend(a1.after_step(1, None)))
    assert [p.epoch for p in accepted] == [1, 2]


def test_messages_that_make_no_sense_here_are_dropped(planes):
    a1 = StageAgent(planes[1], stage_index=1, num_stages=3)
    # stats from downstream
    planes[2].send(1, make("stats", (stage_record(0, 3, (0, 1)),), iteration=3, stage=2))
    planes[0].send(1, make("plan", Plan(epoch=1, stages=LAYERS), stage=0))  # plans never come from upstream
    planes[0].send(1, make("stats", (stage_record(0, 3, (0, 1)), stage_record(1, 3, (2, 3))), iteration=3,
                           stage=0))  # a vector of the wrong length
    # iteration mismatch
    planes[0].send(1, make("stats", (stage_record(0, 4, (0, 1)),), iteration=3, stage=0))
    # not the last stage
    planes[0].send(1, make("hello", {"pid": 1, "endpoint": "tcp://127.0.0.1:1"}, stage=PLANNER))
    assert wait_for(lambda: sum(a1.rejected.values()) >= 5, step=lambda: a1.after_step(0, None))
    assert a1.rejected == {"unexpected": 3, "bad_vector": 2}
    assert a1.plan is None


def test_lost_planner_is_reported_and_a_new_one_attaches_and_gets_the_backlog(planes, decisions):
    plan0 = Plan(epoch=0, stages=((0, 1),))
    link = PlannerLink(planes[0], stage_index=0, num_stages=1, timeout_s=0.5, heartbeat_s=0.05)
    agent = StageAgent(planes[0], stage_index=0, num_stages=1, plan=plan0, planner=link)
    first = fake_daemon(planes[0].endpoint)
    assert wait_for(lambda: link.attached, step=lambda: agent.after_step(0, None))
    assert first.welcome().body["plan"] == plan0
    agent.after_step(1, stage_record(0, 1, (0, 1)))
    assert first.next("stats").iteration == 1
    first.close()  # dies without a word
    assert wait_for(lambda: not link.attached, step=lambda: agent.after_step(2, None))
    lost = decisions.named("planner_lost")
    assert len(lost) == 1 and "no message from the daemon" in lost[0]["reason"]
    for it in (3, 5):  # stats while nobody listens wait in a bounded backlog
        agent.after_step(it, stage_record(0, it, (0, 1)))
    second = fake_daemon(planes[0].endpoint)
    assert wait_for(lambda: link.attached, step=lambda: agent.after_step(6, None))
    second.welcome()
    assert [second.next("stats").iteration for _ in range(2)] == [3, 5]
    attached = decisions.named("planner_attached")
    assert len(attached) == 2 and attached[1]["replaced"] is None
    second.close()


class fake_daemon:
    """The wire side of a daemon, driven by hand: says hello once, reads what it is sent."""

    def __init__(self, connect: str) -> None:
        import zmq

        self.context = zmq.Context()
        self.inbox = Inbox(self.context, "127.0.0.1", "127.0.0.1", name="fake daemon")
        self.outbox = Outbox(self.context, connect, linger_ms=0)
        self.outbox.send(make("hello", {"pid": 4242, "endpoint": self.inbox.endpoint}))
        self.seen: list = []

    def next(self, kind: str, timeout_s: float = 5.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i, message in enumerate(self.seen):
                if message.type == kind:
                    return self.seen.pop(i)
            self.seen += self.inbox.receive(timeout_ms=50)
            self.outbox.send(make("ping"))
        raise AssertionError(f"no {kind!r} message arrived")

    def welcome(self):
        return self.next("welcome")

    def close(self) -> None:
        self.outbox.close(linger_ms=0)
        self.inbox.close()
        self.context.term()


# ---------------------------------------------------------------- the daemon
def one_stage(plane, decisions_timeout=2.0):
    link = PlannerLink(plane, stage_index=0, num_stages=1, timeout_s=decisions_timeout, heartbeat_s=0.05)
    return StageAgent(plane, stage_index=0, num_stages=1, plan=Plan(epoch=0, stages=((0, 1),)),
                      planner=link), link


def test_daemon_survives_a_failing_planner_and_rejects_unusable_plans(planes, decisions):
    agent, link = one_stage(planes[0])
    answers = iter([RuntimeError("boom"), "not a plan", Plan(epoch=0, stages=((0, 1),)),
                    Plan(epoch=1, stages=((0,), (1,))), Plan(epoch=1, stages=((0, 1),), reason="good")])

    def planner(vector, current):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    daemon, thread, result = start_daemon(planes[0].endpoint, planner)
    assert wait_for(lambda: link.attached, step=lambda: agent.after_step(0, None))
    plans: list = []
    for it in range(1, 6):
        agent.after_step(it, stage_record(0, it, (0, 1)))
    assert wait_for(lambda: plans, step=lambda: plans.extend(agent.after_step(9, None)))
    assert [p.reason for p in plans] == ["good"]
    errors = [e["error"] for e in decisions.named("planner_error")]
    assert errors[0] == "RuntimeError: boom"
    assert "expected a Plan or None, got str" in errors[1]
    assert "epoch 0 is not newer than the current epoch 0" in errors[2]
    assert "2 stages for a 1-stage pipeline" in errors[3]
    assert daemon.vectors == 5 and thread.is_alive()
    agent.finish(timeout_s=5)
    thread.join(timeout=10)
    assert result == [0]


def test_daemon_binds_only_loopback_when_the_stage_is_on_loopback(planes):
    daemon = PlannerDaemon(planes[0].endpoint, no_change)
    try:
        assert daemon.inbox.endpoint.startswith("tcp://127.0.0.1:")
    finally:
        daemon.close()


def test_load_planner_names_what_is_wrong():
    assert load_planner("vpipe.control.daemon:no_change") is no_change
    with pytest.raises(ValueError, match="module:function"):
        load_planner("vpipe.control.daemon")
    with pytest.raises(ValueError, match="cannot import planner module 'no_such_module_x'"):
        load_planner("no_such_module_x:f")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        load_planner("vpipe.control.daemon:missing")


def test_daemon_plans_the_stats_that_arrive_together_with_bye(planes):
    recorder = Recorder()
    daemon = PlannerDaemon(planes[0].endpoint, recorder, heartbeat_s=0.05)
    outbox = Outbox(daemon._context, daemon.inbox.endpoint, linger_ms=0)
    try:
        outbox.send(make("welcome", {"plan": Plan(epoch=0, stages=((0, 1),)), "num_stages": 1}))
        outbox.send(make("stats", (stage_record(0, 4, (0, 1)),), iteration=4, stage=0))
        outbox.send(make("bye", "training finished", stage=0))
        time.sleep(0.3)  # all three wait in the inbox: the daemon reads them in one batch
    finally:
        outbox.close(linger_ms=0)
    assert daemon.run() == 0
    assert [v[0].iteration for v in recorder.vectors] == [4]


def test_a_plan_epoch_that_jumps_far_ahead_is_dropped_and_real_plans_still_come_through(planes, caplog):
    a1 = StageAgent(planes[1], stage_index=1, num_stages=3, plan=Plan(epoch=5, stages=LAYERS))
    with caplog.at_level(logging.WARNING, logger="vpipe.control"):
        planes[2].send(1, make("plan", Plan(epoch=2**63 - 1, stages=LAYERS), epoch=5, stage=2))  # forged
        planes[2].send(1, make("plan", Plan(epoch=6, stages=LAYERS, reason="real"), epoch=6, stage=2))
        accepted: list = []
        assert wait_for(lambda: accepted, step=lambda: accepted.extend(a1.after_step(0, None)))
    assert [p.reason for p in accepted] == ["real"] and a1.rejected["bad_plan"] == 1
    assert f"plan epoch {2**63 - 1} from rank 2 jumps more than 1000 past the current epoch 5" in caplog.text
