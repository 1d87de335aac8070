"""Several pipeline configurations side by side in one launch, so that their step times can be compared.

A shared machine's speed drifts within seconds, so comparisons are only fair between
steps run close together in the same processes. Each variant here gets its own layers,
``PipelineStage``, schedule and optimizer, its own gloo process group (so a PipeDream
stream's pending sends never meet another variant's receives) and, with vpipe, its own
``vpipe.attach`` under a store prefix (control endpoints and plan keys never collide).
Every rank must build and step the variants in the same order.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from vpipe._attach import VpipeConfig, attach
from vpipe.plan import Policy
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.launch import Distributed
from vpipe_lab.runtime.layout import MULTI_STAGE
from vpipe_lab.runtime.models import build_layer
from vpipe_lab.runtime.stage_run import StageRun, build_stage_run

__all__ = ["Variant", "VariantRun", "build_variant"]


@dataclass(frozen=True)
class Variant:
    """One configuration to compare: a schedule (one stage per rank, or several), a micro-batch size, a
    policy, with or without vpipe."""

    name: str
    schedule: str
    micro_batch_size: int
    micro_batches: int
    policy: str = "D"  # without vpipe: D keeps everything, R checkpoints every layer (torch's checkpoint)
    vpipe: bool = False
    memory_budget: int | None = None  # vpipe only: the per-stage budget it enforces
    planning: bool = True  # vpipe only: run the online planner (rebalancing) and apply its plans
    sample_every: int = 2  # vpipe only: monitor every k-th step
    moves: bool = True  # vpipe only: plans may move layers (False: policies only)
    # layers per (virtual) stage; None: the base's (an even split if multi-stage)
    partition: list[int] | None = None

    def config(self, base: RunConfig) -> RunConfig:
        partition = self.partition
        if partition is None and self.schedule not in MULTI_STAGE:
            partition = base.partition
        return replace(base, schedule=self.schedule, micro_batch_size=self.micro_batch_size,
                       micro_batches=self.micro_batches, vpipe=self.vpipe, policy=self.policy,
                       partition=partition,
                       memory_budget=self.memory_budget if self.vpipe else None, progress=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class VariantRun:
    """A built variant on this rank: step it, read its vpipe state, close it."""

    def __init__(self, variant: Variant, run: StageRun, vp: Any) -> None:
        self.variant = variant
        self.run = run
        self.vp = vp
        self.steps = 0

    def step(self) -> None:
        self.run.run_step(self.steps)
        self.steps += 1

    def state(self) -> dict[str, Any]:
        """Where vpipe left the layers and policies (empty without vpipe)."""
        if self.vp is None:
            return {}
        out: dict[str, Any] = dict(self.vp.state())
        managers = [tm for _, tm in sorted(self.vp.tensor_managers.items())]
        if managers:  # a rank's stages in model order; policies of two stages read "DD/SR"
            stats = [tm.stats() for tm in managers]
            budgets = [s.budget_bytes for s in stats]
            policies = ("".join(s.layers[lid].policy.value for lid in sorted(s.layers)) for s in stats)
            out.update(policies="/".join(policies),
                       peak_saved_bytes=sum(s.peak_resident_bytes for s in stats),
                       budget_bytes=None if None in budgets else sum(budgets),
                       escalations=sum(len(s.escalations) for s in stats),
                       d2h_bytes=sum(s.d2h_bytes for s in stats),
                       hooked=[tm.hooked for tm in managers])
            out["fixed_bytes"] = self.vp.fixed_bytes()
        return out

    def close(self) -> None:
        if self.run.streams:
            self.run.schedule.flush()
        if self.vp is not None:
            self.vp.detach()


def build_variant(variant: Variant, base: RunConfig, ctx: Distributed, index: int) -> VariantRun:
    """Build ``variant`` on this rank (collective: every rank calls it with the same arguments)."""
    cfg = variant.config(base)
    group = dist.new_group(backend="gloo")
    run = build_stage_run(cfg, ctx.rank, ctx.device, group=group)
    vp = None
    if variant.vpipe:
        vp = _attach(cfg, run, variant, dist.PrefixStore(f"vpipe-variant-{index}/", ctx.store))
    elif variant.policy == "R":
        for layer in (layer for module in run.modules for layer in module):
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    elif variant.policy != "D":
        raise ValueError(
            f"variant {variant.name}: without vpipe the policy is D or R, got {variant.policy!r}"
        )
    return VariantRun(variant, run, vp)


def _attach(cfg: RunConfig, run: StageRun, variant: Variant, store: Any) -> Any:
    spec = cfg.model_spec()
    config = VpipeConfig(
        memory_budget=variant.memory_budget, planning=variant.planning, sample_every=variant.sample_every,
        layer_factory=(lambda lid, layer_spec: build_layer(layer_spec, lid, cfg.seed)) if variant.moves
                         else None,
        specs=dict(enumerate(spec.layers)), policies={lid: Policy(variant.policy)
                                                      for lid in range(cfg.n_layers)},
    )
    return attach(run.schedule, optimizer=run.optimizer, config=config, store=store)

