"""``torch.distributed``'s private parts that vpipe uses (pipelining,
FSDP2, c10d), each behind a named function.

Apart from :mod:`.torch_internals` because importing pipelining costs about a second,
which the spawning parent and the torch-free commands never pay. The project supports
torch >= 2.11, < 2.14 (``scripts/setup``); "checked: 2.13.0" means read against that
release's source and run by the suite on it; "fallback" means vpipe copes with the name
missing (and says how). What vpipe checks at attach, so a torch that differs fails there
and nowhere later: :func:`missing_schedule_internals` and :func:`fsdp_internals_missing`.
:class:`~vpipe.schedules.pipedream.SchedulePipeDream` subclasses ``PipelineScheduleSingle``
and uses its protected members through ``self`` (``_stage``, ``_n_microbatches``,
``_split_inputs``, ``_check_inputs``, ``_compute_loss``, ``_stage_forward_initialized``;
checked: 2.13.0).

What each accessor reaches, by area (checked: 2.13.0 for all; fallbacks named):

- pipelining: :func:`single_stage`, :func:`schedule_stages`, :func:`n_microbatches`
  (``schedule._stage``, ``._stages``, ``._n_microbatches``); :func:`missing_schedule_internals`,
  :func:`mark_stages_uninitialized` (``schedule._stage(s)_{forward,backward}_initialized``);
  :func:`forget_inferred_meta` (torch 2.11's ``stage.inputs_meta``, ``._outputs_meta``;
  newer torch lacks them: skipped); :func:`missing_stage_state`, :func:`reset_stage_shapes` (a stage's
  ``args_recv_info``, ``grad_recv_info``, ``act_send_info``, ``grad_send_info``); :func:`initialize_stage`
  (``PipelineScheduleSingle._initialize_stage``; 2.11's form takes no ``target``);
  :func:`wrap_shape_inference` (``stage._prepare_forward_infra``, ``._prepare_backward_infra``;
  fallback: not wrapped); :func:`batch_p2p_wait`, :func:`set_batch_p2p_wait`
  (``schedules._wait_batch_p2p``; fallback: waits untimed); :data:`get_schedule_ops`
  (``pipelining._schedule_visualizer``; fallback: None); :data:`PipelineScheduleRuntime`,
  :data:`PipelineStageBase` (``schedules._PipelineScheduleRuntime``, ``stage._PipelineStageBase``);
- FSDP2: :data:`COMPOSABLE_KEYS`, :func:`composable_apis` (``_composable.contract``'s keys and
  ``_get_registry``), :func:`is_fsdp1` (``_fsdp_wrapped_module``), :func:`fsdp_state`
  (``module._get_fsdp_state()``), :func:`fsdp_param_groups`, :func:`fsdp_mp_policy`
  (``state._fsdp_param_groups``, ``._mp_policy``), :func:`drop_fsdp_prefetch`,
  :func:`forget_fsdp_root` (``state._states_to_*_prefetch``, ``._is_root``, ``._state_ctx``,
  ``group._module_fqn``);
- tensor parallelism: :func:`is_strided_shard` (FSDP2's dp placement over a tp shard),
  :func:`is_parallel_style_hook` (the hooks ``distribute_module`` and the
  parallel styles register are functions defined in ``torch.distributed.tensor._api`` and
  ``.parallel.style``; fallback: none is recognised, so a clone of a tensor-parallel block
  would lack them: the move tests fail);
- c10d: :func:`default_store` (``distributed_c10d._get_default_store``; fallback: None),
  :func:`group_timeout_s` (a group's backends' ``options._timeout``; fallback: torch's default
  timeout), :func:`set_group_timeout` (``distributed_c10d._set_pg_timeout``; fallback: not set, a
  collective then waits the group's own timeout).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from functools import wraps
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as schedules
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, _get_registry
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _PipelineScheduleRuntime
from torch.distributed.pipelining.stage import _PipelineStageBase

try:  # torch's schedule visualizer builds a schedule's action lists without processes
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops as _get_schedule_ops
except ImportError:  # an older torch
    _get_schedule_ops = None  # type: ignore[assignment]

__all__ = ["single_stage", "schedule_stages", "n_microbatches", "missing_schedule_internals",
           "mark_stages_uninitialized", "forget_inferred_meta", "missing_stage_state", "reset_stage_shapes",
           "initialize_stage", "wrap_shape_inference", "wrap_inference_loss",
           "batch_p2p_wait", "set_batch_p2p_wait", "get_schedule_ops", "PipelineScheduleRuntime",
           "PipelineStageBase",
           "COMPOSABLE_KEYS", "composable_apis", "is_fsdp1", "fsdp_state", "fsdp_internals_missing",
           "fsdp_param_groups", "fsdp_mp_policy", "drop_fsdp_prefetch", "forget_fsdp_root",
           "is_parallel_style_hook",
           "is_strided_shard", "default_store", "group_timeout_s", "set_group_timeout"]


# ---------------------------------------------------------------------- pipelining
PipelineScheduleRuntime = _PipelineScheduleRuntime
"""The schedule that runs an action list (every multi-stage schedule is one; checked: 2.13.0)."""

PipelineStageBase = _PipelineStageBase
"""The base class of torch's pipeline stages (checked: 2.13.0)."""

