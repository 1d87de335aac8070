"""The reference trainer's optimizer and learning-rate schedule, built from its configuration."""

from __future__ import annotations

import math
from typing import Any

import torch

from vpipe_lab.runtime.config import RunConfig

__all__ = ["make_optimizer", "make_scheduler"]


def make_optimizer(cfg: RunConfig, params: Any) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def make_scheduler(cfg: RunConfig,
                   optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The run's learning-rate schedule, stepped once per training step (None: constant)."""
    if cfg.lr_schedule == "constant":
        return None
    warmup, total = cfg.warmup_steps, max(cfg.steps, 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
