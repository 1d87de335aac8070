"""The blocks of a stage: the one run of repeated modules vpipe may move, addressed by global id.

A stage module is whatever the user built: an ``nn.Sequential`` slice, the torch
pipelining tutorial's / torchtitan's ``Transformer`` (``layers`` is an ``nn.ModuleDict``
keyed by global layer id, ``tok_embeddings`` / ``norm`` / ``output`` are ``None`` where
they do not belong), or a wrapper holding ``nn.ModuleList(hf_model.transformer.h[a:b])``.
vpipe moves only the entries of one container of repeated blocks; everything else stays
on its stage. :func:`find_block_container` finds that container, :class:`StageBlocks`
edits it in place (same object, same type, same order), so the user's forward, which
iterates the container, keeps working and keeps passing its own extra arguments.

Keys: a container whose keys are the global layer ids (integer keys unique across the
stages) keeps them, so ``state_dict()`` names stay what the user's checkpoint code
expects; a positional container (an ``nn.ModuleList``, or a ``Sequential`` slice named
``0..n-1`` on every stage) is renumbered ``0..n-1`` after every edit, exactly as the same
slice built fresh for the new partition would be; any other keys travel with their block.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, cast

import torch
from torch import nn

from vpipe.compat.torch_internals import child_modules

__all__ = ["BlockContainerError", "KeyStyle", "StageBlocks", "find_block_container", "block_containers",
           "common_container", "container_kind"]

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_AMBIGUITY = 0.5  # a second, separate container with at least this share of the best one's parameters


class BlockContainerError(ValueError):
    """The stage module has no container vpipe can move blocks of, or several equally likely."""


class KeyStyle(str, Enum):
    IDS = "ids"  # keys are the global layer ids
    POSITIONS = "positions"  # keys are 0..n-1, renumbered after every edit
    NAMES = "names"  # any other keys: each travels with its block


# ---------------------------------------------------------------------- finding the container
def _entries(container: nn.Module) -> list[tuple[str, Any]]:
    return list(child_modules(container).items())


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _repeats(modules: Sequence[nn.Module]) -> bool:
    """One block, or one class that appears at least twice and makes at least half the entries."""
    if len(modules) == 1:
        return True
    top = Counter(type(m) for m in modules).most_common(1)[0][1]
    return top >= 2 and 2 * top >= len(modules)


def _describe(path: str, container: nn.Module) -> str:
    classes = Counter(type(m).__name__ for _, m in _entries(container) if m is not None)
    kinds = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in classes.most_common(3))
    return f"{path or '<the stage module>'} ({type(container).__name__} of {kinds or 'nothing'})"


def find_block_container(stage_module: nn.Module, path: str | None = None) -> tuple[str, nn.Module]:
    """The ``(path, container)`` of the stage's blocks: named by ``path``, or found.

    A stage module that is itself an ``nn.Sequential`` is its own container (every child a
    block). Otherwise the candidates are the ``Sequential`` / ``ModuleList`` / ``ModuleDict``
    modules inside it whose entries repeat one or a few classes and hold parameters; the
    one holding the most parameters wins, unless a separate container (neither inside the
    other) comes close, which is ambiguous: the error names the candidates and ``layers=``.
    """
    if path is not None:
        if not isinstance(path, str):
            raise BlockContainerError(f"layers= must be the dotted path of the block container, got {path!r}")
        try:
            container = stage_module.get_submodule(path)
        except AttributeError:
            raise BlockContainerError(f"layers={path!r}: the stage module "
                                      f"({type(stage_module).__name__}) has no submodule {path!r}") from None
        if not isinstance(container, CONTAINERS) and not isinstance(stage_module, torch.fx.GraphModule):
            raise BlockContainerError(f"layers={path!r} is a {type(container).__name__}; it must name an "
                                      "nn.Sequential, nn.ModuleList or nn.ModuleDict of blocks")
        return path, _checked(path, container)
    if isinstance(stage_module, nn.Sequential):
        return "", _checked("", stage_module)
    # a traced stage (pipeline() split) keeps the model's hierarchy as plain modules named like the original
    traced = isinstance(stage_module, torch.fx.GraphModule)
    scored: list[tuple[int, str, nn.Module]] = []
    seen: list[str] = []
    for name, module in stage_module.named_modules():
        by_index = traced and bool(child_modules(module)) and all(k.isdigit() for k in child_modules(module))
        if not name or not (isinstance(module, CONTAINERS) or by_index):
            continue
        seen.append(_describe(name, module))
        blocks = [m for _, m in _entries(module) if m is not None]
        if not blocks or not _repeats(blocks):
            continue
        params = sum(_param_count(m) for m in blocks)
        if params > 0:
            scored.append((params, name, module))
    if not scored:
        found = f"; it has {', '.join(seen[:6])}" if seen else ""
        raise BlockContainerError(
            f"vpipe.attach found no container of repeated blocks in the stage module "
            f"({type(stage_module).__name__}){found}. Put the stage's blocks in an "
            "nn.Sequential, nn.ModuleList or nn.ModuleDict, or pass layers='path.to.container'")
    scored.sort(key=lambda item: (-item[0], len(item[1])))
    best_params, best, container = scored[0]
    rivals = [(p, n) for p, n, _ in scored[1:]
              if p >= _AMBIGUITY * best_params and not _nested(n, best)]
    if rivals:
        names = ", ".join(_describe(n, stage_module.get_submodule(n))
                          for n in [best] + [n for _, n in rivals[:3]])
        raise BlockContainerError(
            f"vpipe.attach cannot decide which container holds the stage's blocks: {names}. "
            f"Pass layers='{best}' (or another of them) to vpipe.attach")
    return best, _checked(best, container)


def block_containers(stage_module: nn.Module) -> list[str]:
    """Every container in the stage module that could hold its blocks, of one kind
    or several (each entry a module with parameters): what the stages compare when
    their own choices differ (:func:`common_container`)."""
    if isinstance(stage_module, torch.fx.GraphModule):
        return []
    return [name for name, module in stage_module.named_modules()
            if isinstance(module, CONTAINERS) and child_modules(module)
            and all(m is not None and _param_count(m) > 0 for m in child_modules(module).values())]


def common_container(found: Sequence[tuple[str | None, Sequence[str]]]) -> str:
    """The one container path every stage uses, from each stage's own choice (None: it found none) and its
    :func:`block_containers`.

    Stages whose blocks are not all of one kind choose differently on their own: a stage holding
    a dense and an MoE block sees no repeated class in ``layers`` and picks the MoE block's
    ``experts``. The path is the choice of some stage that is a container on every stage (the
    outermost, when one holds another); a container may then hold blocks of several kinds.
    """
    chosen = sorted({path for path, _ in found if path is not None})
    if len(chosen) == 1 and all(path == chosen[0] or chosen[0] in others for path, others in found):
        return chosen[0]
    # a choice inside an entry of a container (an MoE block's ``experts`` in ``layers``) is part of a block
    outer = {".".join(c.split(".")[:i]) for c in chosen for i in range(1, len(c.split(".")) - 1)}
    everywhere = [c for c in sorted(set(chosen) | outer)
                  if all(path == c or c in others for path, others in found)]
    outermost = [c for c in everywhere if not any(o != c and (o == "" or c.startswith(o + "."))
                                                  for o in everywhere)]
    if len(outermost) == 1:
        return outermost[0]
    each = ", ".join(f"stage {s} {path or '<the stage module>'!r}" if path is not None else f"stage {s} none"
                     for s, (path, _) in enumerate(found))
    raise BlockContainerError(f"the stages found different block containers ({each}); vpipe moves blocks "
                              "between containers at one path: pass "
                              "layers='path.to.container' to vpipe.attach")


def _nested(a: str, b: str) -> bool:
    return a.startswith(b + ".") or b.startswith(a + ".")


def _checked(path: str, container: nn.Module) -> nn.Module:
    entries = _entries(container)
    if not entries:
        raise BlockContainerError(f"the block container {path or '<the stage module>'} is empty: "
                                  "every stage needs at least one block")
    empty = [key for key, m in entries if m is None]
    if empty:
        raise BlockContainerError(f"the block container {path or '<the stage module>'} holds None at "
                                  f"{empty[:3]}: delete the entries a stage does not own instead")
    return container


# ---------------------------------------------------------------------- the container, by global id
@dataclass(frozen=True)
class ContainerLayout:
    """What a stage tells the others at attach time about its container (plain JSON values)."""

    path: str
    kind: str  # Sequential / ModuleList / ModuleDict
    keys: tuple[str, ...]


def container_kind(container: nn.Module) -> str:
    """Sequential / ModuleList / ModuleDict, also for a container that FSDP2's ``fully_shard`` turned into
    a class of its own (``FSDPSequential``): how its keys behave is its torch base class's."""
    return next((c.__name__ for c in CONTAINERS if isinstance(container, c)), type(container).__name__)