get_schedule_ops: Callable[..., Any] | None = _get_schedule_ops
"""``get_schedule_ops(schedule_class, pp_degree, num_microbatches, ...)``: a schedule's action lists built
without processes (torch's schedule visualizer; checked: 2.13.0); None in a torch without it."""

_SINGLE_FLAGS = ("_stage_forward_initialized", "_stage_backward_initialized")
_MULTI_FLAGS = ("_stages_forward_initialized", "_stages_backward_initialized")
_OLD_STAGE_META = ("inputs_meta", "_outputs_meta")
_STAGE_STATE = ("args_recv_info", "grad_recv_info", "act_send_info", "grad_send_info", "fwd_cache",
                "bwd_cache")
_STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "submod")
_INFRA = ("_prepare_forward_infra", "_prepare_backward_infra")
_INITIALIZE_TAKES_TARGET = "target" in inspect.signature(PipelineScheduleSingle._initialize_stage).parameters


def _multi(schedule: Any) -> bool:
    return hasattr(schedule, "_stages")


def single_stage(schedule: Any) -> Any:
    """The stage a single-stage schedule runs (``schedule._stage``; checked: 2.13.0)."""
    return schedule._stage


def schedule_stages(schedule: Any) -> list[Any]:
    """The stages a schedule runs on this rank: a multi-stage schedule's ``_stages``, a single-stage one's
    ``_stage`` (checked: 2.13.0); empty where the schedule holds neither."""
    if _multi(schedule):
        return list(schedule._stages)
    stage = getattr(schedule, "_stage", None)
    return [] if stage is None else [stage]


def n_microbatches(schedule: Any) -> int:
    """The micro-batches a schedule splits each step into
    (``_n_microbatches``; checked: 2.13.0; 1 without)."""
    return int(getattr(schedule, "_n_microbatches", 1))


def missing_schedule_internals(schedule: Any) -> list[str]:
    """The private names a schedule lacks that vpipe reads or resets (checked: 2.13.0): the stage(s), and the
    flags that make its next ``step()`` infer shapes again."""
    multi = _multi(schedule)
    missing = [f for f in (_MULTI_FLAGS if multi else _SINGLE_FLAGS) if not hasattr(schedule, f)]
    if not schedule_stages(schedule):
        missing.append("_stages" if multi else "_stage")
    return missing


def mark_stages_uninitialized(schedule: Any) -> None:
    """Make the schedule's next ``step()`` run its P2P warm-up and shape inference again (checked: 2.13.0)."""
    for flag in _MULTI_FLAGS if _multi(schedule) else _SINGLE_FLAGS:
        setattr(schedule, flag, False)


def forget_inferred_meta(stage: Any) -> None:
    """Clear the shapes torch <= 2.11 keeps on a stage (it infers again only while they are unset); newer
    torch has no such fields and this does nothing."""
    for name in _OLD_STAGE_META:
        if hasattr(stage, name):
            setattr(stage, name, None)


def missing_stage_state(stage: Any) -> list[str]:
    """The fields and methods a pipeline stage lacks that vpipe wraps or resets (checked: 2.13.0): the
    p2p metadata :func:`reset_stage_shapes` clears, the chunk methods the tensor managers wrap."""
    return [f"stage.{a}" for a in (*_STAGE_STATE, *_STAGE_METHODS) if not hasattr(stage, a)]


def reset_stage_shapes(schedule: Any) -> None:
    """Make the schedule's next ``step()`` redo P2P warm-up and shape inference on every stage of this
    rank: its flags unset, each stage's receive and send metadata (``args_recv_info``, ``grad_recv_info``,
    ``act_send_info``, ``grad_send_info``) cleared, and torch 2.11's inferred shapes forgotten (checked:
    2.13.0; :func:`missing_stage_state` and :func:`missing_schedule_internals` check the names at attach)."""
    mark_stages_uninitialized(schedule)
    for stage in schedule_stages(schedule):
        stage.args_recv_info.clear()
        stage.grad_recv_info.clear()
        stage.act_send_info.clear()
        stage.grad_send_info = None
        forget_inferred_meta(stage)


