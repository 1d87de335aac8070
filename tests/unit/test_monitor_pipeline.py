"""The monitor under torch.distributed.pipelining and vpipe's PipeDream schedule (a real 1-rank gloo group).

One stage means no pipeline bubbles, so the stage's step is its layers' work plus the
loss and the optimizer: the per-layer times must add up to most of the step. The check
is a ratio within one step, which a loaded machine stretches on both sides alike.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist

from vpipe.control.session import exclude_shape_inference
from vpipe.monitors import StageMonitor, layers_of
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.stage_run import build_stage_run


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def monitored_steps(schedule: str, steps: int, **cfg_changes) -> list:
    fields = dict(stages=1, blocks=4, d_model=128, seq_len=64, dropout=0.0, micro_batches=4,
                  micro_batch_size=4,
                  schedule=schedule, optimizer="sgd")
    cfg = RunConfig(**{**fields, **cfg_changes})
    run = build_stage_run(cfg, 0, torch.device("cpu"))
    monitor = StageMonitor(layers_of(run.module), stage_index=0, device="cpu", optimizer=run.optimizer,
                           sample_every=1)
    undo = exclude_shape_inference(run.stage, monitor)
    assert undo is not None, "this torch's PipelineStage lacks the shape-inference entry points"
    records = []
    for it in range(steps):
        with monitor.iteration(it) as sample:
            run.run_step(it)
        records.append(sample.record)
    undo()
    assert "_prepare_forward_infra" not in vars(run.stage)
    monitor.close()
    return records


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
def test_every_micro_batch_is_timed_once_and_shape_inference_is_not(one_rank_group, schedule):
    records = monitored_steps(schedule, 2, blocks=2, d_model=32, seq_len=16)
    for record in records:  # iteration 0 includes the schedule's shape-inference forward/backward
        for layer in record.layers:
            assert (layer.fwd_calls, layer.bwd_calls) == (4, 4), (record.iteration, layer)
            assert layer.fwd_s > 0 and layer.bwd_s > 0 and layer.activation_bytes > 0


def test_per_layer_times_sum_to_the_stage_step_time(one_rank_group):
    records = monitored_steps("gpipe", 6)[1:]  # step 0 carries one-off start-up work
    ratios = [r.compute_s / r.step_s for r in records]
    # the rest of the step is the loss and the optimizer step: about 10% here
    assert 0.85 <= statistics.median(ratios) <= 1.0, ratios
