"""A model's placement units: the blocks of its containers of repeated blocks, and the modules beside them.

The model's containers of repeated blocks (``nn.Sequential`` /
``nn.ModuleList`` / ``nn.ModuleDict`` whose entries repeat a class and hold a good share of
the parameters: a GPT-2's ``transformer.h``, both stacks of an encoder-decoder) give one
unit per block. Every other module hangs off the path from the model to those containers,
and the modules beside that path are units too: for a GPT-2 ``transformer.wte``,
``transformer.wpe``, ``transformer.drop``, ``transformer.ln_f`` and ``lm_head``. A model
without such containers is split into its children. Operators are never units: a plan
names modules a trainer can split at.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from vpipe.compat.torch_internals import child_modules
from vpipe.graph import Unit

__all__ = ["find_units"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_MAJOR = 0.25  # a container of repeated blocks counts if it holds this share of the largest one's parameters


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _repeated(container: nn.Module) -> bool:
    """At least two entries, and one class making at least half of them."""
    classes = [type(m) for m in child_modules(container).values() if m is not None]
    if len(classes) < 2:
        return False
    top = max(classes.count(c) for c in set(classes))
    return top >= 2 and 2 * top >= len(classes)


def _block_containers(model: nn.Module) -> list[str]:
    candidates = [(name, _params(m)) for name, m in model.named_modules()
                  if isinstance(m, _CONTAINERS) and _repeated(m) and _params(m) > 0]
    if not candidates:
        return []
    largest = max(p for _, p in candidates)
    chosen: list[str] = []
    for name, params in sorted(candidates, key=lambda c: (-c[1], len(c[0]))):
        if params >= _MAJOR * largest and not any(_nested(name, other) for other in chosen):
            chosen.append(name)
    return chosen


def _nested(a: str, b: str) -> bool:
    return a == b or a == "" or b == "" or a.startswith(b + ".") or b.startswith(a + ".")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unit(name: str, container: str | None, module: nn.Module) -> Unit:
    """A placement unit with its class and trainable parameter count (what DeepSpeed partitions by)."""
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return Unit(name, container, kind=type(module).__name__, params=params)


def find_units(model: nn.Module, containers: Sequence[str] | None = None) -> tuple[list[Unit], list[str]]:
    """The model's placement units in module order, and the block containers they come from.

    ``containers`` names the block containers (dotted paths); by default they are found."""
    if containers:
        for path in containers:
            try:
                found = model.get_submodule(path)
            except AttributeError:
                raise ValueError(
                    f"--layers: the model ({type(model).__name__}) has no submodule {path!r}"
                ) from None
            if not isinstance(found, _CONTAINERS) or not child_modules(found):
                raise ValueError(f"--layers: {path!r} is a {type(found).__name__}; it must name a non-empty "
                                 "nn.Sequential, nn.ModuleList or nn.ModuleDict of blocks")
        chosen = list(containers)
        for i, a in enumerate(chosen):
            for b in chosen[i + 1:]:
                if _nested(a, b):
                    raise ValueError(f"--layers: {a!r} and {b!r} are the same container "
                                     "or one holds the other")
    else:
        chosen = _block_containers(model)
    units: list[Unit] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in child_modules(module).items():
            if child is None:
                continue
            path = _join(prefix, name)
            if path in chosen:
                units.extend(_unit(_join(path, key), path, block)
                             for key, block in child_modules(child).items()
                             if block is not None)
            elif any(c.startswith(path + ".") for c in chosen):
                walk(path, child)
            else:
                units.append(_unit(path, None, child))

    if "" in chosen:  # the model is itself the container (an nn.Sequential of blocks)
        units = [_unit(key, "", block) for key, block in child_modules(model).items() if block is not None]
    else:
        walk("", model)
    if not units:
        units = [_unit("", None, model)]  # a model without children: one unit
    return units, chosen