def layout_of(path: str, container: nn.Module) -> ContainerLayout:
    return ContainerLayout(path, container_kind(container), tuple(child_modules(container)))


def agree_key_style(layouts: Sequence[ContainerLayout]) -> KeyStyle:
    """How every stage's container is keyed, decided from all stages' layouts (the same on every rank)."""
    all_keys = [k for lay in layouts for k in lay.keys]
    if any(lay.kind == "ModuleList" for lay in layouts):
        return KeyStyle.POSITIONS
    if all(k.lstrip("-").isdigit() for k in all_keys) and len(set(all_keys)) == len(all_keys) \
            and all(int(k) >= 0 for k in all_keys):
        return KeyStyle.IDS
    if all(lay.keys == tuple(str(i) for i in range(len(lay.keys))) for lay in layouts) \
            and all(lay.kind == "Sequential" for lay in layouts):
        return KeyStyle.POSITIONS
    return KeyStyle.NAMES


def global_ids(layouts: Sequence[ContainerLayout], style: KeyStyle) -> list[list[int]]:
    """Every stage's block ids: the keys where they are ids, else by stage order (earlier stages first)."""
    if style is KeyStyle.IDS:
        return [[int(k) for k in lay.keys] for lay in layouts]
    stages, first = [], 0
    for lay in layouts:
        stages.append(list(range(first, first + len(lay.keys))))
        first += len(lay.keys)
    return stages


