"""What keeps a per-block copy of a stage's weights beside it (an
EMA): found at attach, so its blocks stay."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from vpipe.stage.beside import averages_of


def test_an_averaged_model_and_a_dict_of_clones_are_found_and_views_of_the_weights_are_not():
    stage = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    other = nn.Sequential(nn.Linear(3, 3))
    ema = AveragedModel(stage, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    clones = {name: p.detach().clone() for name, p in stage.named_parameters()}
    views = dict(stage.named_parameters())
    found = averages_of(stage, [ema, clones, views, AveragedModel(other), {"0.weight": torch.ones(1)}])
    assert found == ["an AveragedModel of it (Sequential, 4 parameters)",
                     "a dict of 4 tensors keyed by its parameter names"]
    assert averages_of(stage, [views, stage.state_dict()]) == []
