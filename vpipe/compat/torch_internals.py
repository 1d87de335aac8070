"""torch's private parts that vpipe uses, outside ``torch.distributed``: each behind a named function.

Every accessor says what it reaches and the torch versions it was checked against. The
project supports torch >= 2.11, < 2.14 (``scripts/setup``); "checked: 2.13.0" means read
against that release's source and run by the suite on it. "Fallback" means vpipe already
copes with the name missing (and says how). The ones on a hot path (once per layer call
or saved tensor) are torch's own callables bound to a public name, not wrapped again.

What each accessor reaches, by torch area (checked: 2.13.0 for all; fallbacks named):

- nn.Module: :func:`child_modules` (``module._modules``), :func:`parameter_table` and
  :func:`buffer_table` (``._parameters``, ``._buffers``), :data:`MODULE_INTERNALS` and
  :func:`call_hook_tables` (``nn.Module().__dict__``'s names, the hook dicts), :func:`hooks_of`
  (``module._forward_hooks`` and the other hook dicts);
- autograd: :data:`current_graph_task_id`, :data:`current_autograd_node`,
  :data:`will_engine_execute_node` (``torch._C``'s functions of those names with a leading
  underscore), :func:`queue_engine_callback` (``Variable._execution_engine``),
  :func:`view_base` (``tensor._base``), :data:`neg_view` (``torch._neg_view``);
- storage: :func:`storage_weak_ref`, :func:`weak_ref_expired`, :func:`free_weak_ref`
  (``UntypedStorage._weak_ref``, ``._expired``, ``._free_weak_ref``);
- copies: :data:`foreach_copy_` (``torch._foreach_copy_``), :func:`raw_stream_getter`
  (``torch._C._cuda_getCurrentRawStream``; fallback: ``torch.cuda.current_stream``);
- profiler: :data:`profiler_enabled` (``torch.autograd._profiler_enabled``);
- dynamo: :func:`compiled_call`, :func:`set_compiled_call`, :func:`call_impl`
  (``module._compiled_call_impl``, ``._call_impl``), :func:`compile_wrapper_inner`
  (``OptimizedModule._orig_mod``);
- checkpoint: :data:`get_autocast_kwargs`, :data:`get_device_module`,
  :data:`infer_device_type` (``torch.utils.checkpoint``'s names with a leading underscore),
  :func:`device_initialized` (``torch.cuda._initialized``; fallback: not initialised),
  :func:`active_device_context` (``torch.overrides._get_current_function_mode_stack``,
  ``torch.utils._device.DeviceContext``; fallback: none);
- batch norm: :data:`BatchNormBase` (``torch.nn.modules.batchnorm._BatchNorm``, the base whose forward
  BatchNorm1d/2d/3d share, the one a deferred BatchNorm replaces);
- functional collectives: :func:`pending_collective_elem` (``_functional_collectives.AsyncCollectiveTensor``
  and its ``elem``).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import _get_autocast_kwargs, _get_device_module, _infer_device_type

try:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
except ImportError:  # pragma: no cover - every supported torch has both
    _get_current_function_mode_stack = None  # type: ignore[assignment]

__all__ = ["child_modules", "parameter_table", "buffer_table", "MODULE_INTERNALS", "call_hook_tables",
           "HOOK_KINDS",
           "hooks_of", "current_graph_task_id", "current_autograd_node", "will_engine_execute_node",
           "queue_engine_callback", "view_base", "neg_view", "storage_weak_ref", "weak_ref_expired",
           "free_weak_ref",
           "foreach_copy_", "raw_stream_getter", "profiler_enabled", "compiled_call", "set_compiled_call",
           "call_impl", "compile_wrapper_inner", "get_autocast_kwargs", "get_device_module",
           "infer_device_type",
           "device_initialized", "active_device_context", "BatchNormBase"]


# ---------------------------------------------------------------------- nn.Module
def child_modules(module: nn.Module) -> dict[str, nn.Module | None]:
    """The live dict of ``module``'s children (``_modules``; checked: 2.13.0), entries set to None included.

    Edit it to change a container in place: the object and its type stay, so a forward that
    iterates the container keeps working. ``named_children()`` is no substitute: it skips None
    entries and returns copies.
    """
    return module._modules


def parameter_table(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The live dict of the parameters ``module`` itself registered (``_parameters``; checked: 2.13.0):
    ``functional_call`` swaps tensors in this very dict."""
    return module._parameters


