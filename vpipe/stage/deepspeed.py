"""A stage of DeepSpeed's pipeline engine, read as vpipe's blocks and kept in step when they move.

A ``PipelineModule`` runs its stage's layers from ``forward_funcs`` (a list), registers each
``LayerSpec`` layer under its global index (``"5"``) and names its checkpoint files by that
index from ``_local_start``. vpipe's blocks are the longest run of layers, over the whole
model, of the classes that repeat (the transformer blocks; not the embedding, the head, a
``TiedLayerSpec`` or a function). They sit in a container of vpipe's own, keyed by the
global indices, that the layer manager edits as it edits any other; when a plan takes effect
:class:`DeepSpeedStage` writes the container back into the module: ``forward_funcs``, the
registered children, ``fwd_map``, ``parts``, the local range, DeepSpeed's cached checkpointing
groups and the optimizer's parameter order (the module's, as DeepSpeed builds it). Where a
move changes a boundary activation, the plan applier resets the engine's cached shapes and
p2p buffers, as it redoes torch's shape inference (the engine adapter's ``reset_shapes``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vpipe.compat.deepspeed import is_tied_spec, layer_specs, local_range, set_local_range, spec_class
from vpipe.compat.torch_internals import child_modules

__all__ = ["DeepSpeedStage", "block_run"]


def block_run(specs: Sequence[Any]) -> range:
    """The global indices of the blocks: the longest run of layers
    of the classes that appear more than once."""
    classes = [spec_class(s) for s in specs]
    repeated = {c for c, n in Counter(c for c in classes if c is not None).items() if n >= 2}
    best, start = range(0), None
    for i, c in enumerate([*classes, None]):
        if c in repeated and start is None:
            start = i
        elif c not in repeated and start is not None:
            if i - start > len(best):
                best = range(start, i)
            start = None
    return best


class DeepSpeedStage:
    """This rank's stage of a DeepSpeed ``PipelineEngine``: its
    blocks, and the module kept in step with them."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        # DeepSpeed's PipelineModule (typed loosely: vpipe never imports DeepSpeed)
        self.module: Any = engine.module
        self.index = int(engine.stage_id)
        self.num_stages = int(engine.num_stages)
        specs = layer_specs(self.module)
        self.num_layers = len(specs)
        self.run = block_run(specs)
        self._tied = [i for i, spec in enumerate(specs) if is_tied_spec(spec)]
        parts = [int(p) for p in self.module.parts]
        start, stop = local_range(self.module)
        funcs = list(self.module.forward_funcs)
        if (start, stop) != (parts[self.index], parts[self.index + 1]) or len(funcs) != stop - start:
            raise RuntimeError(f"vpipe.attach: DeepSpeed stage {self.index} runs {len(funcs)} "
                               f"layers [{start}, {stop}) "
                               f"but its parts are {parts}; attach right after deepspeed.initialize")
        # every stage's layers that are not blocks stay where DeepSpeed put them
        self.fixed_of = [[i for i in range(parts[s], parts[s + 1]) if i not in self.run]
                         for s in range(self.num_stages)]
        self._fixed = {i: funcs[i - start] for i in self.fixed_of[self.index]}
        # the fixed layers DeepSpeed registers under their index (LayerSpecs; not tied layers or functions)
        self._fixed_registered = {i for i in self._fixed if str(i) in child_modules(self.module)}
        blocks = [(i, funcs[i - start]) for i in range(start, stop) if i in self.run]
        self.container = nn.ModuleDict(OrderedDict((str(i), b) for i, b in blocks))
        # where DeepSpeed put the blocks: its checkpoints are written and read on this partition
        self.home = tuple(tuple(i for i in range(parts[s], parts[s + 1]) if i in self.run)
                          for s in range(self.num_stages))

    # ------------------------------------------------------------------ what vpipe may do
    def empty_stages(self) -> list[int]:
        """Stages that hold no block (vpipe needs one per stage to address a stage's blocks)."""
        parts = [int(p) for p in self.module.parts]
        return [s for s in range(self.num_stages) if not any(i in self.run
                                                             for i in range(parts[s], parts[s + 1]))]

    def torch_optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer DeepSpeed steps as it is (fp32 without ZeRO), else None: its wrappers keep flat
        copies of the parameters that vpipe cannot edit."""
        optimizer = getattr(self.engine, "optimizer", None)
        return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None

    def move_refusal(self) -> str | None:
        """Why this engine's layers cannot move, or None."""
        engine = self.engine
        optimizer = getattr(engine, "optimizer", None)
        if engine.bfloat16_enabled() or engine.fp16_enabled():
            return ("DeepSpeed bf16/fp16: its optimizer keeps flat fp32 master copies of the "
                    "stage's parameters, which a move would leave stale; train in fp32 for moves")
        if engine.zero_optimization_stage() > 0:
            return (f"DeepSpeed ZeRO stage {engine.zero_optimization_stage()}: its optimizer "
                    "flattens and partitions "
                    "the stage's parameters over the replicas at initialize; use ZeRO stage 0 for moves")
        model_parallel = int(getattr(engine.grid, "model_parallel_size", 1))
        if model_parallel > 1:
            return (f"DeepSpeed tensor model parallelism ({model_parallel} ranks on the grid's model axis): "
                    "a block's shards would have to move together, which vpipe does not do under DeepSpeed")
        if not isinstance(optimizer, torch.optim.Optimizer):
            return (f"DeepSpeed's optimizer is a {type(optimizer).__name__}, not a torch "
                    "optimizer vpipe can edit")
        for s in range(self.num_stages):  # a block leaving past a fixed layer would reorder the model
            if s > 0 and self.fixed_of[s] and self.fixed_of[s][0] < self.run.start:
                return (f"DeepSpeed layer {self.fixed_of[s][0]} (not a block) starts stage {s}: "
                        "blocks cannot pass it")
            if s < self.num_stages - 1 and self.fixed_of[s] and self.fixed_of[s][-1] >= self.run.stop:
                return (f"DeepSpeed layer {self.fixed_of[s][-1]} (not a block) ends stage {s}: "
                        "blocks cannot pass it")
        return None

    def tied_layers(self) -> list[int]:
        """This stage's layers built from a ``TiedLayerSpec``: shared with another stage, never blocks."""
        start, stop = local_range(self.module)
        return [i for i in self._tied if start <= i < stop]

    @property
    def checkpoints_itself(self) -> bool:
        """Whether DeepSpeed recomputes the layers (``activation_checkpoint_interval`` > 0)."""
        return int(self.module.activation_checkpoint_interval) > 0

    # ------------------------------------------------------------------ keeping the module in step
    def add_layer(self, layer_id: int, module: nn.Module) -> None:
        """A block arrived (the layer manager tells): the engine names its parameters as DeepSpeed would."""
        names = getattr(self.engine, "param_names", None)
        if isinstance(names, dict):
            names.update({p: f"{layer_id}.{n}" for n, p in module.named_parameters()})

    def remove_layer(self, layer_id: int) -> None:
        names = getattr(self.engine, "param_names", None)
        block = self.container[str(layer_id)]
        if isinstance(names, dict):
            for p in block.parameters():
                names.pop(p, None)

    def retire_layer(self, layer_id: int) -> None:
        """(Streamed moves only: a PipeDream schedule, never DeepSpeed's.)"""

    def plan_changed(self, plan: Any, cause: str) -> None:
        """A plan took effect (applied, an edit, a restored checkpoint):
        write the blocks back into the module."""
        self.write_back(plan.stages)

    def write_back(self, placed: Sequence[Sequence[int]]) -> None:
        """Make the module run, register, number and checkpoint the layers as ``placed`` puts them."""
        placement = tuple(tuple(int(i) for i in s) for s in placed)
        ids = [int(k) for k in child_modules(self.container)]
        if ids != list(placement[self.index]):
            raise RuntimeError(f"DeepSpeed stage {self.index}: vpipe's blocks {ids} differ from the plan's "
                               f"{list(placement[self.index])}")
        blocks = dict(zip(ids, child_modules(self.container).values()))
        layers = {**self._fixed, **blocks}
        order = sorted(layers)
        module = self.module
        module.forward_funcs[:] = [layers[i] for i in order]
        kept = OrderedDict((k, m) for k, m in child_modules(module).items() if not k.isdigit())
        numbered = self._fixed_registered | set(blocks)
        for i in sorted(numbered):
            kept[str(i)] = layers[i]
        child_modules(module).clear()
        child_modules(module).update(kept)
        module.fwd_map = {str(i): pos for pos, i in enumerate(order) if i in numbered}
        parts = self._parts(placement)
        module.parts = parts
        set_local_range(module, parts[self.index], parts[self.index + 1])
        # its cached groups of layers follow forward_funcs (it keeps them per interval)
        if self.checkpoints_itself:
            module.is_checkpointable_results_interval = None
            module.set_checkpoint_interval(module.activation_checkpoint_interval)
        self._optimizer_in_module_order()

    def _parts(self, placement: Sequence[Sequence[int]]) -> list[int]:
        parts = [self.num_layers] * (self.num_stages + 1)
        for s in reversed(range(self.num_stages)):
            held = [*self.fixed_of[s], *placement[s]]
            parts[s] = min(held) if held else parts[s + 1]
        return parts

    def _optimizer_in_module_order(self) -> None:
        """Put each param group's parameters in the module's order, as DeepSpeed's
        initialize built them (moves append arrivals): a checkpoint's optimizer state
        then lines up with a plain run on the same layers."""
        optimizer = getattr(self.engine, "optimizer", None)
        if not isinstance(optimizer, torch.optim.Optimizer):
            return
        position = {id(p): i for i, p in enumerate(self.module.parameters())}
        for group in optimizer.param_groups:
            group["params"].sort(key=lambda p: position.get(id(p), len(position)))
