"""Helpers for the tensor manager's single-process tests: models, a GPipe-order loop, comparisons, and
copies that finish when the test says so."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from vpipe.plan import Policy
from vpipe.tensor_manager import TensorManager
from vpipe.tensor_manager.copy_engine import D2H, H2D, CpuCopyEngine, Ticket
from vpipe_lab.runtime.models import ModelSpec, build_model, cnn, transformer_lm

MICRO_BATCH = 2


def model_spec(kind: str) -> ModelSpec:
    if kind == "transformer":
        return transformer_lm(n_blocks=3, d_model=32, n_heads=2, seq_len=16, dropout=0.1)
    return cnn(widths=(8, 8, 16, 16))


def layers_of(model: nn.Sequential) -> dict[int, nn.Module]:
    return {int(name): child for name, child in model.named_children()}


def make_manager(model: nn.Sequential, policies: Mapping[int, Policy | str] | None = None,
                 **kwargs: object) -> TensorManager:
    kwargs = {"min_swap_bytes": 0, "host_pool_bytes": 32 << 20, "host_pool_chunk_bytes": 1 << 20, **kwargs}
    return TensorManager(layers_of(model), device=torch.device("cpu"), policies=policies,
                         **kwargs)  # type: ignore[arg-type]


def gpipe_step(
    model: nn.Sequential,
    spec: ModelSpec,
    step: int,
    manager: TensorManager | None,
    micro_batches: int = 3,
    before_forward: Callable[[int], None] | None = None,
    before_backward: Callable[[int], None] | None = None,
    pass_inputs: bool = False,
    last_first: bool = False,
) -> list[torch.Tensor]:
    """All forwards, then all backwards (GPipe order), gradients accumulated; returns the losses.
    ``pass_inputs``: tell the manager each micro-batch's inputs (as the pipelining wrapper does);
    ``last_first``: the backwards from the last micro-batch (torch's ScheduleGPipe starts with the first)."""
    x, y = spec.batch(step, micro_batches * MICRO_BATCH, 0)
    losses = []
    for mb, (xm, ym) in enumerate(zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches))):
        if before_forward is not None:
            before_forward(mb)
        if manager is None:
            out = model(xm)
        else:
            with manager.micro_batch(mb, (xm,) if pass_inputs else None):
                out = model(xm)
        losses.append(spec.loss_fn()(out, ym) / micro_batches)
    order = list(enumerate(losses))
    for mb, loss in reversed(order) if last_first else order:
        if before_backward is not None:
            before_backward(mb)
        if manager is None:
            loss.backward()
        else:
            with manager.backward(mb):
                loss.backward()
    return [loss.detach() for loss in losses]


def train_grads(
    kind: str,
    policies: Mapping[int, Policy | str] | None,
    steps: int = 2,
    seed: int = 11,
    **kwargs: object,
) -> tuple[list[dict[str, torch.Tensor]], TensorManager | None]:
    """Gradients of each step of a GPipe-order loop (``policies=None``: no manager at all)."""
    spec = model_spec(kind)
    model = build_model(spec, seed=0)
    manager = None if policies is None else make_manager(model, policies)
    torch.manual_seed(seed)
    out = []
    for step in range(steps):
        gpipe_step(model, spec, step, manager, **kwargs)  # type: ignore[arg-type]
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return out, manager


def assert_grads_equal(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w)
        for name in w:
            assert torch.equal(g[name], w[name]), (
                f"step {step}, {name}: max abs diff {(g[name] - w[name]).abs().max().item():.3e}")


class _Event:
    """A copy in flight: it runs when completed (the test, a wait, or a stream that consumes its result)."""

    def __init__(self, work: Callable[[], None]) -> None:
        self.work: Callable[[], None] | None = work

    def query(self) -> bool:
        return self.work is None

    def synchronize(self) -> None:
        self.complete()

    def complete(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            work()


class LateCopies(CpuCopyEngine):
    """Asynchronous copies on CPU: tickets stay pending until completed (as on a GPU's copy streams)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.events: list[_Event] = []

    def _later(self, direction: str, nbytes: int, work: Callable[[], None]) -> Ticket:
        event = _Event(work)
        self.events.append(event)
        ticket = Ticket(direction, nbytes, event, seconds=0.0)
        self._account(ticket)
        return ticket

    def to_host_batch(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Ticket:
        def copy() -> None:
            with torch.no_grad():  # (as the engine issues them: a source may carry its graph)
                for src, dst in pairs:
                    dst.copy_(src)

        return self._later(D2H, sum(src.numel() for src, _ in pairs), copy)

    def to_device_batch(self, sources: Sequence[torch.Tensor], after: Sequence[Ticket] = ()
                        ) -> tuple[list[torch.Tensor], Ticket]:
        outs = [torch.empty(src.numel(), dtype=torch.uint8) for src in sources]
        for ticket in after:
            assert ticket.done(), "a prefetch was issued before the host bytes it reads had arrived"
        return outs, self._later(H2D, sum(src.numel() for src in sources),
                                 lambda: [out.copy_(src) for out, src in zip(outs, sources)] and None)

    def consume(self, tensor: torch.Tensor, ticket: Ticket) -> None:
        ticket.event.complete()  # the compute stream waits for the copy before it reads the tensor

    def complete_all(self) -> None:
        for event in self.events:
            event.complete()