def buffer_table(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The live dict of the buffers ``module`` itself registered (``_buffers``; checked: 2.13.0)."""
    return module._buffers


MODULE_INTERNALS: frozenset[str] = (frozenset(nn.Module().__dict__) - {"training"}) | {"_compiled_call_impl"}
"""What torch keeps on every module instance besides ``training`` (its tables of
children, tensors and hooks), and the compiled call ``Module.compile`` sets: torch's,
never one of a block's own attributes (checked: 2.13.0)."""

_CALL_HOOKS = tuple(sorted(name for name in MODULE_INTERNALS
                           if name.endswith(("hooks", "hooks_with_kwargs", "hooks_always_called"))
                           and ("forward" in name or "backward" in name)))


def call_hook_tables(module: nn.Module) -> list[dict[Any, Any]]:
    """``module``'s own tables of forward and backward hooks (and their flags), those it has
    (checked: 2.13.0): what a clone gets empty, so hooks stay with the module they were put on."""
    return [table for name in _CALL_HOOKS if (table := module.__dict__.get(name)) is not None]


HOOK_KINDS = ("forward pre", "forward", "backward pre", "backward",
              "state dict", "state dict pre", "load state dict pre", "load state dict post")


def hooks_of(module: nn.Module, kind: str) -> Mapping[Any, Callable[..., Any]]:
    """The hooks of one of :data:`HOOK_KINDS` registered on ``module`` itself, by handle id (checked: 2.13.0:
    ``register_<kind>_hook`` keeps them in ``module._<kind>_hooks``); empty when it has none."""
    if kind not in HOOK_KINDS:
        raise ValueError(f"unknown hook kind {kind!r}; one of {HOOK_KINDS}")
    return module.__dict__.get(f"_{kind.replace(' ', '_')}_hooks") or {}


# ---------------------------------------------------------------------- autograd
current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""The id of the autograd graph task (one backward pass) running on
this thread, -1 outside one (checked: 2.13.0)."""

current_autograd_node: Callable[[], Any] = torch._C._current_autograd_node
"""The autograd node whose backward runs on this thread now, or None (checked: 2.13.0)."""

will_engine_execute_node: Callable[[Any], bool] = torch._C._will_engine_execute_node
"""Whether the running backward pass will execute a node; RuntimeError for a node of another pass
(checked: 2.13.0)."""


def queue_engine_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends (``Variable._execution_engine.queue_callback``;
    checked: 2.13.0). Only inside a backward pass."""
    Variable._execution_engine.queue_callback(callback)


# ``view_base(t)``: the tensor ``t`` is a view of, None for a tensor that owns its storage (``t._base``;
# checked: 2.13.0). Called per saved tensor: bound without a Python frame.
view_base: Callable[[torch.Tensor], torch.Tensor | None] = operator.attrgetter("_base")


neg_view: Callable[[torch.Tensor], torch.Tensor] = torch._neg_view
"""A lazily negated view of a tensor, as autograd saves one (``torch._neg_view``; checked: 2.13.0)."""


# ---------------------------------------------------------------------- storage
def storage_weak_ref(storage: torch.UntypedStorage) -> int:
    """A weak reference to ``storage`` (an integer handle; release it with :func:`free_weak_ref`;
    ``UntypedStorage._weak_ref``; checked: 2.13.0)."""
    return storage._weak_ref()  # type: ignore[return-value]  # an int (torch's stub says a storage)


# whether the storage of a weak reference is gone (``UntypedStorage._expired``; checked: 2.13.0): torch's own
weak_ref_expired: Callable[[int], bool] = torch.UntypedStorage._expired  # type: ignore[assignment]


# release a weak reference (``UntypedStorage._free_weak_ref``; checked: 2.13.0): torch's own
free_weak_ref: Callable[[int], None] = torch.UntypedStorage._free_weak_ref


# ---------------------------------------------------------------------- copies
foreach_copy_: Callable[..., None] = torch._foreach_copy_
"""``foreach_copy_(dsts, srcs, non_blocking=False)``: a batch of copies in one dispatch, the per-pair loop in
C++ (``torch._foreach_copy_``; checked: 2.13.0)."""


def raw_stream_getter() -> Callable[[int], int] | None:
    """The C call giving a CUDA device's current stream as a raw handle, about 20 us cheaper than
    ``torch.cuda.current_stream()`` (``torch._C._cuda_getCurrentRawStream``; checked: 2.13.0). None where this
    build has none: the caller falls back to ``torch.cuda.current_stream``."""
    return getattr(torch._C, "_cuda_getCurrentRawStream", None)


# ---------------------------------------------------------------------- profiler
profiler_enabled: Callable[[], bool] = torch.autograd._profiler_enabled
"""Whether torch's profiler is recording on this thread (``torch.autograd._profiler_enabled``;
checked: 2.13.0)."""


# ---------------------------------------------------------------------- dynamo (torch.compile)
def compiled_call(module: nn.Module) -> Any | None:
    """What ``module.compile()`` compiled, the module's whole call, or None
    (``module._compiled_call_impl`` on the instance; checked: 2.13.0)."""
    return module.__dict__.get("_compiled_call_impl")


def set_compiled_call(module: nn.Module, call: Any | None) -> None:
    """Make ``module`` run ``call`` instead of its own call (None: its own; checked: 2.13.0)."""
    module._compiled_call_impl = call


def call_impl(module: nn.Module) -> Callable[..., Any]:
    """``module``'s own call, hooks included, as ``module.compile()`` compiles it (``module._call_impl``;
    checked: 2.13.0)."""
    return module._call_impl


def compile_wrapper_inner(block: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile(block)`` wrapper (``OptimizedModule``) compiles (its ``_orig_mod`` child),
    or None for any other module (checked: 2.13.0)."""
    inner = block.__dict__.get("_modules", {}).get("_orig_mod")
    return inner if inner is not None and hasattr(block, "dynamo_ctx") else None


# ---------------------------------------------------------------------- torch.utils.checkpoint's helpers
get_autocast_kwargs: Callable[[str], tuple[dict[str, Any] | None, dict[str, Any]]] = _get_autocast_kwargs
"""The (device, CPU) autocast arguments in effect, as checkpointing restores them (checked: 2.13.0)."""

get_device_module: Callable[..., Any] = _get_device_module
"""``torch.cuda`` (or another device type's module) by device type name (checked: 2.13.0)."""

infer_device_type: Callable[..., str] = _infer_device_type
"""The device type whose RNG a call on these arguments draws from,
as checkpointing decides (checked: 2.13.0)."""


def device_initialized(device_module: Any) -> bool:
    """Whether a device module (``torch.cuda``) was initialised in this process, so its RNG state can be read
    without initialising it (``_initialized``; checked: 2.13.0; a module without the flag counts as not)."""
    return bool(getattr(device_module, "_initialized", False))


def active_device_context() -> contextlib.AbstractContextManager[Any] | None:
    """The innermost ``with torch.device(...)`` context active now, or None (torch's function-mode stack;
    checked: 2.13.0; without that stack, None)."""
    if _get_current_function_mode_stack is None:  # pragma: no cover - every supported torch has it
        return None
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode
    return None


# ---------------------------------------------------------------------- batch norm
# BatchNorm1d/2d/3d's common base (their forward, running statistics, ``_check_input_dim``); SyncBatchNorm and
# the lazy ones derive from it too (checked: 2.13.0)
BatchNormBase = _BatchNorm


def pending_collective_elem(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor inside a functional collective's result not yet waited on (``AsyncCollectiveTensor``, what a
    ``RowwiseParallel`` output's all-reduce returns), else None. Such a wrapper has no storage of its own:
    asking for its data pointer raises, so vpipe's accounting reads the memory it wraps. Checked: 2.13.0."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor  # (DTensor imported it)

    return t.elem if isinstance(t, AsyncCollectiveTensor) else None
