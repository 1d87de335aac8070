"""Blocks compiled in place (``block.compile(...)``): their hooks taken out of the compiled region.

``nn.Module.compile`` compiles the module's whole ``_call_impl``, hooks included, so dynamo
traces every forward hook on the block: vpipe's hooks (the tensor manager's, the monitors')
are Python bookkeeping dynamo cannot trace, and with ``fullgraph=True`` the first step
fails. While vpipe is attached, such a module runs its ``forward`` compiled instead, with
the very dynamo context the user's ``compile`` made (same backend, mode, options,
``fullgraph``, ``dynamic``), and its hooks, vpipe's and the user's, run around it in
Python. ``detach()`` compiles the whole call again, as ``block.compile`` does.

A block built on another stage for a move is compiled the same way as the block it is
cloned from (:func:`compile_like`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn

from vpipe.compat.torch_internals import call_impl, compiled_call, set_compiled_call

__all__ = ["hoist_compiled", "unhoist_all", "compile_like", "compiled_forwards", "dynamo_context"]

# every module whose forward vpipe compiles in place of its whole call -> the dynamo context
_HOISTED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def dynamo_context(compiled: Any) -> Any:
    """The dynamo context (backend and options) inside a function ``torch.compile`` returned, or None."""
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if type(value).__name__ == "OptimizeContext" or hasattr(value, "compiler_config"):
            return value
    return None


def _compile_forward(module: nn.Module, ctx: Any) -> None:
    module.forward = ctx(module.forward)  # the class's forward, bound to this module
    _HOISTED[module] = ctx


def hoist_compiled(blocks: Iterable[nn.Module]) -> int:
    """Compile the forward instead of the whole call of every module compiled in place; how many were."""
    count = 0
    for block in blocks:
        for module in block.modules():
            compiled = compiled_call(module)
            ctx = dynamo_context(compiled) if compiled is not None else None
            if ctx is None or module in _HOISTED or "forward" in module.__dict__:
                continue
            set_compiled_call(module, None)
            _compile_forward(module, ctx)
            count += 1
    return count


def unhoist_all() -> None:
    """Give every module vpipe compiled this way its compiled call back (what ``module.compile`` makes)."""
    for module, ctx in list(_HOISTED.items()):
        module.__dict__.pop("forward", None)
        set_compiled_call(module, ctx(call_impl(module)))
        del _HOISTED[module]


def compiled_forwards(donor: nn.Module) -> list[Any]:
    """The compiled forwards of ``donor``'s modules (a clone must not share them: they are bound to the donor)."""
    return [m.__dict__["forward"] for m in donor.modules() if m in _HOISTED and "forward" in m.__dict__]


def compile_like(donor: nn.Module, clone: nn.Module) -> None:
    """Compile ``clone``'s modules as ``donor``'s counterparts are (same place in the block, same context)."""
    for (_, original), (_, copy) in zip(donor.named_modules(), clone.named_modules()):
        ctx = _HOISTED.get(original)
        if ctx is not None:
            copy.__dict__.pop("forward", None)
            _compile_forward(copy, ctx)
