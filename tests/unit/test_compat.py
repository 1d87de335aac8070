"""vpipe.compat reaches what its docstrings say on the installed torch: a torch that moved one of its private
names fails here, by name, rather than somewhere inside a run."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, Schedule1F1B

from vpipe.compat import torch_distributed as td
from vpipe.compat import torch_internals as ti


def test_child_modules_is_the_live_table_none_entries_included():
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    children = ti.child_modules(seq)
    children["2"] = None
    assert list(ti.child_modules(seq)) == ["0", "1", "2"] and len(list(seq.named_children())) == 2
    assert ti.parameter_table(seq[0])["weight"] is seq[0].weight
    bn = nn.BatchNorm1d(2)
    assert ti.buffer_table(bn)["running_mean"] is bn.running_mean


def test_every_hook_kind_is_a_table_torch_keeps_and_holds_what_was_registered():
    module = nn.Linear(2, 2)
    for kind in ti.HOOK_KINDS:
        assert f"_{kind.replace(' ', '_')}_hooks" in ti.MODULE_INTERNALS, kind
        assert ti.hooks_of(module, kind) == {}

    def hook(*args):
        return None

    module.register_forward_pre_hook(hook)
    module.register_full_backward_hook(hook)
    assert list(ti.hooks_of(module, "forward pre").values()) == [hook]
    assert list(ti.hooks_of(module, "backward").values()) == [hook]
    assert any(hook in table.values() for table in ti.call_hook_tables(module))
    with pytest.raises(ValueError, match="unknown hook kind"):
        ti.hooks_of(module, "forwards")


def test_the_autograd_engine_is_read_inside_a_backward_pass_and_not_outside():
    assert ti.current_graph_task_id() == -1 and ti.current_autograd_node() is None
    seen: dict[str, object] = {}
    x = torch.ones(3, requires_grad=True)
    doubled = x * 2
    y = doubled.sum()

    def inside(grad):
        seen["task"] = ti.current_graph_task_id()
        seen["runs"] = ti.will_engine_execute_node(doubled.grad_fn)
        ti.queue_engine_callback(lambda: seen.setdefault("ended", True))
        return grad

    y.register_hook(inside)
    y.backward()
    assert seen["task"] != -1 and seen["runs"] is True and seen["ended"] is True


def test_views_negated_views_and_weak_references_to_storages():
    t = torch.arange(6.0)
    view = t[1:3]
    assert ti.view_base(view) is t and ti.view_base(t) is None
    assert ti.neg_view(t).is_neg()
    storage = torch.zeros(4).untyped_storage()
    ref = ti.storage_weak_ref(storage)
    assert not ti.weak_ref_expired(ref)
    del storage
    assert ti.weak_ref_expired(ref)
    ti.free_weak_ref(ref)
    dst = [torch.zeros(2), torch.zeros(3)]
    ti.foreach_copy_(dst, [torch.ones(2), torch.full((3,), 2.0)])
    assert dst[0].tolist() == [1.0, 1.0] and dst[1].tolist() == [2.0, 2.0, 2.0]
    assert ti.raw_stream_getter() is None or callable(ti.raw_stream_getter())
    assert ti.profiler_enabled() is False


def test_the_compiled_call_of_a_module_and_what_a_compile_wrapper_holds():
    module = nn.Linear(2, 2)
    assert ti.compiled_call(module) is None and ti.compile_wrapper_inner(module) is None
    ti.set_compiled_call(module, ti.call_impl(module))
    assert ti.compiled_call(module) is not None
    assert torch.equal(module(torch.ones(1, 2)), torch.nn.functional.linear(torch.ones(1, 2), module.weight,
                                                                            module.bias))
    ti.set_compiled_call(module, None)
    assert ti.compile_wrapper_inner(torch.compile(module)) is module


def test_checkpointing_helpers_on_the_cpu():
    assert ti.infer_device_type(torch.ones(1)) in ("cpu", "cuda")
    assert isinstance(ti.get_autocast_kwargs("cpu"), tuple)
    assert ti.device_initialized(object()) is False
    assert ti.active_device_context() is None
    with torch.device("meta"):
        assert ti.active_device_context() is not None


def test_schedule_internals_of_torchs_single_stage_schedules_are_all_there():
    schedule = Schedule1F1B.__new__(Schedule1F1B)  # the fields vpipe reads, without processes
    schedule._stage = object()
    schedule._stage_forward_initialized = schedule._stage_backward_initialized = True
    schedule._n_microbatches = 4
    assert td.missing_schedule_internals(schedule) == []
    assert td.single_stage(schedule) is schedule._stage and td.schedule_stages(schedule) == [schedule._stage]
    assert td.n_microbatches(schedule) == 4
    td.mark_stages_uninitialized(schedule)
    assert not schedule._stage_forward_initialized and not schedule._stage_backward_initialized
    assert td.missing_schedule_internals(object()) == ["_stage_forward_initialized",
                                                        "_stage_backward_initialized", "_stage"]
    assert td.batch_p2p_wait() is not None and td.get_schedule_ops is not None
    assert issubclass(td.PipelineScheduleRuntime, PipelineScheduleMulti) and issubclass(
        PipelineStage, td.PipelineStageBase
    )


def test_shape_inference_is_wrapped_and_unwrapped_on_the_stage_object_only():
    class Stage:
        def _prepare_forward_infra(self, n):
            return ("forward", n)

        def _prepare_backward_infra(self, n):
            return ("backward", n)

    entered = []

    class Around:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    stage = Stage()
    undo = td.wrap_shape_inference(stage, Around)
    assert undo is not None and stage._prepare_forward_infra(1) == ("forward", 1) and entered == [True]
    undo()
    assert "_prepare_forward_infra" not in vars(stage) and Stage()._prepare_backward_infra(2) == ("backward",
                                                                                                  2)
    assert td.wrap_shape_inference(object(), Around) is None

    trainers = stage._prepare_forward_infra = lambda n: ("trainer's", n)  # a trainer's own wrapper, first
    undo = td.wrap_shape_inference(stage, Around)
    assert stage._prepare_forward_infra(3) == ("trainer's", 3) and len(entered) == 2
    undo()
    assert stage._prepare_forward_infra is trainers  # put back, not dropped


def test_the_loss_of_shape_inference_is_chosen_per_call_and_put_back():
    class Stage:
        def _prepare_backward_infra(self, n, loss_fn=None, target=None):
            return loss_fn(n, target)

    stage = Stage()
    undo = td.wrap_inference_loss(stage, lambda loss_fn: (lambda out, target: ("stand-in", out)))
    assert undo is not None
    assert stage._prepare_backward_infra(4, loss_fn=lambda out, target: ("user's", out)) == ("stand-in", 4)
    undo()
    assert stage._prepare_backward_infra(4, loss_fn=lambda out, target: ("user's", out)) == ("user's", 4)
    assert td.wrap_inference_loss(object(), lambda loss_fn: loss_fn) is None
