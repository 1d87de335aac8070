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

from vpipe.attach import VpipeConfig, attach
from vpipe.plan import Policy
from vpipe.runtime.config import RunConfig
from vpipe.runtime.launch import Distributed
from vpipe.runtime.models import build_layer
from vpipe.schedules.pipedream import SchedulePipeDream
from vpipe.runtime.trainer import StageRun, build_stage_run

__all__ = ["Variant", "VariantRun", "build_variant"]


@dataclass(frozen=True)
class Variant:
    """One configuration to compare: a schedule, a micro-batch size, a policy, with or without vpipe."""

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

    def config(self, base: RunConfig) -> RunConfig:
        return replace(base, schedule=self.schedule, micro_batch_size=self.micro_batch_size,
                       micro_batches=self.micro_batches, vpipe=self.vpipe, policy=self.policy,
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
        tm = self.vp.tensor_manager
        if tm is not None:
            stats = tm.stats()
            out.update(policies="".join(stats.layers[lid].policy.value for lid in sorted(stats.layers)),
                       peak_saved_bytes=stats.peak_resident_bytes, budget_bytes=stats.budget_bytes,
                       escalations=len(stats.escalations), d2h_bytes=stats.d2h_bytes)
            out["fixed_bytes"] = self.vp.fixed_bytes()
        return out

    def close(self) -> None:
        if isinstance(self.run.schedule, SchedulePipeDream):
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
        for layer in run.module:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    elif variant.policy != "D":
        raise ValueError(f"variant {variant.name}: without vpipe the policy is D or R, got {variant.policy!r}")
    return VariantRun(variant, run, vp)


def _attach(cfg: RunConfig, run: StageRun, variant: Variant, store: Any) -> Any:
    spec = cfg.model_spec()
    config = VpipeConfig(
        memory_budget=variant.memory_budget, planning=variant.planning, sample_every=variant.sample_every,
        layer_factory=(lambda lid, layer_spec: build_layer(layer_spec, lid, cfg.seed)) if variant.moves else None,
        specs=dict(enumerate(spec.layers)), policies={lid: Policy(variant.policy) for lid in range(cfg.n_layers)},
    )
    return attach(run.schedule, optimizer=run.optimizer, config=config, store=store)

