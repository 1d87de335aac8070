"""A moved block's state arrives bit for bit, whatever it holds: any
dtype and shape, any optimizer, no alignment.

Property tests over random blocks (parameters and buffers of random dtypes and shapes,
0-d tensors, non-contiguous views, buffers that are views of each other) under the
optimizers people use, after a few real steps: the packed state is put at a random byte
offset of a larger buffer (as a move's payload lies in the buffer of all the move's
layers), loaded into a clone of the block, and compared bit for bit; then both copies
take the same steps and must stay bitwise equal.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from vpipe.migration.cloning import clone_block
from vpipe.migration.state import pack_layer, unpack_layer, validate_manifest

_BUFFER_DTYPES = [torch.int64, torch.bool, torch.float64, torch.bfloat16, torch.float16, torch.int32,
                  torch.uint8,
                  torch.int8, torch.float32, torch.complex64]
_PARAM_DTYPES = [torch.float32, torch.float64]


class Counting(torch.optim.Optimizer):
    """SGD with momentum whose state also holds plain values (a count, a phase name, a list) and one tensor
    under two keys: an optimizer whose state is not only tensors."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros_like(p)
                    state["same_buf"] = state["buf"]  # one tensor object under two keys
                    state["updates"], state["phase"], state["history"] = 0, "warm", [0.5, None]
                state["buf"].mul_(0.9).add_(p.grad)
                state["updates"] += 1
                state["phase"] = "warm" if state["updates"] < 2 else "steady"
                p.add_(state["same_buf"], alpha=-group["lr"])


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "counting": lambda ps: Counting(ps),
}


class RandomBlock(nn.Module):
    """A block with the parameters and buffers a draw asks for; its forward uses every parameter."""

    def __init__(self, params, buffers, view_of: int | None, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.names = []
        for i, (shape, dtype, transposed) in enumerate(params):
            t = torch.randn(shape, generator=gen, dtype=dtype)
            if transposed and t.dim() == 2:
                t = torch.randn(shape[::-1], generator=gen, dtype=dtype).t()  # a non-contiguous parameter
            self.register_parameter(f"p{i}", nn.Parameter(t))
            self.names.append(f"p{i}")
        for i, (shape, dtype) in enumerate(buffers):
            t = (torch.randn(shape, generator=gen) * 100).to(dtype) if dtype != torch.bool \
                else torch.rand(shape, generator=gen) > 0.5
            self.register_buffer(f"b{i}", t)
        if (
            view_of is not None
            and view_of < len(buffers)
            and buffers[view_of][0]
            and buffers[view_of][0][0] > 1
        ):
            self.register_buffer("view", getattr(self, f"b{view_of}")[1:])  # a buffer that aliases another

    def forward(self) -> torch.Tensor:
        return sum((getattr(self, n).double() ** 2).sum() for n in self.names)


_shapes = st.lists(st.integers(1, 5), min_size=0, max_size=3)
_blocks = st.fixed_dictionaries({
    "params": st.lists(st.tuples(_shapes, st.sampled_from(_PARAM_DTYPES), st.booleans()), min_size=1,
                       max_size=4),
    "buffers": st.lists(st.tuples(_shapes, st.sampled_from(_BUFFER_DTYPES)), max_size=5),
    "view_of": st.one_of(st.none(), st.integers(0, 4)),
    "optimizer": st.sampled_from(sorted(OPTIMIZERS)),
    "steps": st.integers(1, 3),
    "offset": st.integers(0, 15),
    "seed": st.integers(0, 1000),
})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and torch.equal(_bits(a), _bits(b)))
    return a == b


def _train(block: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        block().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _assert_same_block(got: nn.Module, want: nn.Module, got_opt, want_opt) -> None:
    for (name, a), b in zip(got.state_dict(keep_vars=True).items(), want.state_dict(keep_vars=True).values()):
        assert _same(a, b), name
    for a, b in zip(got.parameters(), want.parameters()):
        assert a.requires_grad == b.requires_grad
        got_state, want_state = got_opt.state.get(a, {}), want_opt.state.get(b, {})
        assert sorted(got_state) == sorted(want_state)
        for key in want_state:
            assert _same(got_state[key], want_state[key]), key


@settings(max_examples=120, deadline=None)
@given(_blocks)
def test_any_block_state_arrives_bit_for_bit_and_trains_on_alike(draw):
    block = RandomBlock(draw["params"], draw["buffers"], draw["view_of"], draw["seed"])
    make = OPTIMIZERS[draw["optimizer"]]
    neighbour = nn.Linear(2, 2)  # the sending stage's optimizer holds other parameters too
    optimizer = make([*neighbour.parameters(), *block.parameters()])
    _train(block, optimizer, draw["steps"])
    state = pack_layer(7, block, optimizer)
    validate_manifest(state.manifest)
    # the payload starts at an arbitrary byte of the received buffer, as a later layer's does
    wire = torch.full((draw["offset"] + state.nbytes,), 0xA5, dtype=torch.uint8)
    wire[draw["offset"]:] = state.payload
    state.payload = wire[draw["offset"]:]

    arrived = clone_block(block)
    receiver_opt = make(list(nn.Linear(3, 3).parameters()))
    unpack_layer(state, arrived, receiver_opt)
    _assert_same_block(arrived, block, receiver_opt, optimizer)
    if hasattr(block, "view"):  # the view still aliases its buffer, as in the sender's block
        base = arrived.get_buffer(f"b{draw['view_of']}")
        assert arrived.get_buffer("view").untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    _train(arrived, receiver_opt, 2)  # both copies go on training: the same steps, bit for bit
    _train(block, optimizer, 2)
    _assert_same_block(arrived, block, receiver_opt, optimizer)
