"""The one owner of the plan in force: a plan is checked once and committed once, and
the parts that keep a copy learn it from the owner, in order; stale plans, plans for
other layers and plans that do not fit change nothing."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from support.migration import TWO, Block, Hub, Rank, on_every_rank
from vpipe.checkpoint import VERSION
from vpipe.plan import Plan, Policy
from vpipe.rank.applying import PlanApplier
from vpipe.rank.parts import RankParts
from vpipe.rank.plan_in_force import PlanInForce, StagePolicies
from vpipe.rank.state import restore_vpipe_state, vpipe_state


class Told:
    """A listener that writes down what it was told, in one list shared by every listener of a test."""

    def __init__(self, name: str, log: list[tuple[str, Plan, str]]) -> None:
        self.name, self.log = name, log

    def plan_changed(self, plan: Plan, cause: str) -> None:
        self.log.append((self.name, plan, cause))


def test_a_commit_assigns_the_plan_and_tells_every_listener_once_in_order():
    log: list[tuple[str, Plan, str]] = []
    initial = Plan(epoch=0, stages=((0, 1), (2,)))
    owner = PlanInForce(initial, [Told("layers", log), Told("policies", log), Told("session", log)])
    assert owner.plan is initial and owner.epoch == 0 and log == []  # construction tells nobody
    plan = Plan(epoch=3, stages=((0,), (1, 2)), policies={1: Policy.SWAP})
    owner.commit(plan, "applied")
    assert owner.plan is plan and owner.epoch == 3
    assert log == [("layers", plan, "applied"), ("policies", plan, "applied"), ("session", plan, "applied")]


def test_the_placement_is_the_plan_in_force_and_a_streamed_round_records_where_it_took_the_layers():
    log: list[tuple[str, Plan, str]] = []
    plan = Plan(epoch=2, stages=((0, 1, 2), (3,)), policies={3: Policy.SWAP}, reason="two hops")
    owner = PlanInForce(plan, [Told("session", log)])
    assert owner.placement == ((0, 1, 2), (3,)) and owner.order == [0, 1, 2, 3]
    owner.reached([[0, 1], [2, 3]])  # the next round of a streamed plan's hops
    assert owner.placement == ((0, 1), (2, 3)) and owner.plan.stages == ((0, 1), (2, 3))
    assert (
        owner.plan.epoch == 2 and owner.plan.policies == {3: Policy.SWAP} and owner.plan.reason == "two hops"
    )
    assert log == []  # the same plan: its listeners heard of it when it was committed


# ---------------------------------------------------------------------- applying plans on one rank
def _applier(rank: Rank, log: list[tuple[str, Plan, str]], move_refusal: str | None = None,
             epoch: int = 0) -> tuple[PlanApplier, PlanInForce]:
    """An applier over ``rank``'s real layer manager; the session is a listener that writes down its plans."""
    lm = rank.manager
    owner = PlanInForce(Plan(epoch=epoch, stages=rank.placement), [lm, Told("session", log)])
    pipeline = SimpleNamespace(kind="1f1b", schedule=None, first=SimpleNamespace(index=lm.local_stages[0]))
    engine = SimpleNamespace(streams=False, stream=None, plan_refusal=lambda reached, wanted: None)
    parts = RankParts(pipeline=pipeline, layer_manager=lm, session=None, tensor_managers={},
                      memories={}, plan_in_force=owner, engine=engine)
    return PlanApplier(parts, move_refusal), owner


def _one_rank(epoch: int = 0) -> Rank:
    """Stages 0 and 1 on one rank: a move re-parents blocks, nothing is sent."""
    return Rank(0, [[0, 1, 2], [3, 4]], [0, 0], Hub(1), epoch=epoch)


def _events(caplog: pytest.LogCaptureFixture, event: str) -> list[dict[str, Any]]:
    return [rec.vpipe_fields for rec in caplog.records
            if getattr(rec, "vpipe_fields", {}).get("event") == event]


def test_an_applied_plan_is_checked_once_moved_and_committed_once(monkeypatch, caplog):
    checks: list[int] = []
    check_against = Plan.check_against
    monkeypatch.setattr(Plan, "check_against", lambda self, *a: checks.append(self.epoch)
                        or check_against(self, *a))
    log: list[tuple[str, Plan, str]] = []
    rank = _one_rank()
    applier, owner = _applier(rank, log)
    plan = Plan(epoch=2, stages=((0, 1), (2, 3, 4)), policies={3: Policy.RECOMPUTE}, reason="speed")
    with caplog.at_level(logging.INFO, logger="vpipe"):
        applier.apply(plan, step=7, micro_batches=4)
    assert checks == [2]
    assert rank.keys() == {0: ["0", "1"], 1: ["2", "3", "4"]}
    committed = Plan(epoch=2, stages=((0, 1), (2, 3, 4)), policies={3: Policy.RECOMPUTE}, reason="speed")
    assert owner.plan == committed and log == [("session", committed, "applied")]
    assert rank.manager.epoch == 2  # the layer manager is told too
    assert [(e["stage"], e["step"], e["layers"]) for e in _events(caplog, "plan_applied")] == [
        (0, 7, [0, 1]), (1, 7, [2, 3, 4])]


@pytest.mark.parametrize("epoch", [3, 1])
def test_a_stale_plan_is_skipped_unchecked_and_nothing_changes(monkeypatch, epoch):
    monkeypatch.setattr(Plan, "check_against", lambda *a: pytest.fail("a stale plan was checked"))
    log: list[tuple[str, Plan, str]] = []
    rank = _one_rank(epoch=3)
    applier, owner = _applier(rank, log, epoch=3)
    applier.apply(Plan(epoch=epoch, stages=((0, 1), (2, 3, 4))), step=1, micro_batches=1)
    assert rank.keys() == {0: ["0", "1", "2"], 1: ["3", "4"]} and rank.manager.epoch == 3
    assert owner.epoch == 3 and log == []


