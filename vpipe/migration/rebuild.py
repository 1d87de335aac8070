"""Re-running torch pipelining's shape inference after a boundary activation changed.

torch's ``PipelineStage`` sizes its receive buffers from a metadata pass that runs on the
first ``step()`` and chains through every stage. When a migration changes the shape, dtype
or arity of a boundary activation, every rank must redo that pass at the same step (a
rebuild on two ranks only would hang the chain). Resetting the schedule's "initialized"
flags and the stage's derived state makes the next ``step()`` redo it, on the very
objects the user's trainer holds.
"""

from __future__ import annotations

from typing import Any

__all__ = ["reset_shape_inference", "check_schedule_api"]

_SCHEDULE_FLAGS = ("_stage_forward_initialized", "_stage_backward_initialized")
_STAGE_STATE = ("args_recv_info", "grad_recv_info", "act_send_info", "grad_send_info", "fwd_cache", "bwd_cache")
_OLD_STAGE_META = ("inputs_meta", "_outputs_meta")


def check_schedule_api(schedule: Any) -> None:
    """Fail early (at attach) if this torch's pipelining internals differ from what vpipe edits."""
    stage = getattr(schedule, "_stage", None)
    missing = [f for f in _SCHEDULE_FLAGS if not hasattr(schedule, f)]
    if stage is None:
        missing.append("_stage")
    else:
        missing += [f"stage.{a}" for a in _STAGE_STATE if not hasattr(stage, a)]
        missing += [f"stage.{m}" for m in ("forward_one_chunk", "backward_one_chunk", "submod") if not hasattr(stage, m)]
    if missing:
        import torch

        raise RuntimeError(
            f"vpipe cannot attach to {type(schedule).__name__} with torch {torch.__version__}: its pipelining API "
            f"lacks {', '.join(missing)} (vpipe supports torch 2.6-2.14 single-stage schedules)"
        )


def reset_shape_inference(schedule: Any) -> None:
    """Make the schedule's next ``step()`` redo P2P warm-up and metadata inference."""
    check_schedule_api(schedule)
    for flag in _SCHEDULE_FLAGS:
        setattr(schedule, flag, False)
    stage = schedule._stage
    stage.args_recv_info.clear()
    stage.grad_recv_info.clear()
    stage.act_send_info.clear()
    stage.grad_send_info = None
    # torch <= 2.11 keeps the inferred shapes on the stage and infers again only while they are unset
    for name in _OLD_STAGE_META:
        if hasattr(stage, name):
            setattr(stage, name, None)
