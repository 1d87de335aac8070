"""The shape inference vpipe has torch redo runs quiet: no hook of the user's, buffers and random state
put back (vpipe/stage/quiet_inference.py). The pass on real ranks:
tests/integration/test_trainer_patterns.py."""

from __future__ import annotations

import torch
from torch import nn

from vpipe.stage.quiet_inference import quiet_pass


class Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module, args, output):
        self.calls += 1
        return output


def stage_module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 4))


def test_a_quiet_pass_calls_no_users_hook_and_leaves_buffers_and_random_state_as_they_were():
    module = stage_module()
    hook, pre = Counting(), Counting()
    module[0].register_forward_hook(hook)
    module.register_forward_pre_hook(lambda m, args: pre(m, args, None))
    stats = {k: v.clone() for k, v in module.state_dict().items() if "running" in k or "num_batches" in k}
    rng = torch.get_rng_state()
    with quiet_pass(module):
        module(torch.randn(8, 4)).sum().backward()
    assert hook.calls == pre.calls == 0
    assert torch.equal(torch.get_rng_state(), rng)
    for key, before in stats.items():
        assert torch.equal(module.state_dict()[key], before), key
    module(torch.randn(8, 4))  # the hooks are back, in their places
    assert hook.calls == pre.calls == 1
    assert not torch.equal(module[1].running_mean, stats["1.running_mean"])

