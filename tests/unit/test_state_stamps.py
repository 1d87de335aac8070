"""State dicts stamped with the blocks they hold: one taken under another placement is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from vpipe.rank.stamps import StaleStateError, stamp_state_dicts


def test_a_state_dict_from_another_placement_is_refused_and_one_from_this_placement_loads():
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = torch.optim.AdamW(module.parameters())
    held = [4, 5]
    undo = stamp_state_dicts([(module, lambda: list(held))], [optimizer], lambda: list(held))
    unstamped_before = copy.deepcopy(optimizer.state_dict())
    taken, taken_opt = copy.deepcopy(module.state_dict()), copy.deepcopy(optimizer.state_dict())
    module.load_state_dict(taken)  # same blocks: loads
    optimizer.load_state_dict(taken_opt)
    # block 4 left, block 6 arrived (a Sequential slice renumbered 0..1: same keys, same shapes)
    held[:] = [5, 6]
    with pytest.raises(StaleStateError,
                       match=r"^vpipe: this stage module state dict holds blocks \[4, 5\], the "
                                              r"stage holds \[5, 6\] now \(blocks \[4\] left; blocks \[6\] "
                                              r"arrived since it was taken\); snapshot with"):
        module.load_state_dict(taken)
    with pytest.raises(StaleStateError, match="this optimizer state dict holds blocks"):
        optimizer.load_state_dict(taken_opt)
    undo()
    module.load_state_dict(taken)  # without vpipe, torch decides
    optimizer.load_state_dict(unstamped_before)
