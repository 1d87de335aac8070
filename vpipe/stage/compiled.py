"""Blocks compiled in place (``block.compile(...)``): their hooks taken out of the compiled region.

``nn.Module.compile`` compiles the module's whole ``_call_impl``, hooks included, so dynamo
traces every forward hook on the block: vpipe's hooks (the tensor manager's, the monitors')
are Python bookkeeping dynamo cannot trace, and with ``fullgraph=True`` the first step
fails. While vpipe is attached, such a module runs its ``forward`` compiled instead, with
the very dynamo context the user's ``compile`` made (same backend, mode, options,
``fullgraph``, ``dynamic``), and its hooks, vpipe's and the user's, run around it in
Python. ``detach()`` compiles the whole call again, as ``block.compile`` does, for the blocks
that attach hoisted (its :class:`Hoisted`) and no other.

A block built on another stage for a move is compiled the same way as the block it is
cloned from (:func:`compile_like`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn

from vpipe.compat.torch_internals import call_impl, compiled_call, set_compiled_call

__all__ = ["Hoisted", "hoist_compiled", "hoisting_factory", "compile_like", "compiled_forwards",
           "dynamo_context"]


class Hoisted:
    """The modules one attach compiled forward-only, each with its dynamo context; :meth:`undo` gives just
    these their compiled call back, so a detach leaves another attach's blocks as that attach left them."""

    def __init__(self) -> None:
        self.contexts: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self.contexts)

    def add(self, module: nn.Module, ctx: Any) -> None:
        module.forward = ctx(module.forward)  # the class's forward, bound to this module
        self.contexts[module] = ctx
        _OWNER[module] = self

    def undo(self) -> None:
        """Give every module hoisted here its compiled call back (what ``module.compile`` makes)."""
        for module, ctx in list(self.contexts.items()):
            module.__dict__.pop("forward", None)
            set_compiled_call(module, ctx(call_impl(module)))
            del self.contexts[module]
            _OWNER.pop(module, None)


# a hoisted module -> the attach's Hoisted that holds it: a block cloned from it (a move)
# joins the same one, and a module is hoisted once whoever asks. The lookup is the
# process's (a module object is), the undo each owner's.
_OWNER: weakref.WeakKeyDictionary[nn.Module, Hoisted] = weakref.WeakKeyDictionary()


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


def hoist_compiled(blocks: Iterable[nn.Module]) -> Hoisted:
    """Compile the forward instead of the whole call of every module compiled in place; the modules it did
    (``len``: how many), to undo at detach."""
    hoisted = Hoisted()
    hoist_into(hoisted, blocks)
    return hoisted


def hoist_into(hoisted: Hoisted, blocks: Iterable[nn.Module]) -> None:
    """Hoist every module of ``blocks`` compiled in place (and not hoisted yet) into ``hoisted``."""
    for block in blocks:
        for module in block.modules():
            compiled = compiled_call(module)
            ctx = dynamo_context(compiled) if compiled is not None else None
            if ctx is None or module in _OWNER or "forward" in module.__dict__:
                continue
            set_compiled_call(module, None)
            hoisted.add(module, ctx)


def hoisting_factory(factory: Any, hoisted: Hoisted) -> Any:
    """``factory`` (a layer factory, or None) whose blocks, where the trainer's factory compiles
    them in place, are hoisted as attach hoists the stages' blocks: else a recompute replays their
    eager forward against the saved tensors of their compiled call (found by the fuzzer:
    ``vp.add_layers`` of such a block, then recomputed)."""
    if factory is None:
        return None

    def build(layer_id: int, spec: Any) -> nn.Module:
        block = factory(layer_id, spec)
        hoist_into(hoisted, [block])
        return block

    return build


def compiled_forwards(donor: nn.Module) -> list[Any]:
    """The compiled forwards of ``donor``'s modules (a clone must
    not share them: they are bound to the donor)."""
    return [m.__dict__["forward"] for m in donor.modules() if m in _OWNER and "forward" in m.__dict__]


def compile_like(donor: nn.Module, clone: nn.Module) -> None:
    """Compile ``clone``'s modules as ``donor``'s counterparts are (same place in the block, same context)."""
    for (_, original), (_, copy) in zip(donor.named_modules(), clone.named_modules()):
        owner = _OWNER.get(original)
        if owner is not None:
            copy.__dict__.pop("forward", None)
            owner.add(copy, owner.contexts[original])
