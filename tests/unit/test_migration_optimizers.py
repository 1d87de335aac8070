"""One optimizer per model part: attach's reading of a container, and a layer changing parts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vpipe.migration.state import load_layer, pack_layer, register_layer
from vpipe.stage.optimizers import OptimizerParts, StageOptimizers, move_between, optimizer_parts, part_of


class Container:
    """torchtitan's OptimizersContainer, as far as vpipe reads it: the parts in ``.optimizers``."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers


def stages() -> dict[int, nn.Module]:
    torch.manual_seed(0)
    return {0: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 2: nn.Sequential(nn.Linear(4, 4))}


def test_a_container_gives_each_stage_its_part_and_reads_as_one_optimizer():
    modules = stages()
    parts = [torch.optim.AdamW(modules[v].parameters()) for v in (0, 2)]
    for optimizer in (Container(parts), parts, tuple(parts)):
        combined = optimizer_parts(optimizer, modules)
        assert isinstance(combined, OptimizerParts)
        assert part_of(combined, 0) is parts[0] and part_of(combined, 2) is parts[1]
        assert combined.param_groups == [parts[0].param_groups[0], parts[1].param_groups[0]]
    single = torch.optim.SGD(modules[0].parameters())
    assert optimizer_parts(single, modules) is single and part_of(single, 2) is single
    assert optimizer_parts([single], {0: modules[0]}) is single


