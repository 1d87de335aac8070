"""A user's code against vpipe's public names, as their type checker
reads it: mypy checks it, nothing runs it.

pyproject's ``[tool.mypy]`` lists this file and holds it to ``--strict``. It fails the type
check when a public name loses its type: ``assert_type`` states what a user's checker must
see, and each ``type: ignore[arg-type]`` marks a call that must stay an error (mypy reports
the ignore as unused once the parameter is typed ``Any``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from typing_extensions import assert_type

import vpipe


def attach_a_schedule(schedule: ScheduleGPipe, optimizer: torch.optim.Optimizer) -> vpipe.Vpipe:
    vp = vpipe.attach(schedule, optimizer=optimizer, store=None, sample_every=5)
    assert_type(vp, vpipe.Vpipe)
    assert_type(vp.placement, tuple[tuple[int, ...], ...])
    assert_type(vp.state_dict(), dict[str, Any])
    assert_type(vp.add_layers(2, [{"d_model": 64}]), list[int])
    return vp


def attach_a_pipedream_stage(stage: PipelineStage, module: nn.Module) -> None:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    schedule = vpipe.SchedulePipeDream(stage, 4, nn.functional.mse_loss, optimizer)
    config = vpipe.VpipeConfig(memory_budget="16GB", planner_options={"confirm_samples": 1})
    assert_type(config.planner, str)
    vpipe.attach(schedule, config=config).request_plan(vpipe.Plan.from_counts(range(8), [4, 4], epoch=1), 20)


def checkpoint_keys(state: dict[str, torch.Tensor], layer_ids: list[int]) -> dict[str, torch.Tensor]:
    assert_type(vpipe.Policy("S"), vpipe.Policy)
    return vpipe.local_block_keys(vpipe.global_block_keys(state, layer_ids, "layers"), layer_ids, "layers")


def what_a_type_checker_refuses(schedule: ScheduleGPipe, optimizer: torch.optim.Optimizer) -> None:
    vpipe.attach("stage 0", optimizer=optimizer)  # type: ignore[arg-type]
    vpipe.attach(schedule, optimizer="adam")  # type: ignore[arg-type]
    vpipe.attach(schedule, store="tcp://localhost:29500")  # type: ignore[arg-type]
    vpipe.attach(schedule, config={"sample_every": 5})  # type: ignore[arg-type]
    assert_type(vpipe.__version__, str)
