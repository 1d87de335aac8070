"""Attach is all or nothing: a step of ``vpipe.attach`` that fails
leaves the trainer's objects exactly as they were.

Every undo of an attach is registered as its thing is made (``vpipe/rank/build.py``). Each test makes one
construction step fail on a one-rank pipeline and compares everything attach may touch before and after: the
stage module's and its blocks' classes, hooks, instance attributes, parameters and buffers, the optimizer's
hooks, attributes, param groups and state, the schedule's and the pipelining stage's wrapped methods, the
process's module and optimizer hooks, the ``vpipe`` logger's handlers and level, atexit, vpipe's threads; the
failure must propagate unchanged, and an attach afterwards must work.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.nn.modules import module as torch_module
from torch.optim import optimizer as torch_optimizer

import vpipe
from vpipe.control import session as session_module
from vpipe.rank.cleanups import Cleanups
from vpipe.stage import batch_norm

MODULE_TABLES = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks",
                 "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
                 "_state_dict_hooks",
                 "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
OPTIMIZER_TABLES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                    "_optimizer_state_dict_pre_hooks",
                    "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks")
GLOBAL_TABLES = [(torch_module, name) for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                   "_global_backward_hooks", "_global_backward_pre_hooks")]
GLOBAL_TABLES += [(torch_optimizer, name) for name in ("_global_optimizer_pre_hooks",
                                                       "_global_optimizer_post_hooks")]


class Boom(RuntimeError):
    """The failure a test injects."""


_AT_EXIT: list[Any] = []  # what is registered with atexit now (atexit can count its callbacks, not list them)


@pytest.fixture
def one_rank(monkeypatch):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _, _, schedule, optimizer = _trainer()
    # the process's own set-up, made once and no attach's (the key folders, removed at its exit)
    vpipe.attach(schedule, optimizer=optimizer, planning=False).detach()
    register, unregister = atexit.register, atexit.unregister

    def registered(function: Any, *args: Any, **kwargs: Any) -> Any:
        _AT_EXIT.append(function)
        return register(function, *args, **kwargs)

    def unregistered(function: Any) -> None:
        _AT_EXIT[:] = [f for f in _AT_EXIT if f != function]
        unregister(function)

    monkeypatch.setattr(atexit, "register", registered)
    monkeypatch.setattr(atexit, "unregister", unregistered)
    yield
    _AT_EXIT.clear()
    dist.destroy_process_group()


def _trainer(norm: type[nn.Module] = nn.BatchNorm1d) -> tuple[nn.Module, PipelineStage, ScheduleGPipe,
                                                             torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), norm(4)), nn.Linear(4, 4), nn.Linear(4, 4))
    model[2].compile(backend="eager")  # a block compiled in place: attach hoists its compiled forward
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()  # state (momentum buffers) that must stay the optimizer's
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    return model, stage, ScheduleGPipe(stage, 2,
                                       loss_fn=lambda out, target: ((out - target) ** 2).mean()), optimizer


def _table(owner: Any, name: str) -> list[tuple[int, int]]:
    return [(key, id(hook)) for key, hook in getattr(owner, name, {}).items()]


def _snapshot(model: nn.Module, stage: PipelineStage, schedule: ScheduleGPipe,
              optimizer: torch.optim.Optimizer,
              values: bool = True) -> dict[str, Any]:
    """Everything attach may touch, comparable with ==; ``values``: parameters, buffers and state by value."""
    modules = {}
    for name, m in model.named_modules():
        modules[name] = {
            "object": (id(m), type(m)), "tables": {t: _table(m, t) for t in MODULE_TABLES},
            "attributes": sorted(m.__dict__), "compiled": m.__dict__.get("_compiled_call_impl") is not None,
            "children": [(n, id(c)) for n, c in m.named_children()],
            "parameters": [(n, id(p), p.tolist() if values else None)
                           for n, p in m.named_parameters(recurse=False)],
            "buffers": [(n, b.tolist() if values else None) for n, b in m.named_buffers(recurse=False)],
            "non_persistent": sorted(m.__dict__.get("_non_persistent_buffers_set", ())),
        }
    groups = [{k: [id(p) for p in v] if k == "params" else v for k, v in g.items()}
              for g in optimizer.param_groups]
    state = {id(p): {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for p, s in optimizer.state.items()} if values else sorted(id(p) for p in optimizer.state)
    vpipe_logger = logging.getLogger("vpipe")
    return {
        "modules": modules, "optimizer": {"type": type(optimizer), "attributes": sorted(optimizer.__dict__),
                                          "tables": {t: _table(optimizer, t) for t in OPTIMIZER_TABLES},
                                          "groups": groups, "state": state},
        "schedule": sorted(schedule.__dict__),
        "stage": sorted(k for k in stage.__dict__ if "chunk" in k or k.startswith("_prepare")),
        "global": {f"{owner.__name__}.{name}": _table(owner, name) for owner, name in GLOBAL_TABLES},
        "logger": ([id(h) for h in vpipe_logger.handlers], vpipe_logger.level),
        "atexit": [repr(f) for f in _AT_EXIT],
    }


def _vpipe_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("vpipe")}


def _new_threads(before: set[threading.Thread], wait_s: float = 5.0) -> list[str]:
    """vpipe's threads started since ``before`` still alive once those ending had ``wait_s`` to end."""
    deadline = time.monotonic() + wait_s
    while True:
        new = sorted(t.name for t in _vpipe_threads() - before)
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.05)