@pytest.mark.parametrize("stages, why", [
    (((0, 1), (2, 3, 4, 5)), "made for another set of layers (they were edited since)"),
    (((0, 1), (2, 3)), "made for another set of layers (they were edited since)"),
    (((0, 2), (1, 3, 4)), "plan reorders layers: every stage must hold a contiguous run"),
    (((0,), (1, 2), (3, 4)), "plan has 3 stages, the pipeline has 2"),
])
def test_a_plan_that_does_not_fit_is_skipped_before_anything_moves(caplog, stages, why):
    log: list[tuple[str, Plan, str]] = []
    rank = _one_rank()
    applier, owner = _applier(rank, log)
    with caplog.at_level(logging.INFO, logger="vpipe"):
        applier.apply(Plan(epoch=4, stages=stages), step=1, micro_batches=1)
    skipped = [r.getMessage() for r in caplog.records if getattr(r, "vpipe_fields",
                                                                 {}).get("event") == "plan_skipped"]
    assert len(skipped) == 1 and skipped[0].startswith(f"epoch 4: {why}")
    assert rank.keys() == {0: ["0", "1", "2"], 1: ["3", "4"]} and owner.epoch == 0 and log == []


def test_a_plan_whose_layers_cannot_move_applies_its_policies_only(caplog):
    log: list[tuple[str, Plan, str]] = []
    rank = _one_rank()
    applier, owner = _applier(rank, log, move_refusal="a traced split")
    with caplog.at_level(logging.INFO, logger="vpipe"):
        applier.apply(Plan(epoch=1, stages=((0, 1), (2, 3, 4)), policies={0: Policy.SWAP}), step=1,
                      micro_batches=1)
    assert rank.keys() == {0: ["0", "1", "2"], 1: ["3", "4"]}
    # where they are
    assert owner.plan == Plan(epoch=1, stages=((0, 1, 2), (3, 4)), policies={0: Policy.SWAP})
    assert len(log) == 1 and len(_events(caplog, "plan_skipped")) == 1


class Other(Block):
    """A block of another kind: a rank holding only these cannot build a ``Block`` without a factory."""


def test_a_plan_whose_move_aborts_still_takes_effect_and_a_resend_is_stale():
    hub = Hub(2)
    ranks = [Rank(0, TWO, [0, 1], hub), Rank(1, TWO, [0, 1], hub, kind=Other)]
    logs: list[list[tuple[str, Plan, str]]] = [[], []]
    appliers = {id(rank.manager): _applier(rank, log) for rank, log in zip(ranks, logs)}
    plan = Plan(epoch=2, stages=((0, 1), (2, 3, 4, 5)))
    on_every_rank(ranks, lambda lm: appliers[id(lm)][0].apply(plan, step=1, micro_batches=1))
    for rank, log in zip(ranks, logs):
        assert appliers[id(rank.manager)][1].placement == tuple(map(tuple, TWO))  # nothing moved
        assert [(p.epoch, p.stages) for _, p, _ in log] == [(2, tuple(map(tuple, TWO)))]
    for applier, owner in appliers.values():
        assert owner.stale(plan)
        applier.apply(plan, step=2, micro_batches=1)  # skipped: no vote is held, nobody waits
    assert all(len(log) == 1 for log in logs)


# ---------------------------------------------------------------------- the tensor managers' side
class _Manager:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.budget_bytes: int | None = None

    def apply_plan(self, plan: Plan) -> None:
        self.log.append(f"policies {plan.epoch}")

    def keep_all_need(self) -> tuple[int, int]:
        return 0, 1

    def relax(self) -> None:
        self.log.append(f"budget {self.budget_bytes}")


@pytest.mark.parametrize("cause, told", [
    ("applied", ["policies 4", "budget 104"]),
    ("edited", ["budget 104"]),  # the managers keep running what they run
    ("restored", ["policies 4"]),  # the next step boundary gives the budgets
])
def test_the_tensor_managers_take_a_plans_policies_then_their_budgets(cause, told):
    log: list[str] = []
    memory = SimpleNamespace(budget=1000, activation_budget=lambda epoch, needs: 100 + epoch)
    policies = StagePolicies({0: _Manager(log)}, {0: memory})
    policies.plan_changed(Plan(epoch=4, stages=((0, 1),)), cause)
    assert log == told


# ---------------------------------------------------------------------- checkpoints
def test_a_restored_checkpoint_is_committed_once_and_saved_back_alike():
    log: list[tuple[str, Plan, str]] = []
    rank = _one_rank()
    _, owner = _applier(rank, log)
    driver = SimpleNamespace(iteration=0)
    parts = RankParts(pipeline=None, layer_manager=rank.manager, session=None, tensor_managers={},
                      memories={}, plan_in_force=owner, engine=None)
    state = {"version": VERSION, "epoch": 6, "iteration": 40, "stages": [[0, 1], [2, 3, 4]],
             "policies": {"2": "S"}, "next_layer_id": 9}
    restore_vpipe_state(state, parts, driver=driver, hand_written=False, who=0)
    committed = Plan(epoch=6, stages=((0, 1, 2), (3, 4)), policies={2: Policy.SWAP})
    assert log == [("session", committed, "restored")] and owner.plan == committed
    assert rank.manager.epoch == 6 and driver.iteration == 40 and rank.manager.next_layer_id == 9
    saved = vpipe_state(parts, 41)
    assert (saved["epoch"], saved["iteration"], saved["policies"], saved["next_layer_id"]) == (6, 41,
                                                                                               {"2": "S"}, 9)
