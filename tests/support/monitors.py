"""Test helpers: monitors."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from vpipe.monitors.records import LayerRecord, StageRecord


def layer(layer_id: int = 3, **changes) -> LayerRecord:
    fields = dict(layer_id=layer_id, fwd_s=0.01, bwd_s=0.02, fwd_calls=4, bwd_calls=4, activation_bytes=4096,
                  param_bytes=1024, optimizer_bytes=2048, output_bytes=512)
    fields.update(changes)
    return LayerRecord(**fields)


def stage_record(stage: int = 1, iteration: int = 9, layers=(3, 4), **changes) -> StageRecord:
    fields = dict(stage=stage, iteration=iteration, epoch=0, device="cpu", t=1.7e9, step_s=0.1,
                  layers=tuple(layer(i) for i in layers), param_bytes=2048, optimizer_bytes=4096,
                  device_resident_bytes=10 << 20, device_peak_bytes=12 << 20, host_rss_bytes=10 << 20,
                  host_pool_used_bytes=0, host_pool_peak_bytes=0, host_pool_capacity_bytes=0, d2h_bytes=0,
                  d2h_s=0.0, h2d_bytes=0, h2d_s=0.0, recompute_s=0.0, gpu_util_pct=None, pcie_rx_bytes_s=None,
                  pcie_tx_bytes_s=None)
    fields.update(changes)
    return StageRecord(**fields)


def chain(width: int = 32, ids=(5, 6, 7)) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict((str(i), nn.Sequential(nn.Linear(width, width), nn.Tanh()))
                                     for i in ids))
