"""What autograd keeps after a micro-batch's backward is over: the manager lets go of it.

A split backward's input pass runs with ``retain_graph``: the nodes only it runs keep their saved tensors for
as long as the graph lives. torch's last stage detaches its outputs after their backward so that the graph
dies, but an output that is a view (``nn.Linear`` on a 3-d input: a Hugging Face LM head's logits) cannot be
detached in place, and the stage's ``output_chunks`` keep it until the next step. Found by the fuzzer
(ModuleList stages under ``ScheduleZBVZeroBubble``): a plan's move out of the last stage at the next step
boundary failed with ``LayerBusyError`` for micro-batches whose backward had run. The two-rank trainer is
tests/integration/test_zbv_moves.py; here one process runs torch's own split functions.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from support.tensor_manager import assert_grads_equal, make_manager, model_spec
from vpipe_lab.runtime.models import build_model

STAGE = [1, 2, 3, 4]  # three transformer blocks and the head: the last stage
MICRO_BATCHES = 3


def _last_stage(policies: dict[int, str] | None) -> tuple[dict, list[torch.Tensor], object]:
    """Forwards, input passes, then weight passes of the last stage, each output held as torch's last stage
    holds it (a view: not detached); returns the gradients, the outputs and the manager."""
    model = build_model(model_spec("transformer"), seed=0)
    manager = make_manager(model, policies) if policies is not None else None
    stage = nn.Sequential(*[model[i] for i in STAGE])
    outputs, groups, grads = [], {}, {}
    for mb in range(MICRO_BATCHES):
        gen = torch.Generator().manual_seed(100 + mb)
        inp = torch.randn(2, 16, 32, generator=gen).requires_grad_()
        target = torch.randint(256, (2, 16), generator=gen)
        torch.manual_seed(1000 + mb)  # dropout: the same masks with and without the manager
        if manager is None:
            out = stage(inp)
        else:
            with manager.micro_batch(mb):
                out = stage(inp)
        assert out._is_view()  # what torch's last stage cannot detach in place
        outputs.append(out)
        loss = nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())
        if manager is None:
            dinputs, groups[mb] = stage_backward_input([loss], None, [inp], stage.parameters())
        else:
            with manager.backward(mb, "input"):
                dinputs, groups[mb] = stage_backward_input([loss], None, [inp], stage.parameters())
        grads[f"input.{mb}"] = dinputs[0]
    for mb in range(MICRO_BATCHES):
        if manager is None:
            stage_backward_weight(stage.parameters(), groups.pop(mb))
        else:
            with manager.backward(mb, "weight"):
                stage_backward_weight(stage.parameters(), groups.pop(mb))
            # this micro-batch's backward is over, though its graph is alive: it holds nothing any more
            assert all(mb not in manager._engine.live_micro_batches(lid) for lid in STAGE)
    grads.update({n: p.grad.clone() for n, p in stage.named_parameters()})
    return grads, outputs, manager


@pytest.mark.parametrize("policies", [{1: "S", 2: "S", 3: "S"}, {1: "R", 2: "R", 3: "R"},
                                      {1: "D", 2: "D", 3: "D"},
                                      {1: "S", 2: "R", 3: "D", 4: "S"}], ids=["S", "R", "D", "mix"])
def test_a_graph_kept_past_the_weight_pass_holds_nothing_of_the_manager(policies):
    want, _, _ = _last_stage(None)
    got, outputs, manager = _last_stage(policies)
    assert_grads_equal([got], [want])  # bitwise
    assert all(out.grad_fn is not None for out in outputs)  # the graphs are alive, as output_chunks keep them
    s = manager.stats()
    assert s.live_saved_storages == 0 and s.host_pool_used_bytes == 0 and s.resident_bytes == 0
    for lid in STAGE:  # a plan's move at the step boundary
        manager.remove_layer(lid)
    del outputs  # the handles autograd kept die now: nothing is released twice
    assert manager.stats().live_saved_storages == 0


def test_the_end_of_a_step_lets_go_of_what_no_backward_ran_and_a_late_backward_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    manager = make_manager(model, {0: "S", 1: "S"})
    x = torch.randn(4, 8)
    with manager.micro_batch(0):
        hidden = model[0](x)
        aside = model[1](hidden)  # an output the loss does not use: its node never runs in this backward
    with manager.backward(0):
        hidden.sum().backward()
    assert manager.stats().live_saved_storages > 0  # a second backward could still use it
    manager.end_of_step()  # the step is over
    s = manager.stats()
    assert s.live_saved_storages == 0 and s.host_pool_used_bytes == 0 and s.resident_bytes == 0
    with pytest.raises(RuntimeError, match="after the micro-batch's backward ended"):
        aside.sum().backward()
