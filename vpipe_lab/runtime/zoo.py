"""Paper-sized model graphs for planner tests and benchmarks (vPipe Table 4's models).

Each builder makes a real torch module on the meta device (so no memory is allocated and
nothing is computed), traces it with ``torch.fx`` and turns the trace into a
:class:`~vpipe.graph.LayerGraph` whose costs come from a :class:`~vpipe.graph.Roofline`
estimate: FLOPs and bytes of the real tensor shapes, hence the same graph and the same
costs on every run and every machine. Sizes follow the paper's graphs (nodes, edges):

=====================  ==========================  ==========================
builder                paper (Table 4)              this module
=====================  ==========================  ==========================
``bert_large``         (976, 1262)                  ~1000 nodes
``transformer``        (662, 830)                   ~650 nodes
``amoebanet``          (4380, 5080)                 ~4400 nodes, ~5000 edges
``gnmt``               (190, 228)                   ~190 nodes
=====================  ==========================  ==========================

The modules (:mod:`vpipe_lab.runtime.zoo_modules`) spell attention, layer norm and cells out op
by op, so the graphs have the structure the partitioner must cope with: dense subgraphs
inside blocks, residual edges, and long "sparse" edges.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vpipe.graph import LayerGraph, Roofline
from vpipe.profiling.fx import from_fx
from vpipe_lab.runtime.zoo_modules import AmoebaNetLike, BertLike, EncoderDecoder, GnmtLike

__all__ = ["ZOO", "build", "bert_large", "transformer", "amoebanet", "gnmt"]

# One A100-class device at realistic efficiency: only ratios matter to the planner.
DEFAULT_ROOFLINE = Roofline(flops_per_s=100e12, bytes_per_s=1.5e12)


# --------------------------------------------------------------------- builders
def _trace(module_fn: Callable[[], nn.Module], inputs_fn: Callable[[], tuple[torch.Tensor, ...]], name: str,
           roofline: Roofline) -> LayerGraph:
    with torch.device("meta"):
        module, inputs = module_fn(), inputs_fn()
    module.eval()  # eval-mode batch norm is a cheap meta kernel; the graph and FLOPs are the same
    return from_fx(module, inputs, name=name, roofline=roofline)


def bert_large(*, batch: int = 8, seq: int = 512, roofline: Roofline = DEFAULT_ROOFLINE) -> LayerGraph:
    """BERT-large (24 x 1024, 16 heads) on a micro-batch of ``batch`` x ``seq`` tokens."""
    return _trace(
        lambda: BertLike(24, 1024, 16, 30522, batch, seq),
        lambda: (torch.zeros(batch, seq, dtype=torch.long), torch.zeros(batch, seq, dtype=torch.long),
                 torch.zeros(batch, seq, dtype=torch.long), torch.ones(batch, seq)),
        "bert-large", roofline,
    )


def transformer(*, batch: int = 16, seq: int = 128, roofline: Roofline = DEFAULT_ROOFLINE) -> LayerGraph:
    """Transformer-big encoder-decoder (6 + 6 layers, 1024 wide, 16 heads)."""
    return _trace(
        lambda: EncoderDecoder(6, 1024, 16, 32000, batch, seq),
        lambda: (torch.zeros(batch, seq, dtype=torch.long), torch.zeros(batch, seq, dtype=torch.long),
                 torch.zeros(batch, 1, 1, seq), torch.zeros(1, 1, seq, seq)),
        "transformer", roofline,
    )


def amoebanet(*, batch: int = 8, image: int = 224, normal_per_stack: int = 23, channels: int = 128,
              roofline: Roofline = DEFAULT_ROOFLINE) -> LayerGraph:
    """AmoebaNet-like cell network, ``normal_per_stack`` normal cells in each of 3 stacks."""
    return _trace(
        lambda: AmoebaNetLike(normal_per_stack, channels, 1000),
        lambda: (torch.zeros(batch, 3, image, image),),
        "amoebanet", roofline,
    )


def gnmt(*, layers: int = 16, batch: int = 64, seq: int = 16,
         roofline: Roofline = DEFAULT_ROOFLINE) -> LayerGraph:
    """GNMT-like LSTM translation model, hidden 1024, ``layers`` encoder and decoder layers.

    The default 16 + 16 is GNMT-8 doubled, as the paper doubles every model's depth for its
    16-GPU partitioning experiment (Table 4).
    """
    return _trace(
        lambda: GnmtLike(layers, 1024, 32000),
        lambda: (torch.zeros(batch, seq, dtype=torch.long), torch.zeros(batch, seq, dtype=torch.long),
                 torch.zeros(batch, seq, seq, dtype=torch.bool)),
        "gnmt", roofline,
    )


ZOO: dict[str, Callable[[], LayerGraph]] = {
    "bert-large": bert_large,
    "transformer": transformer,
    "amoebanet": amoebanet,
    "gnmt": gnmt,
}


def build(name: str) -> LayerGraph:
    """The named zoo graph with its default sizes."""
    try:
        return ZOO[name]()
    except KeyError:
        raise ValueError(f"unknown zoo graph {name!r}; choose from {', '.join(ZOO)}") from None
