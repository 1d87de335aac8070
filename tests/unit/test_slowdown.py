"""vpipe_lab.runtime.slowdown: a slower device is modelled by waiting, and training stays bitwise the same."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from vpipe_lab.runtime import slowdown
from vpipe_lab.runtime.slowdown import SlowDevice, children_of, of_class


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x)) + x


def _model(width: int = 32, blocks: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(blocks)], nn.Linear(width, 4))


def _train(model: nn.Module, steps: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        optimizer.step()
        optimizer.zero_grad()
    return losses + [p.detach().clone() for p in model.parameters()], grads


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the waits instead of waiting (the counting tests need no clock)."""
    calls: list[float] = []
    monkeypatch.setattr(slowdown.time, "sleep", calls.append)
    return calls


def test_training_is_bitwise_the_same_slowed_or_not():
    plain_values, plain_grads = _train(_model())
    with SlowDevice(2.0, modules=of_class(Block)) as slow:
        slowed_values, slowed_grads = _train(_model())
        assert slow.slept_s > 0
    assert len(plain_values) == len(slowed_values) and len(plain_grads) == len(slowed_grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(plain_values, slowed_values))
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, slowed_grads))


def test_a_forward_and_backward_take_about_factor_times_as_long():
    torch.set_num_threads(1)
    model = _model(width=256, blocks=4)
    x = torch.randn(256, 256)

    def step_s() -> float:
        started = time.perf_counter()
        model(x).sum().backward()
        return time.perf_counter() - started

    plain = min(step_s() for _ in range(5))
    with SlowDevice(3.0, modules=of_class(Block)):
        slowed = min(step_s() for _ in range(5))
    assert slowed > 1.5 * plain  # loose: the blocks are most of the step, factor 3 would give close to 3x


def test_each_call_waits_once_forward_and_twice_as_long_backward(sleeps):
    model = _model()
    with SlowDevice(3.0, modules=of_class(Block)):
        model(torch.randn(2, 32)).sum().backward()
    forwards, backwards = sleeps[:3], sleeps[3:]
    assert len(forwards) == 3 and len(backwards) == 3
    assert sorted(backwards) == pytest.approx(sorted(2 * f for f in forwards))


def test_nested_selected_modules_wait_once_for_the_outermost(sleeps):
    model = _model()
    with SlowDevice(2.0, modules=lambda m: isinstance(m, (Block, nn.Linear, nn.Sequential))):
        model(torch.randn(2, 32)).sum().backward()
    assert len(sleeps) == 2  # the Sequential's forward, then its backward


def test_factor_one_installs_nothing_and_a_straggler_comes_and_goes(sleeps):
    model = _model()
    slow = SlowDevice(1.0, modules=children_of(model))
    model(torch.randn(2, 32)).sum().backward()
    assert sleeps == []
    slow.set_factor(2.0)
    model(torch.randn(2, 32)).sum().backward()
    assert len(sleeps) == 2 * 4  # the three blocks and the head, forward and backward
    slow.set_factor(1.0)
    model(torch.randn(2, 32)).sum().backward()
    assert len(sleeps) == 8
    slow.remove()


def test_no_grad_waits_in_forward_only_and_meta_tensors_never(sleeps):
    model = _model()
    with SlowDevice(2.0, modules=of_class(Block)):
        with torch.no_grad():
            out = model(torch.randn(2, 32))
        assert out.grad_fn is None and len(sleeps) == 3
        Block(32).to("meta")(torch.empty(2, 32, device="meta"))
        assert len(sleeps) == 3


def test_a_factor_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        SlowDevice(0.5, modules=of_class(Block))
