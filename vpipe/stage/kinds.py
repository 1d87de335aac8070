"""What kind of block a module is: which blocks a clone may be built from, and what a compiled wrapper wraps.

Two blocks of one kind are interchangeable for a move (the target builds one from the
other), and the monitors report the kind so the planner knows which layers are alike.
"""

from __future__ import annotations

import hashlib

from torch import nn

from vpipe.compat.torch_internals import compile_wrapper_inner

__all__ = ["block_kind", "compiled_inner"]


def compiled_inner(block: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile(block)`` wrapper (``OptimizedModule``)
    compiles, or None for another block."""
    return compile_wrapper_inner(block)


def block_kind(block: nn.Module) -> str:
    """What makes two blocks interchangeable for a clone: class, parameter and buffer names, shapes, dtypes.

    A ``torch.compile(block)`` wrapper is known by the class it compiles (its parameter
    names, ``_orig_mod.``-prefixed, tell it from that class uncompiled).
    """
    inner = compiled_inner(block)
    cls = type(inner if inner is not None else block)
    shapes = [(n, tuple(t.shape), str(t.dtype)) for n, t in block.named_parameters()]
    shapes += [(n, tuple(t.shape), str(t.dtype)) for n, t in block.named_buffers()]
    digest = hashlib.sha1(repr((cls.__module__, cls.__qualname__, shapes)).encode()).hexdigest()[:10]
    return f"{cls.__name__[:40]}#{digest}"
