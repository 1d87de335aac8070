"""What travels with a moved block beyond its tensors: pending gradients, and which param group it joins."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vpipe.migration.stale import stale_holders
from vpipe.migration.state import detach_from_optimizer, pack_layer, unpack_layer
from vpipe.stage.groups import GroupMismatch, group_settings
from vpipe.stage.optimizers import group_refusal, move_between


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


def _hf_groups(modules: list[nn.Module], extra_first: list[dict] = (),
               extra_last: list[dict] = ()) -> list[dict]:
    """Hugging Face's grouping: weight decay on weights, none on biases and norms, groups named."""
    params = [(n, p) for m in modules for n, p in m.named_parameters()]
    decay = [p for n, p in params if n.endswith("weight") and "norm" not in n]
    no_decay = [p for n, p in params if not (n.endswith("weight") and "norm" not in n)]
    return [*extra_first, {"params": decay, "weight_decay": 0.1, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}, *extra_last]


def test_a_gradient_pending_when_a_block_moves_arrives_with_it():
    """Gradient accumulation over two schedule.step() calls: the first call's gradients must travel, or the
    optimizer step after the move uses half a gradient for the moved block."""
    torch.manual_seed(0)
    src, dst = Block(), Block()
    src(torch.randn(3, 4)).sum().backward()
    src.norm.bias.grad = None  # a parameter without a pending gradient stays without one
    opt_src = torch.optim.AdamW(src.parameters())
    unpack_layer(pack_layer(2, src, opt_src), dst, torch.optim.AdamW([nn.Parameter(torch.zeros(1))]))
    assert torch.equal(dst.fc.weight.grad, src.fc.weight.grad)
    assert torch.equal(dst.norm.weight.grad, src.norm.weight.grad)
    assert dst.norm.bias.grad is None


def test_a_moved_parameter_joins_the_group_with_its_settings_not_its_index():
    """Stage 0 lists [embeddings, decay, no_decay], the last stage [decay, no_decay, head]."""
    torch.manual_seed(0)
    src, dst, emb, head, resident = Block(), Block(), nn.Embedding(5, 4), nn.Linear(4, 2), Block()
    opt_src = torch.optim.AdamW(_hf_groups([src], extra_first=[{"params": list(emb.parameters()), "lr": 5e-4,
                                                                 "weight_decay": 0.0, "name": "embeddings"}]),
                                lr=1e-3)
    opt_dst = torch.optim.AdamW(_hf_groups([resident], extra_last=[{"params": list(head.parameters()),
                                                                    "lr": 2e-3,
                                                                    "weight_decay": 0.0, "name": "head"}]),
                                lr=1e-3)
    unpack_layer(pack_layer(3, src, opt_src), dst, opt_dst)
    named = {group["name"]: {id(p) for p in group["params"]} for group in opt_dst.param_groups}
    assert {id(dst.fc.weight)} <= named["decay"]
    assert {id(dst.fc.bias), id(dst.norm.weight), id(dst.norm.bias)} <= named["no_decay"]
    assert not {id(p) for p in dst.parameters()} & named["head"]


def test_a_move_into_a_stage_without_the_group_is_refused_naming_the_difference():
    src, dst = Block(), Block()
    opt_src = torch.optim.AdamW(_hf_groups([src]), lr=1e-3)
    opt_dst = torch.optim.AdamW([{"params": list(Block().parameters()), "weight_decay": 0.1,
                                  "name": "decay"}],
                                lr=3e-3)
    with pytest.raises(GroupMismatch,
                       match=r"layer 3's fc.weight trains in param group 0 'decay' on its stage; "
                                            r"no param group here has its settings \(the "
                                            r"closest, group 0 'decay', "
                                            r"has lr 0.003 \(not 0.001\)\)"):
        unpack_layer(pack_layer(3, src, opt_src), dst, opt_dst)
    assert all(len(group["params"]) == 4 for group in opt_dst.param_groups)  # nothing half-registered


def test_a_move_between_two_parts_of_a_rank_matches_groups_by_settings_and_refuses_before_editing():
    block = Block()
    emb = nn.Embedding(5, 4)
    first = torch.optim.SGD([{"params": list(emb.parameters()), "lr": 0.5, "name": "embeddings"},
                             *_hf_groups([block])], lr=0.1)
    second = torch.optim.SGD(_hf_groups([Block()]), lr=0.1)
    move_between(first, second, list(block.parameters()))
    assert {id(block.fc.weight)} <= {id(p) for p in second.param_groups[0]["params"]}
    assert {id(block.norm.bias)} <= {id(p) for p in second.param_groups[1]["params"]}
    other = torch.optim.SGD([{"params": list(Block().parameters()), "lr": 0.1, "name": "all"}])
    assert "no param group here has its settings" in group_refusal(second, other, list(block.parameters()))


def test_group_settings_are_plain_values_a_message_carries():
    opt = torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.01), betas=(0.9, 0.99))
    settings = group_settings(opt.param_groups[0])
    assert "params" not in settings and settings["betas"] == [0.9, 0.99]
    assert settings["lr"] == {"tensor": pytest.approx(0.01), "dtype": "torch.float32"}


class Pinned:
    """A trainer's object that keeps one parameter as an attribute."""


class Ema:
    """A trainer's own EMA that keeps the parameters it averages."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = tuple(params)


def test_references_the_trainer_holds_to_leaving_parameters_are_named_and_nothing_else():
    block, other = Block(), Block()
    optimizer = torch.optim.SGD([*block.parameters(), *other.parameters()], lr=0.1)
    leaving = list(block.parameters())
    detach_from_optimizer(optimizer, leaving)  # as a move does before it looks
    assert stale_holders(leaving, [block]) == []  # the module, the optimizer and this frame's list are not
    clip_list = list(block.parameters()) + list(other.parameters())
    ema = Ema(list(block.parameters()))
    by_name = dict(block.named_parameters())
    assert stale_holders(leaving, [block]) == ["a dict of 4 (4 of them leaving)",
                                               "a list of 8 (4 of them leaving)",
                                               "a tuple of 4 (4 of them leaving)"]
    del clip_list, ema, by_name, optimizer
    # an object of the trainer's that keeps a parameter as an attribute is named (by its attribute table); one
    # of torch's (FSDP2 keeps one per parameter of a block, which leaves with the block) is not
    mine, torchs = Pinned(), type("FSDPParam", (),
                                  {"__module__": "torch.distributed.fsdp._fully_shard._fsdp_param"})()
    mine.weight = torchs.sharded_param = leaving[0]
    vars(mine), vars(torchs)  # their attribute tables, as objects read by name get them (FSDP2's are)
    assert stale_holders(leaving, [block]) == ["a dict of 1 (1 of them leaving)"]
    del mine
    assert stale_holders(leaving, [block]) == []
