"""What crosses each stage boundary: shape, dtype and arity of every layer's input and output.

torch's pipelining sizes its receive buffers from the boundary activations it saw at the
first step. A move that puts another layer at a stage's edge may change them, and then
every rank must redo shape inference at the same step (:func:`vpipe.stage.pipeline.reset_shape_inference`).
:class:`BoundaryShapes` watches the first call of every local layer and answers, before a
move commits, whether it changes what a local stage sends downstream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["BoundaryShapes", "meta_of", "wire_meta", "unwire_meta"]

Meta = tuple[Any, ...]


def meta_of(output: Any) -> Meta:
    """Shape (without the batch dimension), dtype and arity of a layer's output or inputs."""
    outs = output if isinstance(output, (tuple, list)) else (output,)
    return tuple((tuple(o.shape[1:]), str(o.dtype)) if isinstance(o, torch.Tensor) else ("?",) for o in outs)


def wire_meta(meta: Meta | None) -> list[Any] | None:
    return None if meta is None else [[list(m[0]), m[1]] if len(m) == 2 else ["?"] for m in meta]


def unwire_meta(raw: Any) -> Meta | None:
    if not isinstance(raw, list):
        return None
    try:
        return tuple((tuple(int(d) for d in m[0]), str(m[1])) if len(m) == 2 else ("?",) for m in raw)
    except (TypeError, ValueError, IndexError):
        return None


class BoundaryShapes:
    """The input and output metadata of every layer this rank has run (and of layers that arrived)."""

    def __init__(self) -> None:
        self.out_meta: dict[int, Meta] = {}
        self.in_meta: dict[int, Meta] = {}
        self._hooks: dict[int, Any] = {}

    def watch(self, layer_id: int, layer: nn.Module) -> None:
        """Record the layer's input and output metadata at its next call.

        The hook never removes itself (a hook that edits hook tables inside a call breaks a
        block compiled in place, ``block.compile(fullgraph=True)``, which traces its hooks):
        the next use of the watcher removes the hooks that have recorded (:meth:`_prune`).
        """
        self._prune()
        if layer_id in self.out_meta:
            return

        def record(_module: nn.Module, inputs: Any, output: Any) -> None:
            if layer_id not in self.out_meta:
                self.out_meta[layer_id] = meta_of(output)
                self.in_meta[layer_id] = meta_of(inputs)

        self._hooks[layer_id] = layer.register_forward_hook(record)

    def _prune(self) -> None:
        """Remove the hooks of layers whose metadata is recorded (outside any layer's call)."""
        for layer_id in [lid for lid in self._hooks if lid in self.out_meta]:
            self.unwatch(layer_id)

    def unwatch(self, layer_id: int) -> None:
        handle = self._hooks.pop(layer_id, None)
        if handle is not None:
            handle.remove()

    def forget(self, layer_id: int) -> None:
        self.unwatch(layer_id)
        self.out_meta.pop(layer_id, None)
        self.in_meta.pop(layer_id, None)

    def close(self) -> None:
        for layer_id in list(self._hooks):
            self.unwatch(layer_id)

    def describe(self, layer_id: int) -> dict[str, Any]:
        """What travels with a moved layer so its new stage knows its boundary shapes."""
        self._prune()
        return {"out_meta": wire_meta(self.out_meta.get(layer_id)),
                "in_meta": wire_meta(self.in_meta.get(layer_id))}

    def learn(self, layer_id: int, manifest: dict[str, Any]) -> None:
        for table, key in ((self.out_meta, "out_meta"), (self.in_meta, "in_meta")):
            meta = unwire_meta(manifest.get(key))
            if meta is not None:
                table[layer_id] = meta

    def last_output_changes(self, before: Sequence[int], after: Sequence[int],
                            arriving: dict[int, dict[str, Any]]) -> bool:
        """Whether a stage that held ``before`` and will hold ``after`` sends something else downstream.

        ``arriving`` maps the layers that come from another rank to their manifests (which
        carry their output metadata). Unknown metadata counts as a change.
        """
        self._prune()
        if not after or not before or after[-1] == before[-1]:
            return False
        new_last = after[-1]
        new = (unwire_meta(arriving[new_last].get("out_meta")) if new_last in arriving
               else self.out_meta.get(new_last))
        old = self.out_meta.get(before[-1])
        return old is None or new is None or old != new

    def boundary_changed(self, stage: int, before: Sequence[Sequence[int]],
                         after: Sequence[Sequence[int]]) -> bool:
        """Before a one-round move: whether a boundary next to local
        ``stage`` will carry a different activation.

        Boundary ``b`` (between stages b and b+1) is judged by the stage that held its new
        last layer before the move: it knows that layer's output and the old boundary (as
        stage b, the old last layer's output; as stage b+1, its old first layer's input).
        """
        changed = False
        for b in (stage - 1, stage):
            if not 0 <= b < len(before) - 1 or before[b][-1] == after[b][-1]:
                continue
            new_last = after[b][-1]
            if new_last not in before[stage]:
                continue  # the other neighbour judges this boundary
            old = self.out_meta.get(before[b][-1]) if b == stage else self.in_meta.get(before[b + 1][0])
            new = self.out_meta.get(new_last)
            changed = changed or old is None or new is None or old != new
        return changed