class StageBlocks:
    """A stage's block container, addressed by global layer id and edited in place.

    ``ids`` are the global ids of the container's entries, in order. Edits keep the
    container object and its type; keys follow ``style`` (see the module docstring). The
    container is usually an ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict``; in a
    traced stage it is the plain module the tracer kept, which vpipe hooks but never edits.
    """

    def __init__(self, container: nn.Module, ids: Sequence[int], style: KeyStyle, path: str = "") -> None:
        if len(ids) != len(child_modules(container)):
            raise ValueError(f"{len(ids)} ids for {len(child_modules(container))} blocks")
        self.container = container
        self.style = style
        self.path = path
        self._ids = list(ids)
        self._keys = dict(zip(self._ids, child_modules(container)))

    @classmethod
    def keyed_by_ids(cls, container: nn.Module) -> StageBlocks:
        """The blocks of a container keyed by their global layer ids
        (an ``nn.Sequential`` named ``"4"``, ``"5"``)."""
        return cls(container, [int(key) for key in child_modules(container)], KeyStyle.IDS)

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    def blocks(self) -> dict[int, nn.Module]:
        """Global id -> block, in order."""
        return dict(zip(self._ids, self._entries()))

    def _entries(self) -> list[nn.Module]:
        # torch types its children as optional (register_module accepts None); a block container's are blocks
        return cast("list[nn.Module]", list(child_modules(self.container).values()))

    def key_of(self, layer_id: int) -> str:
        return self._keys[layer_id]

    def module_path(self, layer_id: int) -> str:
        """The block's name inside the stage module (``layers.4``, ``h.0``)."""
        key = self._keys[layer_id]
        return f"{self.path}.{key}" if self.path else key

    def insert(self, at: int, new: Sequence[tuple[int, nn.Module, str | None]]) -> None:
        """Put ``(id, block, key)`` entries before position ``at``;
        ``key`` matters for name-keyed containers."""
        if not 0 <= at <= len(self._ids):
            raise ValueError(f"position {at} is outside 0..{len(self._ids)}")
        clash = [lid for lid, _, _ in new if lid in self._keys]
        if clash:
            raise ValueError(f"layers {clash} are already in this stage's container")
        entries = list(zip(self._ids, (self._keys[i] for i in self._ids), self._entries()))
        added = [(lid, self._new_key(lid, key), block) for lid, block, key in new]
        taken = {key for _, key, _ in entries}
        dupes = [key for _, key, _ in added if key in taken]
        if dupes and self.style is KeyStyle.NAMES:
            raise ValueError(f"the block container already has entries named {dupes}")
        entries[at:at] = added
        self._rebuild(entries)

    def remove(self, layer_ids: Iterable[int]) -> list[nn.Module]:
        """Take blocks out (returns them, in container order)."""
        doomed = set(layer_ids)
        unknown = doomed - set(self._ids)
        if unknown:
            raise ValueError(f"layers {sorted(unknown)} are not in this stage's container")
        entries = list(zip(self._ids, (self._keys[i] for i in self._ids), self._entries()))
        self._rebuild([e for e in entries if e[0] not in doomed])
        return [block for lid, _, block in entries if lid in doomed]

    def _new_key(self, layer_id: int, key: str | None) -> str:
        if self.style is KeyStyle.IDS:
            return str(layer_id)
        if self.style is KeyStyle.NAMES:
            if not key:
                raise ValueError(f"layer {layer_id} arrives without its key; this container's "
                                 "keys travel with blocks")
            return key
        return ""  # positions: set by _rebuild

    def _rebuild(self, entries: Sequence[tuple[int, str, nn.Module]]) -> None:
        if self.style is KeyStyle.POSITIONS:
            entries = [(lid, str(i), block) for i, (lid, _, block) in enumerate(entries)]
        modules = child_modules(self.container)
        modules.clear()
        modules.update(OrderedDict((key, block) for _, key, block in entries))
        self._ids = [lid for lid, _, _ in entries]
        self._keys = {lid: key for lid, key, _ in entries}