def initialize_stage(schedule: PipelineScheduleSingle, args: tuple[Any, ...], kwargs: dict[str, Any],
                     target: Any) -> None:
    """Run a single-stage schedule's first-step shape inference (``_initialize_stage``; checked: 2.13.0, which
    takes the target; 2.11 infers from the inputs alone)."""
    if _INITIALIZE_TAKES_TARGET:
        schedule._initialize_stage(args, kwargs, target)
    else:  # pragma: no cover - torch 2.11
        schedule._initialize_stage(args, kwargs)


def wrap_shape_inference(stage: Any,
                         around: Callable[[], AbstractContextManager[Any]]) -> Callable[[], None] | None:
    """Run a stage's shape-inference calls inside ``around()``; returns an undo, or None where this torch has
    other ones (``_prepare_forward_infra``, ``_prepare_backward_infra``; checked: 2.13.0).

    The wrappers are instance attributes over torch's methods (or over a wrapper already there, the
    trainer's own too, which the undo puts back); the stage is otherwise untouched.
    """
    names = [n for n in _INFRA if callable(getattr(stage, n, None))]
    if len(names) != len(_INFRA):
        return None
    undos = []
    for name in names:
        original = getattr(stage, name)

        def inside(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            with around():
                return _original(*args, **kwargs)

        undos.append(_set_wrapper(stage, name, wraps(original)(inside)))

    def undo() -> None:
        for one in undos:
            one()

    return undo


def _set_wrapper(stage: Any, name: str, wrapper: Callable[..., Any]) -> Callable[[], None]:
    """Put ``wrapper`` on ``stage`` as the instance attribute ``name``; the undo puts back what was there
    (nothing, or an earlier wrapper) while ``wrapper`` is still the one on top."""
    before = stage.__dict__.get(name)
    stage.__dict__[name] = wrapper

    def undo() -> None:
        if stage.__dict__.get(name) is not wrapper:  # wrapped again since, by someone else: leave it
            return
        if before is None:
            del stage.__dict__[name]
        else:
            stage.__dict__[name] = before

    return undo


def wrap_inference_loss(stage: Any, choose: Callable[[Any], Any]) -> Callable[[], None] | None:
    """Have the last stage's backward shape inference call ``choose(loss_fn)`` in place of the schedule's
    loss; returns an undo, or None where this torch passes the loss otherwise (``_prepare_backward_infra``'s
    ``loss_fn`` keyword; checked: 2.13.0)."""
    original = getattr(stage, "_prepare_backward_infra", None)
    if not callable(original) or "loss_fn" not in inspect.signature(original).parameters:
        return None

    def infer(*args: Any, **kwargs: Any) -> Any:
        if "loss_fn" in kwargs:
            kwargs["loss_fn"] = choose(kwargs["loss_fn"])
        return original(*args, **kwargs)

    return _set_wrapper(stage, "_prepare_backward_infra", wraps(original)(infer))


def batch_p2p_wait() -> Callable[[Any], Any] | None:
    """The function torch's schedules wait for a batch of sends and receives with
    (``schedules._wait_batch_p2p``; checked: 2.13.0); None where they wait otherwise."""
    return getattr(schedules, "_wait_batch_p2p", None)


def set_batch_p2p_wait(wait: Callable[[Any], Any]) -> None:
    """Make torch's schedules wait for their sends and receives with ``wait`` (see :func:`batch_p2p_wait`)."""
    schedules._wait_batch_p2p = wait  # type: ignore[assignment]


# ----------------------------------------------------------------- FSDP2 (fully_shard) and the composable API
COMPOSABLE_KEYS: frozenset[str] = frozenset({STATE_KEY, REGISTRY_KEY})
"""The entries torch's composable API (``fully_shard``, ``replicate``) adds to a module's ``__dict__``: its
state, which a plain copy of the module leaves behind (checked: 2.13.0)."""

_STATE_FIELDS = ("_is_root", "_state_ctx", "_fsdp_param_groups", "_states_to_forward_prefetch",
                 "_states_to_backward_prefetch", "_mp_policy")
_GROUP_FIELDS = ("mesh_info", "post_forward_mesh_info", "offload_policy", "_module_fqn")
_PREFETCH = ("_states_to_forward_prefetch", "_states_to_backward_prefetch")


def composable_apis(module: nn.Module) -> Sequence[str]:
    """The composable APIs applied to ``module`` (``"replicate"``, ``"fully_shard"``), by torch's registry
    (``_get_registry``; checked: 2.13.0)."""
    return list(_get_registry(module) or {})


def is_fsdp1(module: nn.Module) -> bool:
    """Whether ``module`` is FSDP1's ``FullyShardedDataParallel`` wrapper, or looks like one
    (``_fsdp_wrapped_module``; checked: 2.13.0)."""
    return type(module).__name__ == "FullyShardedDataParallel" or hasattr(module, "_fsdp_wrapped_module")


def fsdp_state(module: nn.Module) -> Any:
    """The FSDP2 state object of a module ``fully_shard`` was
    applied to (``_get_fsdp_state()``; checked: 2.13.0)."""
    return module._get_fsdp_state()  # type: ignore[operator]


def fsdp_internals_missing(state: Any) -> list[str]:
    """The fields of an FSDP2 state (and of its param groups, as ``group.<name>``) that vpipe reads or
    resets and this torch lacks (checked: 2.13.0: none)."""
    missing = [f for f in _STATE_FIELDS if not hasattr(state, f)]
    return missing + [f"group.{f}" for g in fsdp_param_groups(state) for f in _GROUP_FIELDS
                      if not hasattr(g, f)]


def fsdp_param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups, each with ``mesh_info``, ``post_forward_mesh_info`` and
    ``offload_policy`` (``_fsdp_param_groups``; checked: 2.13.0); empty where this torch lacks them."""
    return list(getattr(state, "_fsdp_param_groups", []))


def fsdp_mp_policy(state: Any) -> Any:
    """The mixed-precision policy ``fully_shard`` was given (``_mp_policy``; checked: 2.13.0)."""
    return state._mp_policy


def drop_fsdp_prefetch(state: Any, leaving: Any) -> None:
    """Take the state ``leaving`` out of ``state``'s explicit prefetch lists (``set_modules_to_*_prefetch``;
    ``_states_to_forward_prefetch``, ``_states_to_backward_prefetch``; checked: 2.13.0)."""
    for name in _PREFETCH:
        setattr(state, name, [s for s in getattr(state, name) if s is not leaving])


def forget_fsdp_root(root: Any) -> None:
    """Put an FSDP2 root state back to "not initialised": its next forward lists the states of its module tree
    again (``_is_root``, ``_state_ctx.all_states``, each group's ``_module_fqn``; checked: 2.13.0). Nothing
    happens before its first forward."""
    if root._is_root is None:
        return
    for state in list(root._state_ctx.all_states):
        state._is_root = None
        for group in state._fsdp_param_groups:
            group._module_fqn = None  # set again, with the block's new name
    root._state_ctx.all_states.clear()


# ---------------------------------------------------------------------- tensor parallelism
_PARALLEL_STYLE_MODULES = frozenset({"torch.distributed.tensor._api",
                                     "torch.distributed.tensor.parallel.style"})


def is_strided_shard(placement: Any) -> bool:
    """Whether ``placement`` is the ``_StridedShard`` FSDP2 puts on the dp dimension of a parameter that
    tensor parallelism sharded on the same dim first (checked: 2.13.0, where it is no ``Shard`` and its
    ``is_shard()`` is False; fallback: such parameters are not recognised, so their blocks do not move)."""
    return type(placement).__name__ == "_StridedShard"


def is_parallel_style_hook(fn: Any) -> bool:
    """Whether ``fn`` is a hook ``parallelize_module`` put on a module (through a parallel
    style or ``distribute_module``) to redistribute its inputs or outputs (checked:
    2.13.0: they are functions defined in those two modules, closing over the style and
    the mesh, and take the module they run on as an argument)."""
    return getattr(fn, "__module__", None) in _PARALLEL_STYLE_MODULES


# ---------------------------------------------------------------------- c10d
def default_store() -> Any | None:
    """The default process group's rendezvous store (``distributed_c10d._get_default_store``; checked:
    2.13.0); None where this torch has no such getter. Raises as torch does when no default group exists."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    return None if getter is None else getter()


def group_timeout_s(group: Any = None) -> float:
    """How long a collective of ``group`` (default: the default group, which
    ``init_process_group(timeout=...)`` set) may take, in seconds: the longest of its
    backends' ``options._timeout`` (checked: 2.13.0, gloo and NCCL; ``new_group()``
    without a timeout gets torch's default, 30 minutes, not the default group's).
    Fallback: torch's default timeout, also when no default group exists."""
    if group is None and not dist.is_initialized():
        return dist.distributed_c10d.default_pg_timeout.total_seconds()
    group = dist.distributed_c10d._get_default_group() if group is None else group
    seen = []
    for device in getattr(group, "_device_types", ()):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, timedelta):
            seen.append(timeout.total_seconds())
    return max(seen) if seen else dist.distributed_c10d.default_pg_timeout.total_seconds()


def set_group_timeout(group: Any, seconds: float) -> bool:
    """Bound ``group``'s next collectives and transfers by ``seconds``
    (``distributed_c10d._set_pg_timeout``, which sets its gloo or NCCL backends' timeout; checked: 2.13.0).
    Whether it could: False where this torch lacks it."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return False
    setter(timedelta(seconds=seconds), group)
    return True
