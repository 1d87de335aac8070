"""The ``tp`` axis: every block under DTensor tensor parallelism over the tp dimension of a (pp, tp) mesh.

torchtitan's feed-forward plan, as ``parallelize_module`` puts it on each block (no
SequenceParallel: gloo has no reduce-scatter for it): the first projection ``ColwiseParallel``,
the second ``RowwiseParallel`` (its output all-reduced over tp). A block whose next op needs the
whole features (BatchNorm, a frozen base beside LoRA factors) gathers its one projection's output
instead. The stage's own modules (embeddings, head) and the norms stay plain tensors on every
tp rank. Both copies parallelise alike, each over its own mesh.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def block_plan(block: nn.Module) -> dict[str, Any]:
    """The parallel styles of one fuzzer block, by submodule name (tests/fuzz/models.py's kinds)."""
    kind = type(block).__name__
    if kind == "DenseBlock":
        return {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
    if kind == "NormBlock":  # BatchNorm normalises every feature: the projection's output is gathered
        return {"fc": ColwiseParallel(output_layouts=Replicate())}
    if kind == "LoraBlock":  # the frozen base, gathered: the LoRA factors add to the whole output
        return {"base": ColwiseParallel(output_layouts=Replicate())}
    if kind == "MoEBlock":  # every expert's up and down projections; the router stays whole
        plan: dict[str, Any] = {}
        for e in range(len(block.experts)):
            plan[f"experts.{e}.up"], plan[f"experts.{e}.down"] = ColwiseParallel(), RowwiseParallel()
        return plan
    raise ValueError(f"no tensor-parallel plan for a {kind}")


def parallelize_block(block: nn.Module, tp_mesh: Any) -> nn.Module:
    """``block`` with its plan applied over ``tp_mesh`` (in place; returned for the layer factory)."""
    parallelize_module(block, tp_mesh, block_plan(block))
    return block


def parallelize_blocks(blocks: nn.Module, tp_mesh: Any) -> None:
    """Every block of a stage's container, as torchtitan's ``apply_tp`` does per transformer block."""
    for block in blocks.children():
        parallelize_block(block, tp_mesh)
