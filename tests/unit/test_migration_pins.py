"""Which blocks never move: the hooks a move cannot carry, and blocks that share tensors."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from vpipe.plan import PINNED_KIND
from vpipe.stage.kinds import block_kind
from vpipe.stage.pins import outside_tensors, pin_reason, planner_kind, shared_pins, user_hooks
from vpipe.tensor_manager import TensorManager


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def scale(module, args, output):
    return output * 2


def test_every_kind_of_user_hook_on_a_block_or_its_submodules_is_found():
    block = _block()
    assert user_hooks(block) == []
    block.register_forward_hook(scale)
    block[0].register_forward_pre_hook(lambda module, args: None)
    block[2].register_full_backward_hook(lambda module, gin, gout: None)
    block.register_state_dict_post_hook(lambda module, state, prefix, local: None)
    block[0].register_load_state_dict_post_hook(lambda module, keys: None)
    found = user_hooks(block)
    assert found[0] == "forward hook scale"
    assert (
        "forward pre hook "
        "test_every_kind_of_user_hook_on_a_block_or_its_submodules_is_found.<locals>.<lambda> on 0"
        in found
    )
    assert len(found) == 5 and any(h.startswith("backward hook") and h.endswith(" on 2") for h in found)
    assert any(h.startswith("state dict hook") for h in found)
    assert any(h.startswith("load state dict post hook") and h.endswith(" on 0") for h in found)


def test_hooks_torch_utilities_keep_on_a_module_count_but_checkpoint_wrapper_and_vpipe_do_not():
    normed = nn.utils.weight_norm(nn.Linear(4, 4))  # a forward pre-hook holding the weight's parametrization
    assert user_hooks(normed) == ["forward pre hook WeightNorm"]
    wrapped = checkpoint_wrapper(_block())  # its state-dict hooks are the module's own: cloned with it
    assert user_hooks(wrapped) == []
    block = _block()
    # vpipe's own hooks (the tensor manager's)
    manager = TensorManager({1: block}, device=torch.device("cpu"))
    assert block._forward_pre_hooks and user_hooks(block) == []
    manager.close()


def test_blocks_sharing_a_module_or_a_tensor_with_the_stage_outside_them_are_pinned():
    blocks = {i: _block() for i in range(4)}
    blocks[2][2] = blocks[1][0]  # blocks 1 and 2 share a Linear
    blocks[3].register_buffer("table", torch.zeros(3))
    shared_activation = nn.GELU()  # a module without tensors: copying it is harmless
    blocks[0].add_module("act", shared_activation)
    blocks[3].add_module("act", shared_activation)
    stage = nn.Module()
    stage.layers = nn.ModuleDict({str(i): b for i, b in blocks.items()})
    stage.register_buffer("lookup", blocks[3].table)  # the stage module holds block 3's buffer too
    pins = shared_pins(blocks, outside_tensors(stage, [f"layers.{i}" for i in blocks]))
    assert pins == {1: "shares 0.weight with layers [2]", 2: "shares 2.weight with layers [1]",
                    3: "shares table with the stage module outside its blocks"}
    # a container holds nothing outside its blocks
    assert outside_tensors(stage.layers, map(str, blocks)) == set()
    # a stage whose blocks are direct children among others (DeepSpeed's PipelineModule: "0" the embedding)
    flat = nn.Module()
    flat.add_module("0", nn.Embedding(4, 2))
    flat.add_module("1", blocks[0])
    assert outside_tensors(flat, ["1"]) == {id(flat.get_submodule("0").weight)}
    assert pin_reason(0, blocks[0], pins) is None
    kind = planner_kind(pins, lambda: blocks)
    assert kind(blocks[0]) == block_kind(blocks[0]) and kind(blocks[1]) == block_kind(blocks[1]) + PINNED_KIND
    blocks[0].register_forward_hook(scale)  # hooks count when they are there
    assert pin_reason(0, blocks[0],
                      pins) == "carries forward hook scale (hooks cannot be carried to another process)"
