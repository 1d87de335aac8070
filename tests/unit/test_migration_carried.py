"""Weight averages carried with their blocks (``carry=``): what moves, where it lands, and what is refused.

The moves run on the layer manager with fake peers (:mod:`support.migration`); the averages are the
trainer's own objects (torch's ``AveragedModel`` of the stage module, a dict of clones by name).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from support.migration import TWO, Block, Hub, Rank, run_ranks
from vpipe.migration.averages import AveragedCopy, NamedCopy
from vpipe.migration.carried import CarriedState, carried_state
from vpipe.plan import Plan
from vpipe.stage.blocks import KeyStyle, StageBlocks
from vpipe.stage.pipeline import LocalStage, Pipeline


def _averages(rank: Rank, kind: str) -> dict[int, Any]:
    """One average per stage of ``rank``, its values told apart from the weights (so a mix-up shows)."""
    made: dict[int, Any] = {}
    for v, container in rank.containers.items():
        if kind == "averaged":
            made[v] = AveragedModel(container, multi_avg_fn=get_ema_multi_avg_fn(0.9))
            with torch.no_grad():
                for p in made[v].module.parameters():
                    p.mul_(-1)
        else:
            made[v] = {name: -p.detach().clone() for name, p in container.named_parameters()}
    averages = {v: [_wrap(a, rank.manager.blocks[v])] for v, a in made.items()}
    rank.manager.carry = CarriedState(averages)
    return made


def _wrap(average: Any, blocks: StageBlocks) -> Any:
    return AveragedCopy(average, blocks) if isinstance(average, AveragedModel) else NamedCopy(average, blocks)


def _by_name(average: Any) -> dict[str, torch.Tensor]:
    if isinstance(average, dict):
        return {k: v.clone() for k, v in average.items()}
    return {k: v.detach().clone() for k, v in average.module.named_parameters()}


@pytest.mark.parametrize("kind", ["averaged", "dict"])
def test_a_moved_blocks_average_leaves_the_sender_and_joins_the_receiver_at_its_place(kind):
    hub = Hub(2)
    src, dst = Rank(0, TWO, [0, 1], hub), Rank(1, TWO, [0, 1], hub)
    sent, received = _averages(src, kind)[0], _averages(dst, kind)[1]
    before_src, before_dst = _by_name(sent), _by_name(received)

    run_ranks([src, dst], Plan(epoch=1, stages=((0, 1), (2, 3, 4, 5))))

    after_src, after_dst = _by_name(sent), _by_name(received)
    assert sorted(after_src) == sorted(k for k in before_src if not k.startswith("2."))
    assert {k: after_dst[k] for k in after_dst if k.startswith("2.")}.keys() == {"2.fc.weight", "2.fc.bias"}
    for name in ("2.fc.weight", "2.fc.bias"):
        assert torch.equal(after_dst[name], before_src[name])  # the sender's average, bit for bit
        assert not torch.equal(after_dst[name], dict(dst.block(2).named_parameters())[name[2:]])
    for name, value in before_dst.items():
        assert torch.equal(after_dst[name], value)
    if kind == "averaged":  # its parameters in the stage module's order: update_parameters zips the two
        assert [n for n, _ in received.module.named_parameters()] == [
            n for n, _ in dst.containers[1].named_parameters()]
        received.update_parameters(dst.containers[1])
        assert int(received.n_averaged) == 1  # zipped with the stage module without a size mismatch


def test_a_move_between_two_stages_of_one_rank_takes_the_average_along_and_on_move_hears_each_stage():
    placement, ranks_of = [[0, 1], [2, 3], [4, 5], [6, 7]], [0, 1, 1, 0]
    hub = Hub(2)
    a, b = Rank(0, placement, ranks_of, hub), Rank(1, placement, ranks_of, hub)
    _averages(a, "dict")
    averages = _averages(b, "dict")
    heard: list = []
    b.manager.carry.on_move = heard.append
    b.manager.listeners = {v: [*ls, b.manager.carry.follower(v)] for v, ls in b.manager.listeners.items()}
    three = averages[1]["3.fc.weight"]

    run_ranks([a, b], Plan(epoch=1, stages=((0,), (1, 2), (3, 4, 5), (6, 7))))
    b.manager.carry.plan_changed(None, "applied")

    assert sorted(averages[1]) == ["1.fc.bias", "1.fc.weight", "2.fc.bias", "2.fc.weight"]
    assert averages[2]["3.fc.weight"] is three  # re-parented with its block, not copied
    assert [(e.stage, sorted(e.arrived), e.left) for e in heard] == [(1, [1], (3,)), (2, [3], ())]


def test_a_dict_follows_a_positional_container_renumbered_after_an_edit():
    container = nn.ModuleList(Block(i) for i in range(3))
    blocks = StageBlocks(container, [10, 11, 12], KeyStyle.POSITIONS, "h")
    values = {f"h.{name}": -p.detach().clone() for name, p in container.named_parameters()}
    kept = {lid: values[f"h.{i}.fc.weight"] for i, lid in enumerate([10, 11, 12])}
    average = NamedCopy(values, blocks)
    blocks.remove([10])  # the layer manager edits the container first
    average.sync()
    arriving = Block(9)
    blocks.insert(0, [(9, arriving, None)])
    average.put(9, arriving, {"fc.weight": torch.ones(4, 4), "fc.bias": torch.zeros(4)})
    assert values["h.1.fc.weight"] is kept[11] and values["h.2.fc.weight"] is kept[12]
    assert torch.equal(values["h.0.fc.weight"], torch.ones(4, 4))
    assert average.held[10]["fc.weight"] is kept[10]  # held until the move says where it goes
    assert len(values) == 6


def _pipeline(module: nn.Module) -> Pipeline:
    container = module.layers
    blocks = StageBlocks(container, [0, 1], KeyStyle.IDS, "layers")
    return Pipeline(None, [LocalStage(0, module, blocks=blocks)], 1, (0,), "gpipe", torch.device("cpu"))


class _OneRank:
    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def gather(self, key: str, indices: Any, call: str, who: str) -> list[bytes]:
        return [self.values[key.format(i)].encode() for i in indices]


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(OrderedDict((str(i), Block(i)) for i in range(2)))


@pytest.mark.parametrize("bad, message", [
    (lambda m: AveragedModel(nn.Linear(2, 2)), "carry[0] is an AveragedModel of another module (Linear, 2 "
     "parameters), not of this rank's stage module (_Stage, 4 parameters)"),
    (lambda m: {"layers.0.fc.weight": torch.zeros(1), "head.weight": torch.zeros(1)},
     "carry[0] is a dict keyed by 'head.weight', which names no parameter of this rank's stage module"),
    (lambda m: {0: torch.zeros(1)}, "carry[0] is a dict keyed by 0: a carried dict maps the stage module's "
     "parameter names"),
    (lambda m: dict(m.named_parameters()), "carry[0]: a carried dict holds tensors of its own (copies of the "
     "weights), not the stage's parameters themselves"),
    (lambda m: [m], "carry[0] is a list: carry= takes torch's AveragedModel of the stage module or a dict of "
     "tensors keyed by its parameter names (on_move= hears of moves for anything else)"),
])
def test_what_carry_cannot_take_is_named_in_one_line(bad, message):
    module = _Stage()
    with pytest.raises(ValueError) as raised:
        carried_state(_pipeline(module), [bad(module)], None, _OneRank(), "stage 0")
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_carried_averages_are_matched_to_their_stage_and_left_out_of_the_scan():
    module = _Stage()
    ema = AveragedModel(module)
    clones = {name: p.detach().clone() for name, p in module.named_parameters()}
    state = carried_state(_pipeline(module), [ema, clones], None, _OneRank(), "stage 0")
    assert [a.kind for a in state.averages[0]] == ["AveragedModel", "dict"]
    assert state.ids == {id(ema), id(clones)}


def _two_stages(first: nn.Module, second: nn.Module) -> Pipeline:
    """Two interleaved stages of one rank built alike (the same names and shapes), as stages 1 and 3."""
    stages = [LocalStage(v, m, blocks=StageBlocks(m.layers, ids, KeyStyle.IDS, "layers"))
              for v, m, ids in ((1, first, [0, 1]), (3, second, [2, 3]))]
    return Pipeline(None, stages, 4, (1, 3), "interleaved1f1b", torch.device("cpu"))


def test_an_average_of_one_of_two_stages_built_alike_goes_to_the_stage_it_tracks():
    torch.manual_seed(0)
    first, second = _Stage(), _Stage()
    ema_first, ema_second = AveragedModel(first), AveragedModel(second)
    with torch.no_grad():  # trained a little since: still far nearer its own stage than the other
        for p in [*ema_first.parameters(), *ema_second.parameters()]:
            p.add_(1e-3)
    state = carried_state(_two_stages(first, second), [ema_second, ema_first], None, _OneRank(), "rank 1")
    assert [a.averaged is ema_first for a in state.averages[1]] == [True]
    assert [a.averaged is ema_second for a in state.averages[3]] == [True]


def test_an_average_as_near_to_two_stages_built_alike_is_refused_in_one_line():
    first, second = _Stage(), _Stage()
    second.load_state_dict(first.state_dict())
    with pytest.raises(ValueError) as raised:
        carried_state(_two_stages(first, second), [AveragedModel(first)], None, _OneRank(), "rank 1")
    assert "carry[0] averages stages [1, 3] of this rank alike" in str(raised.value)
    assert "\n" not in str(raised.value)
