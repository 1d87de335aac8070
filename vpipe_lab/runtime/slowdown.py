"""A slower device, modelled by waiting: selected modules' forwards and
backwards take ``factor`` times as long.

Why waiting and not work: on a shared 2-core machine two ranks compete for the cores, so
busy work on one rank would slow the other one too; a rank that sleeps gives its core
away, as a slower accelerator would leave the host alone. Why global module hooks
(``register_module_forward_pre_hook`` / ``register_module_forward_hook``): torch runs them
before any module's own hooks, so vpipe's per-layer timing hooks and a stage's own hooks
see the wait as part of the block's time, and a block that moves to another process (a
clone built there) is slowed by the selection of that process, not by hooks it carries.

For every forward of a selected module the post hook sleeps ``(factor - 1) *`` the elapsed
forward time, then hands the output through an identity :class:`torch.autograd.Function`
whose backward sleeps ``(factor - 1) * 2 *`` that forward time (a backward costs about two
forwards) and returns the gradient unchanged. Values are never touched, so training is
bitwise the same with and without it. Only the outermost selected module of a nest waits
(no double counting), forwards on meta tensors (torch's shape inference) do not, and no
backward wait is set up under ``torch.no_grad`` or for an output that needs no gradient.
A forward recomputed inside a backward (activation checkpointing) waits again, as a
slower device would compute it again. Caveat: the output handed on is a view made by a
custom Function, which autograd does not let a caller modify in place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["SlowDevice", "of_class", "children_of", "ModulePredicate"]

ModulePredicate = Callable[[nn.Module], bool]


def of_class(*classes: type[nn.Module]) -> ModulePredicate:
    """Select modules by class: robust to blocks that move between processes (a clone has the same class)."""
    return lambda module: isinstance(module, classes)


def children_of(*containers: nn.Module) -> ModulePredicate:
    """Select the current children of ``containers`` (a stage's blocks), read at each call: blocks that a
    layer manager moves in or out of a container in place are followed."""
    def selected(module: nn.Module) -> bool:
        return any(module is child for container in containers for child in container.children())
    return selected


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward waits: the gradient passes through untouched."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, wait_s: float) -> torch.Tensor:
        ctx.wait_s = wait_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.wait_s > 0:
            time.sleep(ctx.wait_s)
        return grad, None


def _first_grad_tensor(output: Any) -> tuple[int, torch.Tensor] | None:
    """Where the wait of the backward goes: the output's first
    tensor that needs a gradient (one wait per call)."""
    if isinstance(output, torch.Tensor):
        return (-1, output) if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for i, item in enumerate(output):
            if isinstance(item, torch.Tensor) and item.requires_grad:
                return i, item
    return None


def _is_meta(args: Iterable[Any]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_meta for a in args)


class SlowDevice:
    """Make the selected modules of this process ``factor`` times
    slower by sleeping (see the module docstring).

    ``modules`` decides which modules wait (:func:`of_class`, :func:`children_of`, or any predicate). The
    hooks are installed only while ``factor != 1`` (a factor of 1 costs nothing), so a straggler can appear
    and vanish with :meth:`set_factor`; change it between steps, never inside a forward. Use it as a context
    manager or call :meth:`remove`.
    """

    BACKWARD_OVER_FORWARD = 2.0  # a backward costs about two forwards

    def __init__(self, factor: float = 1.0, *, modules: ModulePredicate) -> None:
        self._selected = modules
        self._local = threading.local()  # nesting depth and the outermost forward's start, per thread
        self._handles: list[RemovableHandle] = []
        self.factor = 1.0
        self.slept_s = 0.0  # forward waits so far (the backward waits happen inside autograd)
        self.set_factor(factor)

    def set_factor(self, factor: float) -> None:
        """From the next forward on, selected modules take ``factor`` times as long (1: as they are)."""
        if not factor >= 1.0:
            raise ValueError(f"a slower device has a factor of at least 1, got {factor!r}")
        self.factor = float(factor)
        if self.factor == 1.0:
            self._unhook()
        elif not self._handles:
            self._handles = [nn.modules.module.register_module_forward_pre_hook(self._pre),
                             nn.modules.module.register_module_forward_hook(self._post, always_call=True)]

    def remove(self) -> None:
        """Take the hooks off: every module runs at its own speed again."""
        self.factor = 1.0
        self._unhook()

    def __enter__(self) -> SlowDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _unhook(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _depth(self) -> int:
        return int(getattr(self._local, "depth", 0))

    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self._selected(module) or _is_meta(args):
            return
        depth = self._depth()
        if depth == 0:
            self._local.started = time.perf_counter()
        self._local.depth = depth + 1

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not self._selected(module) or _is_meta(args):
            return None
        depth = self._depth() - 1
        self._local.depth = max(depth, 0)
        if depth != 0 or output is None:
            # an inner selected module (the outermost one waits for the whole), or a forward that raised
            return None
        elapsed = time.perf_counter() - self._local.started
        extra = (self.factor - 1.0) * elapsed
        if extra <= 0:
            return None
        time.sleep(extra)
        self.slept_s += extra
        if not torch.is_grad_enabled():
            return None
        found = _first_grad_tensor(output)
        if found is None:
            return None
        index, tensor = found
        wrapped = _SlowBackward.apply(tensor, self.BACKWARD_OVER_FORWARD * extra)
        if index < 0:
            return wrapped
        items = list(output)
        items[index] = wrapped
        if isinstance(output, list):
            return items
        return tuple(items) if type(output) is tuple else type(output)(*items)  # a named tuple keeps its type
