"""The monitor holds the graph nodes it hooked until the next step ends, then lets go of the newest first."""

from __future__ import annotations

import torch

from vpipe.monitors.held_nodes import HeldNodes, first_grad_tensor


def test_hooked_nodes_are_held_a_step_longer_and_their_hooks_fire():
    held, fired = HeldNodes(), []
    x = torch.ones(2, requires_grad=True)
    outs = []
    for step in (1, 1, 2):
        y = x * step
        held.hook(step, y, lambda g, step=step: fired.append(step))
        outs.append(y)
    assert len(held) == 3
    sum(o.sum() for o in outs).backward()
    assert sorted(fired) == [1, 1, 2]
    held.release(before=2)  # step 2 ends: step 1's nodes go, step 2's stay (the last stage keeps its graph)
    assert len(held) == 1
    held.release()
    assert len(held) == 0


def test_the_tensor_that_marks_a_layers_backward():
    a, b = torch.ones(1), torch.ones(1, requires_grad=True)
    assert first_grad_tensor((a, b)) is b and first_grad_tensor(b) is b
    assert first_grad_tensor(a) is None and first_grad_tensor({"x": b}) is None
