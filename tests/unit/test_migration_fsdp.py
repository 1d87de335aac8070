"""FSDP2 blocks on the move, in one process (a one-rank mesh): what attach refuses, what a move packs and
loads, and the stage's FSDP root relearning its blocks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from vpipe.migration.cloning import clone_block
from vpipe.migration.state import load_layer, pack_layer, register_layer
from vpipe.stage.fsdp import FsdpRoot, fsdp_refusal
from vpipe.stage.kinds import compiled_inner
from vpipe.stage.pins import user_hooks


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    dist.destroy_process_group()


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for i in range(3)})
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return self.head(x)


def sharded(mesh, stage: Stage | None = None, blocks: bool = True) -> Stage:
    stage = stage or Stage()
    if blocks:
        for block in stage.layers.values():
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(stage, mesh=mesh, reshard_after_forward=False)
    return stage


def trained(stage: Stage) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    stage(torch.ones(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def test_torchtitans_layout_can_move_and_other_fsdp_layouts_say_why_not(mesh):
    assert fsdp_refusal(Stage(), Stage().layers.values()) is None  # no FSDP at all
    good = sharded(mesh)
    assert fsdp_refusal(good, good.layers.values()) is None
    root_only = sharded(mesh, blocks=False)
    assert fsdp_refusal(root_only, root_only.layers.values()) == (
        "FSDP: a block is not fully_shard-ed by itself (fully_shard every block, as torchtitan does)")
    blocks_only = Stage()
    for block in blocks_only.layers.values():
        fully_shard(block, mesh=mesh)
    assert fsdp_refusal(blocks_only, blocks_only.layers.values()) == (
        "FSDP: fully_shard the stage module too (its root state must learn of blocks that move)")
    inside = Stage()
    for block in inside.layers.values():
        fully_shard(block[0], mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(inside, mesh=mesh)
    assert fsdp_refusal(inside, inside.layers.values()) == (
        "FSDP: fully_shard is applied inside a block; vpipe moves blocks sharded as one unit")


def test_fsdps_own_hooks_do_not_pin_a_block(mesh):
    stage = sharded(mesh)
    assert user_hooks(stage.layers["0"]) == []
    stage.layers["0"].register_forward_hook(lambda *_: None)
    assert user_hooks(stage.layers["0"])  # a hook of the user's still does


def test_a_moved_fsdp_block_arrives_sharded_alike_with_its_shards_and_adam_moments(mesh):
    sender = sharded(mesh)
    send_opt = trained(sender)
    receiver = sharded(mesh, Stage())
    recv_opt = trained(receiver)
    state = pack_layer(2, sender.layers["2"], send_opt)
    marks = {(e["name"], e.get("key", "param")): e.get("shard", False) for e in state.manifest["entries"]}
    assert marks == {(name, what): what != "step" for name in ("0.weight", "0.bias")
                     # Adam's step count is no DTensor
                     for what in ("param", "step", "exp_avg", "exp_avg_sq")}
    clone = clone_block(receiver.layers["0"])
    assert type(clone) is type(receiver.layers["0"])  # FSDP's class around the block's own
    register_layer(load_layer(state, clone, recv_opt), recv_opt)
    for (name, p), q in zip(clone.named_parameters(), sender.layers["2"].parameters()):
        assert isinstance(p, DTensor) and p.placements == q.placements
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
        moments = recv_opt.state[p]
        assert isinstance(moments["exp_avg"], DTensor)
        assert torch.equal(moments["exp_avg"].full_tensor(), send_opt.state[q]["exp_avg"].full_tensor())
        assert torch.equal(moments["step"], send_opt.state[q]["step"])


def test_a_block_compiled_then_sharded_arrives_so_and_runs_its_own_shards(mesh):
    """torchtitan's order: ``torch.compile(block)`` in the block's place, then ``fully_shard`` over it."""
    sender, receiver = Stage(), Stage()
    for stage in (sender, receiver):
        for key in list(stage.layers):
            stage.layers[key] = torch.compile(stage.layers[key], backend="eager")
        sharded(mesh, stage)
    send_opt = trained(sender)
    trained(sender)
    recv_opt = trained(receiver)  # one step behind the sender: other weights
    clone = clone_block(receiver.layers["0"])
    assert type(clone) is type(receiver.layers["0"]) and compiled_inner(clone) is not None
    register_layer(load_layer(pack_layer(2, sender.layers["2"], send_opt), clone, recv_opt), recv_opt)
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = clone(x)
        assert torch.equal(out, sender.layers["2"](x))  # its own shards, not the donor's (layer 0 here)
        assert not torch.equal(out, receiver.layers["0"](x))


def test_a_whole_block_does_not_load_into_a_sharded_one(mesh):
    plain = Stage()
    state = pack_layer(0, plain.layers["0"], None)
    target = sharded(mesh)
    with pytest.raises(ValueError, match="0.weight is sharded here but whole on the sender"):
        load_layer(state, clone_block(target.layers["0"]), None)


def test_the_fsdp_root_relearns_its_blocks_after_one_arrives_and_one_leaves(mesh):
    stage = sharded(mesh)
    optimizer = trained(stage)
    root = stage._get_fsdp_state()
    before = list(root._state_ctx.all_states)
    assert len(before) == 4
    stage.layers["1"].set_modules_to_forward_prefetch([stage.layers["2"]])
    listener = FsdpRoot(stage, {int(k): b for k, b in stage.layers.items()})
    arriving = clone_block(stage.layers["0"])
    register_layer(load_layer(pack_layer(0, stage.layers["0"], optimizer), arriving, optimizer), optimizer)
    listener.remove_layer(2)
    leaving = stage.layers.pop("2")
    stage.layers["3"] = arriving
    listener.add_layer(3, arriving)
    assert stage.layers["1"]._get_fsdp_state()._states_to_forward_prefetch == []
    stage(torch.ones(4, 8)).sum().backward()  # the next forward initialises the root again
    states = root._state_ctx.all_states
    assert arriving._get_fsdp_state() in states and leaving._get_fsdp_state() not in states
    assert len(states) == 4
    assert all(p.grad is not None for p in arriving.parameters())