def test_a_container_whose_parts_are_not_one_per_stage_is_refused_saying_what_to_build():
    modules = stages()
    everything = [torch.optim.SGD(modules[0].parameters(), lr=0.1), torch.optim.SGD(
        [*modules[0].parameters(), *modules[2].parameters()], lr=0.1)]
    with pytest.raises(ValueError,
                       match=r"optimizer\(s\) \[1\] train several of this rank's stages while a stage "
                                         "has several optimizers; give each stage its own optimizers"):
        optimizer_parts(everything, modules)
    alone = torch.optim.SGD(modules[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="none of the 2 optimizers given holds a parameter of stage 2"):
        optimizer_parts([alone, torch.optim.SGD(modules[0].parameters(), lr=0.1)], modules)
    with pytest.raises(TypeError, match="a container must hold torch optimizers"):
        optimizer_parts(Container([]), modules)


def test_several_optimizers_that_each_train_every_stage_of_the_rank_are_one_set():
    """The Muon recipe over interleaved stages: Muon for both stages' matrices, AdamW for both stages'
    biases (the fuzzer's extra=muon draws were refused before)."""
    modules = stages()
    both = [*modules[0].parameters(), *modules[2].parameters()]
    muon = torch.optim.SGD([p for p in both if p.ndim == 2], lr=0.1)
    adamw = torch.optim.AdamW([p for p in both if p.ndim == 1])
    combined = optimizer_parts([muon, adamw], modules)
    assert isinstance(combined, StageOptimizers) and combined.parts == [muon, adamw]


def test_a_layer_arriving_on_a_stage_joins_that_stages_part_with_its_state():
    sender, receiver = stages(), stages()
    send_parts = [torch.optim.AdamW(sender[v].parameters()) for v in (0, 2)]
    recv = optimizer_parts([torch.optim.AdamW(receiver[v].parameters()) for v in (0, 2)], receiver)
    sender[0](torch.ones(1, 4)).sum().backward()
    send_parts[0].step()
    block = sender[0][1]
    state = pack_layer(1, block, send_parts[0])
    arriving = nn.Linear(4, 4)
    register_layer(load_layer(state, arriving, part_of(recv, 2)), part_of(recv, 2))
    stage2 = part_of(recv, 2)
    assert stage2 is not None and any(p is arriving.weight for p in stage2.param_groups[0]["params"])
    assert arriving.weight not in part_of(recv, 0).state  # looking it up left no empty entry in another part
    assert torch.equal(recv.state[arriving.weight]["exp_avg"], send_parts[0].state[block.weight]["exp_avg"])


def test_a_layer_moving_between_two_stages_of_a_rank_changes_part_with_its_state():
    modules = stages()
    parts = [torch.optim.AdamW(modules[v].parameters()) for v in (0, 2)]
    modules[0](torch.ones(1, 4)).sum().backward()
    parts[0].step()
    moving = list(modules[0][1].parameters())
    moments = [parts[0].state[p] for p in moving]
    move_between(parts[0], parts[1], moving)
    assert [id(p) for p in parts[1].param_groups[0]["params"]][-2:] == [id(p) for p in moving]
    assert not any(p in parts[0].state for p in moving)
    assert [parts[1].state[p] for p in moving] == moments
    assert len(parts[0].param_groups[0]["params"]) == 2


def _muon_recipe(block: nn.Module) -> list[torch.optim.Optimizer]:
    """Muon for the 2-D weights, AdamW for the rest (biases, norms)."""
    matrices = [p for p in block.parameters() if p.ndim == 2]
    rest = [p for p in block.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]


def test_a_stage_with_muon_and_adamw_reads_as_one_and_a_moved_block_joins_each_kind_with_its_state():
    torch.manual_seed(0)
    sender = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    receiver = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    send = optimizer_parts(_muon_recipe(sender), {0: sender})
    recv = optimizer_parts(Container(_muon_recipe(receiver)), {1: receiver})
    assert isinstance(send, StageOptimizers) and isinstance(recv, StageOptimizers)
    assert len(send.param_groups) == 2 and part_of(recv, 1) is recv
    sender(torch.ones(2, 4)).sum().backward()
    send.step()
    state = pack_layer(0, sender[0], send)  # a Linear: its weight trains in Muon, its bias in AdamW
    arriving = nn.Linear(4, 4)
    register_layer(load_layer(state, arriving, recv), recv)
    muon, adamw = recv.parts
    assert any(p is arriving.weight for p in muon.param_groups[0]["params"])
    assert any(p is arriving.bias for p in adamw.param_groups[0]["params"])
    assert torch.equal(muon.state[arriving.weight]["momentum_buffer"],
                       send.parts[0].state[sender[0].weight]["momentum_buffer"])
    assert torch.equal(adamw.state[arriving.bias]["exp_avg"], send.parts[1].state[sender[0].bias]["exp_avg"])
    assert arriving.weight not in adamw.state and arriving.bias not in muon.state


def _adagrad_then_muon(block: nn.Module) -> list[torch.optim.Optimizer]:
    """Adagrad built over every parameter (it fills its state at construction), then the matrices handed to a
    Muon of their own: Adagrad keeps state entries for parameters it no longer trains."""
    adagrad = torch.optim.Adagrad(block.parameters(), lr=0.02, eps=1e-7, weight_decay=0.01)
    matrices = [p for p in block.parameters() if p.ndim == 2]
    adagrad.param_groups[0]["params"] = [p for p in block.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=0.02, eps=1e-7, weight_decay=0.01), adagrad]


def test_a_parameter_moves_with_the_state_of_the_optimizer_that_trains_it_and_joins_one_of_its_class():
    torch.manual_seed(0)
    sender, receiver = nn.Linear(4, 4), nn.Linear(4, 4)
    send = optimizer_parts(_adagrad_then_muon(sender), {0: sender})
    recv = optimizer_parts(_adagrad_then_muon(receiver)[::-1], {1: receiver})  # listed the other way round
    sender(torch.ones(2, 4)).sum().backward()
    send.step()
    assert sorted(send.state[sender.weight]) == ["momentum_buffer"]  # not Adagrad's leftover entry
    assert len(send.state) == 2 and set(map(id, send.state)) == {id(sender.weight), id(sender.bias)}
    arriving = nn.Linear(4, 4)
    register_layer(load_layer(pack_layer(0, sender, send), arriving, recv), recv)
    adagrad, muon = recv.parts  # the groups agree on lr, eps and weight decay: the class tells them apart
    assert any(p is arriving.weight for p in muon.param_groups[0]["params"])
    assert any(p is arriving.bias for p in adagrad.param_groups[0]["params"])
    assert sorted(muon.state[arriving.weight]) == ["momentum_buffer"]
    assert sorted(adagrad.state[arriving.bias]) == ["step", "sum"]


