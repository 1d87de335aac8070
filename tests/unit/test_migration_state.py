"""Packing a layer's training state and loading it elsewhere continues training bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vpipe.migration.moves import Move, apply_round, plan_rounds
from vpipe.migration.state import detach_from_optimizer, pack_layer, unpack_layer, validate_manifest
from vpipe_lab.runtime.models import block_spec, build_layer


def _train(module, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(2, 8, 32, generator=gen)
        module(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_state_moves_between_optimizers_exactly(opt_name):
    spec = block_spec("attn", 32, 2, 64, 0.0)

    def make(ps):
        if opt_name == "adam":
            return torch.optim.Adam(ps, lr=1e-2)
        return torch.optim.SGD(ps, lr=1e-2, momentum=0.9)

    src, other = build_layer(spec, 3), build_layer(spec, 4)
    src_opt = make(list(other.parameters()) + list(src.parameters()))
    _train(src, src_opt, 3, seed=1)
    reference = build_layer(spec, 3)
    reference.load_state_dict(src.state_dict())
    ref_opt = make(list(reference.parameters()))
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in src_opt.state[p].items()}
             for i, p in enumerate(src.parameters())}
    group = dict(src_opt.state_dict()["param_groups"][0],
                 params=list(range(len(list(reference.parameters())))))
    ref_opt.load_state_dict({"state": state, "param_groups": [group]})

    state = pack_layer(3, src, src_opt, spec=spec)
    detach_from_optimizer(src_opt, src.parameters())
    assert all(id(p) not in {id(q) for q in src.parameters()} for p in src_opt.param_groups[0]["params"])
    assert not any(p in src_opt.state for p in src.parameters())

    dst = build_layer(spec, 99)  # different initial weights: everything must come from the state
    dst_opt = make(list(build_layer(spec, 5).parameters()))
    scheduler = torch.optim.lr_scheduler.StepLR(dst_opt, step_size=1, gamma=1.0)
    unpack_layer(state, dst, dst_opt)
    for a, b in zip(dst.state_dict().values(), src.state_dict().values()):
        assert torch.equal(a, b)
    _train(dst, dst_opt, 2, seed=2)
    scheduler.step()
    _train(reference, ref_opt, 2, seed=2)
    for (name, a), b in zip(dst.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


def test_manifest_validation_rejects_bad_input():
    state = pack_layer(1, torch.nn.Linear(3, 2), None)
    validate_manifest(state.manifest)
    with pytest.raises(ValueError, match="bad layer id"):
        validate_manifest(dict(state.manifest, layer=-1))
    bad = dict(state.manifest, entries=[dict(state.manifest["entries"][0], dtype="complex1024")])
    with pytest.raises(ValueError, match="unknown dtype"):
        validate_manifest(bad)
    bad = dict(state.manifest, entries=[dict(state.manifest["entries"][0], nbytes=1)])
    with pytest.raises(ValueError, match="claims 1 bytes"):
        validate_manifest(bad)
    with pytest.raises(ValueError, match="the built module has no parameter 'weight'"):
        unpack_layer(state, torch.nn.Identity(), None)


def test_unpack_rejects_shape_mismatch():
    state = pack_layer(1, torch.nn.Linear(3, 2), None)
    with pytest.raises(ValueError, match=r"weight is \(4, 3\)"):
        unpack_layer(state, torch.nn.Linear(3, 4), None)


def test_two_hop_move_takes_two_rounds():
    rounds = plan_rounds([(0, 1, 2, 3), (4,), (5, 6, 7, 8)], [(0, 1), (2,), (3, 4, 5, 6, 7, 8)])
    assert rounds == [[Move(0, 1, (2, 3)), Move(1, 2, (4,))], [Move(1, 2, (3,))]]


def test_rounds_reject_mismatched_placements():
    with pytest.raises(ValueError, match="same layers in the same order"):
        plan_rounds([(0, 1), (2,)], [(0,), (2, 1)])
    with pytest.raises(ValueError, match="without layers"):
        plan_rounds([(0, 1), (2,)], [(0, 1, 2), ()])
    with pytest.raises(ValueError, match="must be the suffix"):
        apply_round([(0, 1), (2,)], [Move(0, 1, (0,))])


@st.composite
def _placements(draw):
    n = draw(st.integers(2, 12))
    p = draw(st.integers(1, min(n, 5)))

    def cut():
        points = sorted(draw(st.sets(st.integers(1, n - 1), min_size=p - 1, max_size=p - 1)))
        bounds = [0, *points, n]
        return [tuple(range(bounds[i], bounds[i + 1])) for i in range(p)]

    return cut(), cut()


@settings(max_examples=200, deadline=None)
@given(_placements())
def test_rounds_reach_the_target_one_hop_at_a_time(pair):
    current, target = pair
    placement = tuple(tuple(s) for s in current)
    for moves in plan_rounds(current, target):
        assert all(abs(m.dst - m.src) == 1 for m in moves)
        placement = apply_round(placement, moves)  # validates contiguity, no empty stage
    assert placement == tuple(tuple(s) for s in target)
