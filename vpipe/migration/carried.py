"""State a trainer keeps per block beside its stage, carried with the
blocks when they move: ``carry=``, ``on_move=``.

``vpipe.attach(..., carry=[ema])`` names weight averages of the stage module (torch's
``AveragedModel``, or a dict of tensors keyed by parameter name; :mod:`.averages`). When a block
moves, the sender's averaged tensors of it travel in the move's payload, next to its
parameters and optimizer state; when the move commits, the receiver's average gains them under
the block's names there and the sender's loses them (a block removed leaves its average, a block
added starts its average at its own weights). So the averages stay what they would be had the
blocks never moved, and a carried average does not pin its stage's blocks (one that is found
but not carried still does: :mod:`vpipe.stage.beside`).

Anything else a trainer keeps per block can follow with ``on_move=callable``: after each
commit that changed the blocks of a stage on this rank (a plan applied, a layer edit, a
checkpoint's plan restored), it is called once per such stage with a :class:`BlockMoves`.

Every stage must carry the same kinds of average in the same order: checked at attach, on every
rank (the n-th average of a stage receives the n-th average's tensors of the sender).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel

from vpipe.migration.averages import Average, AveragedCopy, NamedCopy, Tensors
from vpipe.stage.pipeline import LocalStage, Pipeline

__all__ = ["BlockMoves", "CarriedState", "carried_state"]


@dataclass(frozen=True)
class BlockMoves:
    """What one commit changed on one of this rank's stages: the ids of the blocks that left,
    and those that arrived (layer id -> the block now in the stage's container). A block that
    left and came back is in both: handle ``left`` first."""

    stage: int
    arrived: dict[int, nn.Module]
    left: tuple[int, ...]
    cause: str  # "applied" (a plan), "edited" (add_layers / remove_layers), "restored" (a checkpoint's plan)


class _Follower:
    """A stage's layer listener that notes, for :class:`BlockMoves`, which blocks arrive and leave."""

    def __init__(self, state: CarriedState, stage: int) -> None:
        self.state, self.stage = state, stage

    def add_layer(self, layer_id: int, module: nn.Module) -> None:
        self.state.note(self.stage, layer_id, module, arrived=True)

    def remove_layer(self, layer_id: int) -> None:
        self.state.note(self.stage, layer_id, None, arrived=False)

    def retire_layer(self, layer_id: int) -> None:
        """A streamed block still runs its last backwards here: it leaves when it is removed."""


class CarriedState:
    """This rank's carried averages, per local stage (in ``carry=``'s order), and the ``on_move`` hook."""

    def __init__(self, averages: Mapping[int, Sequence[Average]] | None = None,
                 on_move: Callable[[BlockMoves], object] | None = None,
                 carried_ids: frozenset[int] = frozenset()
                 ) -> None:
        self.averages = {v: list(found) for v, found in (averages or {}).items()}
        self.on_move = on_move
        # the carried objects (by id): what the scan for averages at attach leaves alone
        self.ids = carried_ids
        self._pending: dict[int, tuple[dict[int, nn.Module], set[int]]] = {}

    def follower(self, stage: int) -> _Follower:
        return _Follower(self, stage)

    # ------------------------------------------------------------ the layer manager's calls
    def pack(self, stage: int, layer_id: int) -> dict[int, Tensors]:
        """The block's averaged tensors on its stage, by the average's
        place in the stage's list (the payload)."""
        return {i: average.tensors(layer_id) for i, average in enumerate(self.averages.get(stage, ()))}

    def left(self, stage: int, layer_ids: Sequence[int]) -> None:
        """Blocks left the stage (a move committed, or removed): its averages lose them."""
        for average in self.averages.get(stage, ()):
            average.sync()
            for lid in layer_ids:
                average.held.pop(lid, None)

    def arrived(self, stage: int, blocks: Mapping[int, nn.Module],
                carried: Mapping[int, Mapping[int, Tensors]] | None) -> None:
        """Blocks joined the stage's container: received with their averages (``carried``: layer id -> the
        sender's :meth:`pack`), or new (``None``: each average starts at the block's weights)."""
        for i, average in enumerate(self.averages.get(stage, ())):
            for lid, block in blocks.items():
                average.put(lid, block, None if carried is None else carried.get(lid, {}).get(i, {}))

    def moved(self, src: int, dst: int, blocks: Mapping[int, nn.Module]) -> None:
        """Blocks moved between two stages of this rank: each average's copies go with them."""
        for before, after in zip(self.averages.get(src, ()), self.averages.get(dst, ())):
            before.sync()
            for lid, block in blocks.items():
                after.put(lid, block, before.held.pop(lid))

    # ------------------------------------------------------------ the hook
    def note(self, stage: int, layer_id: int, module: nn.Module | None, *, arrived: bool) -> None:
        came, went = self._pending.setdefault(stage, ({}, set()))
        if arrived and module is not None:
            came[layer_id] = module  # one that left and came back is in both: it is another module now
        # one that only passed through is in neither
        elif came.pop(layer_id, None) is None or layer_id in went:
            went.add(layer_id)

    def plan_changed(self, plan: Any, cause: str) -> None:
        """A commit: ``on_move`` hears of each stage whose blocks changed since the last one."""
        pending, self._pending = self._pending, {}
        if self.on_move is None:
            return
        for stage, (came, went) in sorted(pending.items()):
            if came or went:
                self.on_move(BlockMoves(stage, dict(came), tuple(sorted(went)), cause))


class Gatherer(Protocol):
    """What :func:`carried_state` needs of the attach's store agreement (:class:`vpipe.rank.agreement`)."""

    rank: int
    world_size: int

    def set(self, key: str, value: str) -> None: ...

    def gather(self, key: str, indices: Sequence[int], call: str, who: str) -> list[bytes]: ...


def carried_state(pipeline: Pipeline, carry: Sequence[Any], on_move: Callable[[BlockMoves], object] | None,
                  agreement: Gatherer, who: str, *, refusal: str | None = None) -> CarriedState:
    """Check ``carry=`` against this rank's stages and every stage's against the others' (the same kinds in
    the same order): a ``ValueError`` in one line on every rank, else the state the layer manager carries.
    ``refusal``: why the engine cannot carry averages (its adapter's), if it cannot."""
    averages: dict[int, list[Average]] = {s.index: [] for s in pipeline.stages}
    error = None
    try:
        _supported(carry, refusal)
        for i, item in enumerate(carry):
            stage = _stage_of(i, item, pipeline.stages)
            assert stage.blocks is not None
            averages[stage.index].append(AveragedCopy(item, stage.blocks) if isinstance(item, AveragedModel)
                                         else NamedCopy(item, stage.blocks))
    except ValueError as e:
        error = str(e)
    kinds = {str(v): [a.kind for a in found] for v, found in averages.items()}
    agreement.set(f"carry/{agreement.rank}", json.dumps({"error": error, "kinds": kinds}))
    seen = [json.loads(raw) for raw in agreement.gather("carry/{}", range(agreement.world_size),
                                                        "vpipe.attach", who)]
    first = error or next((s["error"] for s in seen if s["error"] is not None), None)
    if first is not None:
        raise ValueError(first)
    every = {int(v): k for s in seen for v, k in s["kinds"].items()}
    if len({json.dumps(k) for k in every.values()}) > 1:
        each = ", ".join(f"stage {v} {k or 'nothing'}" for v, k in sorted(every.items()))
        raise ValueError(f"vpipe.attach: carry= differs between stages ({each}); every stage "
                         "must carry the same kinds of average, in the same order")
    return CarriedState(averages, on_move, frozenset(id(item) for item in carry))


def _supported(carry: Sequence[Any], refusal: str | None) -> None:
    if carry and refusal is not None:  # the engine's adapter says why
        raise ValueError(f"vpipe.attach: carry= {refusal}; leave it out and the averaged "
                         "stages keep their blocks")


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict([*module.named_parameters(), *module.named_buffers()])


def _nearest(found: list[LocalStage], values: dict[str, torch.Tensor]) -> list[LocalStage]:
    """Of stages whose parameters an average matches by name and shape (interleaved stages
    built alike), the one it averages: an average tracks its own stage's weights (equals them
    when just made), far nearer than another stage's, which started from other values;
    ``found`` as it was when no stage is clearly nearest."""
    def distance(stage: LocalStage) -> float:
        mine = _tensors(stage.module)
        return sum(float((values[n].detach().double() - mine[n].detach().double()).square().sum())
                   for n in values if n in mine and not isinstance(values[n], DTensor)
                   and values[n].is_floating_point())
    ranked = sorted(found, key=distance)
    best, second = distance(ranked[0]), distance(ranked[1])
    return [ranked[0]] if best < 0.5 * second else found


def _stage_of(i: int, item: Any, stages: Sequence[LocalStage]) -> LocalStage:
    """The local stage whose module ``item`` (``carry[i]``) averages, or a ``ValueError`` saying why none."""
    what = f"vpipe.attach: carry[{i}]"
    if isinstance(item, AveragedModel):
        theirs = {n: tuple(p.shape) for n, p in item.module.named_parameters()}
        found = [s for s in stages if {n: tuple(p.shape) for n, p in s.module.named_parameters()} == theirs]
        if not found:
            mine = stages[0].module
            raise ValueError(f"{what} is an AveragedModel of another module ({type(item.module).__name__}, "
                             f"{len(theirs)} parameters), not of this rank's stage module "
                             f"({type(mine).__name__}, {len(list(mine.parameters()))} parameters)")
        values = _tensors(item.module)
    elif type(item) is dict:
        bad = next((k for k in item if not isinstance(k, str)), None)
        if bad is not None or not item:
            raise ValueError(f"{what} is a dict keyed by {bad!r}: a carried dict maps the "
                             "stage module's parameter names (as named_parameters() gives them) to tensors")
        found = [s for s in stages if set(item) <= set(_tensors(s.module))]
        if not found:
            names = set().union(*(_tensors(s.module) for s in stages))
            key = next(k for k in item if k not in names)
            raise ValueError(
                f"{what} is a dict keyed by {key!r}, which names no parameter of this rank's stage "
                "module: a carried dict is keyed by the parameter names named_parameters() gives"
            )
        own = {id(t) for s in found for t in _tensors(s.module).values()}
        values = item
        if any(not isinstance(t, torch.Tensor) or id(t) in own for t in values.values()):
            raise ValueError(f"{what}: a carried dict holds tensors of its own (copies of "
                             "the weights), not the stage's parameters themselves")
    else:
        raise ValueError(f"{what} is a {type(item).__name__}: carry= takes torch's AveragedModel of the "
                         "stage module or a dict of tensors keyed by its parameter names (on_move= hears of "
                         "moves for anything else)")
    if len(found) > 1:
        found = _nearest(found, values)
    if len(found) > 1:
        raise ValueError(f"{what} averages stages {[s.index for s in found]} of this rank alike (the same "
                         "names and shapes, and values as near to each); carry one average per stage "
                         "module, made from it before training (as AveragedModel(stage_module) is)")
    if any(isinstance(t, DTensor) for t in values.values()):
        raise ValueError(f"{what} holds sharded tensors (DTensor): carried averages must be whole tensors")
    return found[0]
