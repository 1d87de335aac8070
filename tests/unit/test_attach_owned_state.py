"""What an attach sets up in the process is its own: a second attach, or a detach, touches only its own.

Compiled blocks hoisted, run logs, timeline windows, the planner a
daemon plans with, and the settings read once.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import vpipe
from vpipe import log as run_log
from vpipe import settings as settings_module
from vpipe import timeline
from vpipe.control.daemon import PlannerDaemon
from vpipe.control.planner_function import load_planner
from vpipe.log import RunLog, decision, read_log, step_record
from vpipe.planner import DEFAULT_PLANNER
from vpipe.planner.online import OnlinePlanner
from vpipe.stage.compiled import compile_like, hoist_compiled, hoisting_factory


def _compiled_block() -> nn.Module:
    block = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    block.compile(backend="eager")
    return block


def _hoisted(block: nn.Module) -> bool:
    return "forward" in block.__dict__ and block._compiled_call_impl is None


def test_undoing_one_attachs_hoisting_leaves_the_others_blocks_hoisted():
    mine, theirs = _compiled_block(), _compiled_block()
    first, second = hoist_compiled([mine]), hoist_compiled([theirs])
    assert len(first) == len(second) == 1 and _hoisted(mine) and _hoisted(theirs)
    assert len(hoist_compiled([mine])) == 0  # hoisted once, whoever asks
    clone = _compiled_block()
    clone._compiled_call_impl = None
    compile_like(theirs, clone)  # a block built for a move joins its donor's attach
    second.undo()
    assert _hoisted(mine) and not _hoisted(theirs) and not _hoisted(clone)
    assert theirs._compiled_call_impl is not None and "forward" not in theirs.__dict__  # compiled whole again
    first.undo()
    assert not _hoisted(mine)


def test_a_block_the_layer_factory_compiles_in_place_joins_the_attachs_hoisting():
    """Found by the fuzzer (seed 230): vp.add_layers of a block its factory
    compiled in place left the block's whole call compiled, so a recompute replayed
    its eager forward against the compiled call's saved tensors."""
    hoisted = hoist_compiled([_compiled_block()])
    factory = hoisting_factory(lambda layer_id, spec: _compiled_block(), hoisted)
    added = factory(8, {})
    assert _hoisted(added) and len(hoisted) == 2
    hoisted.undo()  # detach: compiled whole again, as the trainer's factory made it
    assert not _hoisted(added) and added._compiled_call_impl is not None
    assert hoisting_factory(None, hoisted) is None


def test_two_run_logs_are_independent_and_the_commands_configuration_leaves_them_alone(tmp_path):
    a, b = RunLog(tmp_path / "a.log", rank=0), RunLog(tmp_path / "b.log", rank=0)
    try:
        decision("plan", "both")  # logging is the process's: every open run log takes every record
        step_record(1, 0.1)
        run_log.configure(None)  # the command's logging: not an attach's run log
        b.close()
        decision("plan", "a only")
        step_record(2, 0.2)
        again = RunLog(tmp_path / "a.log", rank=0)  # a second owner of one file shares its handler
        assert again.handler is a.handler
        again.close()
        decision("plan", "a still")
    finally:
        a.close()
        b.close()
    decision("plan", "nowhere")
    msgs = {name: [r["msg"] for r in read_log(tmp_path / name)] for name in ("a.log", "b.log")}
    assert msgs == {"a.log": ["both", "step 1 took 0.1000 s", "a only", "step 2 took 0.2000 s", "a still"],
                    "b.log": ["both", "step 1 took 0.1000 s"]}
    assert not [h for h in logging.getLogger("vpipe").handlers if isinstance(h, run_log.RunLogHandler)]


def test_stopping_one_timeline_window_leaves_the_other_recording(tmp_path):
    first = timeline.start(0, tmp_path / "first", [0])
    second = timeline.start(1, tmp_path / "second", [1])
    try:
        with timeline.span("vpipe.forward", timeline.COMPUTE, 0, mb=0):
            pass
        assert timeline.stop(second) == tmp_path / "second" / "timeline-rank1.json"
        assert timeline.recording(first) and not timeline.recording(second) and timeline.recording()
        with timeline.span("vpipe.backward", timeline.COMPUTE, 0, mb=0):
            pass
    finally:
        written = timeline.stop(first)
    assert not timeline.recording() and timeline.stop(first) is None
    assert [e["name"] for e in timeline.load_rank_file(written).events] == ["vpipe.forward", "vpipe.backward"]
    assert [e["name"]
            for e in timeline.load_rank_file(tmp_path / "second" / "timeline-rank1.json").events] == \
        ["vpipe.forward"]


def test_each_daemon_plans_with_a_planner_of_its_own():
    entry = load_planner(DEFAULT_PLANNER)
    daemons = [PlannerDaemon("tcp://127.0.0.1:9", entry, curve=None) for _ in range(2)]
    try:
        assert all(isinstance(d.planner, OnlinePlanner) for d in daemons)
        assert daemons[0].planner is not daemons[1].planner
    finally:
        for d in daemons:
            d.close()
    with pytest.raises(TypeError, match="makes planners, one per daemon"):
        entry([], None)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _pipeline() -> tuple[nn.Module, ScheduleGPipe]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].compile(backend="eager")
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    return model, ScheduleGPipe(stage, 2, loss_fn=lambda out, target: ((out - target) ** 2).mean())


def test_attach_reads_the_settings_once_and_a_detach_undoes_only_its_own(one_rank, tmp_path, monkeypatch):
    reads = []
    real = settings_module.Settings.read.__func__  # type: ignore[attr-defined]

    def counted(cls, environ=None):
        reads.append(environ)
        return real(cls, environ)

    monkeypatch.setattr(settings_module.Settings, "read", classmethod(counted))
    monkeypatch.setenv("VPIPE_TRACE_DIR", str(tmp_path / "trace-a"))
    model_a, schedule_a = _pipeline()
    model_b, schedule_b = _pipeline()
    a = vpipe.attach(schedule_a, optimizer=torch.optim.SGD(model_a.parameters(), lr=0.1), planning=False,
                     trace_steps=(0, 3), log_file=str(tmp_path / "a.log"))
    assert len(reads) == 1 and a.config.trace_dir == str(tmp_path / "trace-a")  # one read, handed on
    b = vpipe.attach(schedule_b, optimizer=torch.optim.SGD(model_b.parameters(), lr=0.1), planning=False,
                     trace_steps=(0, 1), trace_dir=str(tmp_path / "trace-b"),
                     log_file=str(tmp_path / "b.log"))
    assert len(reads) == 1 and b.settings is a.settings  # the process's settings, read once for both
    try:
        for _ in range(2):
            schedule_a.step(torch.randn(4, 4), target=torch.randn(4, 4))
            schedule_b.step(torch.randn(4, 4), target=torch.randn(4, 4))
        b.detach()
        assert _hoisted(model_a[0]) and not _hoisted(model_b[0])  # a's blocks stay as a made them
        assert a.driver.trace is not None and a.driver.trace.recording  # and its window records on
        schedule_a.step(torch.randn(4, 4), target=torch.randn(4, 4))
    finally:
        a.detach()
        b.detach()
    assert len(reads) == 1
    assert (tmp_path / "trace-a" / "timeline-rank0.json").exists() and (tmp_path / "trace-b").exists()
    events = {name: [r.get("event") for r in read_log(tmp_path / name)
                     if r.get("event") in ("attached", "detached")]
              for name in ("a.log", "b.log")}
    assert events == {"a.log": ["attached", "attached", "detached", "detached"],
                      "b.log": ["attached", "detached"]}