OPTIONS = {"planning": False, "deferred_batch_norm": True, "policies": {1: "R"}, "sample_every": 1}


def _attach(schedule: ScheduleGPipe, optimizer: torch.optim.Optimizer, tmp_path: Any) -> vpipe.Vpipe:
    return vpipe.attach(schedule, optimizer=optimizer, log_file=str(tmp_path / "run.log"), trace_steps=(0, 1),
                        trace_dir=str(tmp_path / "trace"), **OPTIONS)


def test_a_failure_after_any_step_of_attach_leaves_the_trainer_as_it_was(one_rank, tmp_path):
    model, stage, schedule, optimizer = _trainer()
    threads = _vpipe_threads()
    before = _snapshot(model, stage, schedule, optimizer)
    structure = _snapshot(model, stage, schedule, optimizer, values=False)
    real_add = Cleanups.add
    made: list[Any] = []
    fail_at = 0

    def add(self: Cleanups, undo: Any) -> None:  # the n-th thing made, then a failure
        real_add(self, undo)
        made.append(undo)
        if len(made) == fail_at:
            raise Boom(f"after step {fail_at}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Cleanups, "add", add)
        while True:
            fail_at += 1
            made.clear()
            try:
                vp = _attach(schedule, optimizer, tmp_path)
            except Boom as e:
                assert str(e) == f"after step {fail_at}"  # the step's own failure, not an undo's
                assert _snapshot(model, stage, schedule, optimizer) == before, f"failed after step {fail_at}"
                assert _new_threads(threads) == [], f"failed after step {fail_at}"
                continue
            break  # every step made: the attach stands
    names = [getattr(undo, "__qualname__", "") for undo in made]
    assert fail_at == len(made) + 1 >= 14, names  # each part that is made registers its undo
    assert {"RunLog.close", "TraceWindow.close", "DeferredNorms.undo", "RunKeys.close",
            "Hoisted.undo", "TensorManager.close", "StageHandle.remove", "TransferChannel.close",
            "LayerManager.close"} <= set(names)
    during = _snapshot(model, stage, schedule, optimizer)
    # it did install its parts
    assert during != before and type(model[0][1]) is batch_norm.DeferredBatchNorm1d
    vp.detach()  # the same undos
    assert _snapshot(model, stage, schedule, optimizer) == before
    vp = _attach(schedule, optimizer, tmp_path)  # and the trainer trains under a new attach
    x = torch.randn(4, 4)
    schedule.step(x, target=x)
    optimizer.step()
    vp.detach()
    assert _snapshot(model, stage, schedule, optimizer, values=False) == structure  # trained: values moved on
    assert _new_threads(threads) == []


def _fail(*_: Any, **__: Any) -> Any:
    raise Boom("inside a part")


@pytest.mark.parametrize("where", ["session.StageAgent", "session.StagePulse",
                                   "batch_norm.wrap_shape_inference"])
def test_a_part_that_fails_half_made_closes_what_it_opened(one_rank, tmp_path, where):
    """The control session (monitors, sockets and threads, the planner's link, hooks) and the deferred
    BatchNorms are made of several things: one failing leaves none of the others."""
    model, stage, schedule, optimizer = _trainer()
    threads = _vpipe_threads()
    before = _snapshot(model, stage, schedule, optimizer)
    module, name = where.split(".")
    with pytest.MonkeyPatch.context() as patch, pytest.raises(Boom, match="inside a part"):
        patch.setattr({"session": session_module, "batch_norm": batch_norm}[module], name, _fail)
        _attach(schedule, optimizer, tmp_path)
    assert _snapshot(model, stage, schedule, optimizer) == before
    assert _new_threads(threads) == []
    _attach(schedule, optimizer, tmp_path).detach()
    assert _snapshot(model, stage, schedule, optimizer) == before


def test_a_refused_batch_norm_leaves_the_ones_made_deferred_before_it_as_torch_s(one_rank, tmp_path):
    model, stage, schedule, optimizer = _trainer()
    model[1] = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))  # refused, after block 0's BatchNorm1d
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _snapshot(model, stage, schedule, optimizer)
    with pytest.raises(ValueError, match="SyncBatchNorm, whose forward vpipe cannot defer"):
        _attach(schedule, optimizer, tmp_path)
    assert type(model[0][1]) is nn.BatchNorm1d
    assert _snapshot(model, stage, schedule, optimizer) == before


def test_a_hand_written_loop_without_an_optimizer_is_refused_before_anything_is_installed(one_rank, tmp_path):
    model, stage, schedule, optimizer = _trainer()
    before = _snapshot(model, stage, schedule, optimizer)
    with pytest.raises(ValueError, match="attaching to a stage module needs optimizer="):
        vpipe.attach(model, log_file=str(tmp_path / "run.log"), **OPTIONS)
    assert _snapshot(model, stage, schedule, optimizer) == before
