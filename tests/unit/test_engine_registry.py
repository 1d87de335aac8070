"""The engine registry: which adapter a target gets, and what registering one takes."""

from __future__ import annotations

import pytest
from torch import nn

from vpipe.engines import Capabilities, Engine, EngineKind, engine_for, register_engine, registered_engines
from vpipe.engines.registry import unregister_engine
from vpipe.schedules.pipedream import SchedulePipeDream


def _first_accepting(target: object) -> type[Engine]:
    return next(engine for engine in registered_engines() if engine.accepts(target))


def test_each_target_goes_to_its_engine_pipedream_before_torchs_schedules_and_the_module_last():
    from vpipe.schedules.pipedream_2bw import SchedulePipeDream2BW
    from vpipe.schedules.wpipe import ScheduleWPipe

    kinds = [engine.kind for engine in registered_engines()]
    # 2BW is a SchedulePipeDream too: asked before PipeDream's adapter;
    # WPipe a PipelineScheduleMulti: before torch's
    assert kinds == [EngineKind.WPIPE, EngineKind.PIPEDREAM_2BW, EngineKind.PIPEDREAM, EngineKind.DEEPSPEED,
                     EngineKind.TORCH_MULTI, EngineKind.TORCH_SINGLE, EngineKind.MODULE]
    assert _first_accepting(SchedulePipeDream.__new__(SchedulePipeDream)).kind is EngineKind.PIPEDREAM
    assert (
        _first_accepting(SchedulePipeDream2BW.__new__(SchedulePipeDream2BW)).kind is EngineKind.PIPEDREAM_2BW
    )
    assert _first_accepting(ScheduleWPipe.__new__(ScheduleWPipe)).kind is EngineKind.WPIPE
    assert _first_accepting(nn.Linear(2, 2)).kind is EngineKind.MODULE


def test_a_registered_engine_is_asked_first_and_forgotten_when_unregistered():
    class Wrapped(nn.Module):
        pass

    class WrappedEngine(Engine):
        @classmethod
        def accepts(cls, target: object) -> bool:
            return isinstance(target, Wrapped)

    register_engine(WrappedEngine)
    try:
        assert registered_engines()[0] is WrappedEngine and _first_accepting(Wrapped()) is WrappedEngine
        assert _first_accepting(nn.Linear(2, 2)).kind is EngineKind.MODULE
    finally:
        unregister_engine(WrappedEngine)
    assert WrappedEngine not in registered_engines()


def test_bad_registrations_and_unknown_targets_fail_in_one_line():
    with pytest.raises(TypeError, match=r"^register_engine takes a subclass of vpipe.engines.Engine, got 3$"):
        register_engine(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError,
                       match=r"^vpipe.attach takes a pipelining schedule, a DeepSpeed PipelineEngine or "
                                        r"a stage module, got object$"):
        engine_for(object())


def test_capabilities_say_why_not():
    assert Capabilities(moves=None, edits="a traced GraphModule stage").can_move
    assert not Capabilities(moves=None, edits="a traced GraphModule stage").can_edit
