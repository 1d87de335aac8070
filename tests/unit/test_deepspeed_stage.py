"""Which of a DeepSpeed PipelineModule's layers are vpipe's blocks
(DeepSpeed's own LayerSpec classes, no ranks)."""

from __future__ import annotations

import pytest
from torch import nn

from vpipe.compat.deepspeed import is_pipeline_engine, is_tied_spec, spec_class
from vpipe.stage.deepspeed import block_run

pipe = pytest.importorskip("deepspeed.pipe", reason="DeepSpeed is not installed (the deepspeed extra)")


class Block(nn.Linear):
    pass


def test_the_blocks_are_the_longest_run_of_the_repeated_classes():
    specs = [pipe.LayerSpec(nn.Embedding, 8, 4), *[pipe.LayerSpec(Block, 4, 4) for _ in range(4)],
             lambda x: x,
             pipe.LayerSpec(Block, 4, 4), Block(4, 4), pipe.LayerSpec(nn.LayerNorm, 4)]
    assert block_run(specs) == range(1, 5)  # the function breaks the run; the embedding and norm appear once
    assert spec_class(specs[6]) == spec_class(specs[7]) == f"{Block.__module__}.{Block.__qualname__}"


def test_tied_layers_and_functions_are_never_blocks():
    tied = pipe.TiedLayerSpec("embed", nn.Embedding, 8, 4)
    specs = [tied, pipe.LayerSpec(Block, 4, 4), pipe.LayerSpec(Block, 4, 4), tied, tied]
    assert is_tied_spec(tied) and spec_class(tied) is None and spec_class(print) is None
    assert block_run(specs) == range(1, 3)
    assert block_run([tied, tied, pipe.LayerSpec(Block, 4, 4)]) == range(0)  # nothing repeats: no blocks


def test_only_deepspeeds_pipeline_engine_is_taken_for_one():
    class PipelineEngine(nn.Module):  # a trainer's class of the same name is not DeepSpeed's
        pass

    assert not is_pipeline_engine(PipelineEngine()) and not is_pipeline_engine(nn.Sequential())