def test_a_block_moving_between_two_stages_of_a_rank_each_with_muon_and_adagrad_keeps_both_states():
    """ZBV with the Muon recipe per stage (found by the fuzzer: the
    move read the state after leaving the group)."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    parts = optimizer_parts(Container([*_adagrad_then_muon(first), *_adagrad_then_muon(second)]),
                            {0: first, 3: second})
    assert isinstance(parts, OptimizerParts)
    source, target = parts.part(0), parts.part(3)
    first(torch.ones(2, 4)).sum().backward()
    source.step()
    kept = {id(p): {k: v.clone() for k, v in source.state[p].items()} for p in first.parameters()}
    move_between(source, target, list(first.parameters()))
    for p in first.parameters():
        assert p not in source.state and sorted(target.state[p]) == sorted(kept[id(p)])
        assert all(torch.equal(target.state[p][k], v) for k, v in kept[id(p)].items())


def test_an_optimizer_wrapper_that_keeps_state_of_its_own_turns_moves_off_naming_it():
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from vpipe.stage.optimizers import wrapper_refusal

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        block = nn.Linear(4, 4)
        zero = ZeroRedundancyOptimizer(block.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        assert wrapper_refusal(zero) == (
            "the optimizer is torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer, "
            "whose per-rank shards and parameter-to-rank maps vpipe cannot carry with a block; to let blocks "
            "move, shard the state with FSDP2 instead (fully_shard over the data-parallel mesh: vpipe moves "
            "its shards)")
        assert wrapper_refusal(optimizer_parts([zero, torch.optim.SGD(nn.Linear(2, 2).parameters())],
                                               {0: block})) is not None
        assert wrapper_refusal(torch.optim.AdamW(block.parameters())) is None
    finally:
        dist.destroy_process_group()


def test_an_added_layer_trains_each_parameter_where_its_namesake_in_the_nearest_block_alike_does():
    """vp.add_layers under the Muon recipe with decay / no-decay groups: the new block's matrices
    join Muon, its norm's weight and biases AdamW's no-decay group, as its namesakes train on
    another stage (before: every parameter in group 0, Muon's, which cannot train 1-D
    parameters); the receiving stage holds no block alike."""
    from vpipe.migration.namesakes import group_table, join_groups
    from vpipe.stage.blocks import KeyStyle, StageBlocks

    def recipe(params: list[nn.Parameter]) -> list[torch.optim.Optimizer]:
        muon = torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02)
        adamw = torch.optim.AdamW([{"params": [], "weight_decay": 0.1, "name": "decay"},
                                   {"params": [p for p in params if p.ndim != 2], "weight_decay": 0.0,
                                    "name": "no_decay"}], lr=1e-3)
        return [muon, adamw]

    torch.manual_seed(0)
    there = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))  # block 0, another rank's stage 0
    here = nn.Sequential(nn.Linear(4, 4))  # block 1, a block of another class, this rank's stage 1
    table = group_table({0: StageBlocks(there, [0], KeyStyle.POSITIONS, "")},
                        optimizer_parts(recipe(list(there.parameters())), {0: there}))
    muon, adamw = recipe(list(here.parameters()))
    stage = optimizer_parts([muon, adamw], {1: here})
    new = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    joins = {id(p): g for p, g in join_groups(stage, new, 2, [0, 1, 2], table)}
    groups = stage.param_groups  # Muon's group, then AdamW's decay and no_decay
    assert groups[joins[id(new[0].weight)]] is muon.param_groups[0]
    assert all(groups[joins[id(p)]] is adamw.param_groups[1]
               for p in (new[0].bias, new[1].weight, new[1].bias))
