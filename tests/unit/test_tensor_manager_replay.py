"""A recomputed call captures the device RNG states torch.utils.checkpoint
captures, without its tree walks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import _infer_device_type, get_device_states

from vpipe.tensor_manager.replay import _device_states


def _torchs(args: tuple) -> tuple[str, list[int], list[torch.Tensor]]:
    device_type = _infer_device_type(*args)
    module = getattr(torch, device_type, None)
    if not getattr(module, "_initialized", False):
        return device_type, [], []
    devices, states = get_device_states(*args)
    return device_type, devices, states


def _same(mine: tuple, torchs: tuple) -> None:
    assert mine[0] == torchs[0]
    # torch's lists a device once per tensor on it; each device's state is taken once here
    assert mine[1] == list(dict.fromkeys(torchs[1]))
    first = {device: state for device, state in zip(torchs[1], torchs[2])}
    assert all(torch.equal(state, first[device]) for device, state in zip(mine[1], mine[2]))


@pytest.mark.parametrize("args", [
    (torch.ones(2), 3, None, "x"),
    (torch.ones(2, device="meta"), torch.ones(1)),
    ([torch.ones(2)], {"mask": torch.ones(1)}),  # containers: torch's own walk
    (),
], ids=["cpu", "meta", "containers", "none"])
def test_device_states_are_torch_checkpoints(args, monkeypatch):
    want = _torchs(args)
    if not any(isinstance(a, (list, dict)) for a in args):  # flat: none of torch's walks over the arguments
        import vpipe.tensor_manager.replay as replay

        def walked(*_: object) -> None:
            raise AssertionError("flat arguments walked as trees")

        monkeypatch.setattr(replay, "infer_device_type", walked)
        monkeypatch.setattr(replay, "get_device_states", walked)
    _same(_device_states(args), want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_device_states_on_cuda_are_torch_checkpoints():
    torch.cuda.init()
    x, y = torch.ones(2, device="cuda"), torch.ones(3, device="cuda")
    for args in ((x, y, 2), (x, torch.ones(1)), ([x], y)):
        mine = _device_states(args)
        assert mine[0] == "cuda" and mine[1] == [x.get_device()]
        _same(mine, _torchs(args))
