"""What a draw may combine, after ``--set``: a forced value's constraints re-applied, or one line why not.

``draw(seed)`` applies each constraint where its axis is drawn (tests/fuzz/draws.py, late.py).
A value forced by hand (``run.py --set schedule=2bw``) skips that: :func:`force` re-applies the
constraints of the values that bring their own (PipeDream's schedules, data-parallel replicas,
tensor parallelism, DeepSpeed's engine, a schedule with another number of stages), and
:func:`violations` names every combination that is still not supported, so ``--set`` refuses it
in one line instead of erroring in every seed.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from fuzz.draws import FSDP_FUSED, FUSED, MULTI_STAGE, PIPEDREAM, Draw, _split
from fuzz.late import fused_sgd_skips_its_first_step


class Unsupported(ValueError):
    """A forced value that does not combine with the rest of the seed's draw."""


def force(before: Draw, d: Draw, changes: dict[str, Any]) -> Draw:
    """``d`` (``before`` with ``changes``) with the forced values' own constraints applied again."""
    from fuzz.late import _pipedream, _plans, _replicas, deepspeed, tensor_parallel

    rng = random.Random(f"forced-{d.seed}")
    schedule = changes.get("schedule", before.schedule)
    if schedule in PIPEDREAM and before.schedule != schedule:
        d = replace(d, schedule="1f1b")  # split over its 2 stages first, then PipeDream's own constraints
    if d.num_stages != before.num_stages:
        # another number of stages: a new first split and new plans over the same blocks (no layer edit; a
        # tied pair, which must start on one stage, unties)
        layers = max(d.layers, 8) if d.num_stages == 4 else d.layers
        tied = d.block_state == "tied"
        d = replace(d, layers=layers, policies=(d.policies * 2)[:layers], nas_remove=(), nas_add=(),
                    counts=_split(rng, layers, d.num_stages), pinned=() if tied else d.pinned,
                    block_state="plain" if tied else d.block_state)
        d = replace(d, plans=_plans(rng, d, sorted(rng.sample(range(1, d.steps), 2))))
    if schedule in PIPEDREAM and before.schedule != schedule:
        d = _pipedream(rng, d, schedule)
    mesh = changes.get("dp", "none") != "none" and before.dp == "none" or changes.get("tp", "none") != "none"
    if mesh and d.schedule in PIPEDREAM and "schedule" not in changes:  # PipeDream draws run on 2 ranks
        d = replace(d, schedule="1f1b")
    if changes.get("dp", "none") != "none" and before.dp == "none":
        d = replace(_replicas(rng, d), dp=changes["dp"])
    if d.dp == "zero" and d.extra == "muon":  # ZeRO wraps one optimizer class
        d = replace(d, extra="none")
    if changes.get("tp", "none") != "none" and before.tp == "none":
        d = tensor_parallel(rng, d)
    if d.compiled == "wrap" and d.schedule == "zbv":  # torch's ZBV refuses an OptimizedModule
        d = replace(d, compiled="in_place")
    if d.block_state == "tied" and d.schedule == "zbv":  # ZBV's weight backward fails on a shared module
        d = replace(d, block_state="plain", pinned=())
    if changes.get("engine") == "deepspeed" and before.engine != "deepspeed":
        d = deepspeed(rng, d)
    if changes.get("scaler") == "skips" and not d.inf_steps:  # the steps that overflow, as drawn
        d = replace(d, inf_steps=tuple(sorted(rng.sample(range(d.steps), rng.randint(1, 2)))))
    if changes.get("scaler") == "none":
        d = replace(d, inf_steps=())
    if d.ranks == 2 and d.mesh:  # ``--set dp=none`` / ``tp=none``: one pipeline on 2 ranks
        d = replace(d, mesh="")
    return d


def violations(d: Draw) -> list[str]:
    """Each combination of ``d`` that the fuzzer does not run (empty: it runs)."""
    out: list[str] = []

    def rule(broken: bool, why: str) -> None:
        if broken:
            out.append(why)

    dtensor = d.fsdp or d.tp != "none"
    rule(d.impl == "fused" and d.optimizer not in (FSDP_FUSED if dtensor else FUSED),
         f"no fused {d.optimizer} for these parameters in torch")
    rule(d.impl == "fused" and d.optimizer == "sgd" and bool(d.nas_add),
         "torch's fused SGD cannot step a block added to a group that has stepped")
    rule(fused_sgd_skips_its_first_step(d),
         "torch's fused SGD keeps uninitialised momentum when GradScaler skips its first step")
    rule(d.block_state == "tied" and (dtensor or d.schedule == "zbv" or d.engine == "deepspeed"),
         "tied blocks only without FSDP2, tensor parallelism, ZBV or DeepSpeed")
    rule(d.clip == "global" and (d.block_state == "batchnorm" or d.shape == "mixed" or d.extra == "muon"),
         "global clipping's rounding grows past the tolerance with BatchNorm, MoE routing or Muon")
    rule(sum(d.counts) != d.layers or len(d.counts) != d.num_stages or not all(d.counts),
         f"the first split {d.counts} does not fit {d.layers} blocks on {d.num_stages} stages")
    rule(sum(x != "none" for x in (d.dp, d.tp)) + d.fsdp + (d.engine != "torch") > 1,
         "one of fsdp, dp, tp and engine=deepspeed at a time (4 ranks at most)")
    rule(d.ranks == 4 and d.moves == "planner", "moves=planner only on 2 ranks (it would act on contention)")
    rule(bool(d.nas_remove or d.nas_add) and d.fsdp, "no layer edit under FSDP2")
    rule(d.fsdp and (d.extra != "none" or d.weights != "plain"), "FSDP2 draws: no Muon, EMA or weight_norm")
    rule(d.tp != "none" and (d.compiled != "none" or d.scaler != "none"),
         "no compile or GradScaler with tensor parallelism")
    rule(d.compiled == "wrap" and d.schedule == "zbv", "ZBV compiles its blocks in place")
    rule(d.dp == "zero" and d.extra == "muon", "ZeRO wraps one optimizer class: no Muon")
    rule(d.schedule in PIPEDREAM and (d.accum != 1 or d.lr_scheduler != "none" or d.clip != "none"
                                      or d.scaler != "none" or d.extra != "none" or d.ranks != 2
                                      or d.nas != "none" or d.block_state == "batchnorm"
                                      or d.shape != "sequential"),
         f"{d.schedule} steps the optimizer itself: no accumulation, LR scheduler, clipping, GradScaler, "
         "Muon, EMA, layer edit or BatchNorm, a sequential stage on 2 ranks")
    rule(d.tp != "none" and (d.impl != "forloop" or d.clip != "none" or d.extra != "none"
                             or d.weights != "plain" or d.schedule in PIPEDREAM),
         "tensor-parallel draws step for-loop, clip nothing, and have no Muon, EMA, weight_norm or PipeDream")
    rule(d.engine == "deepspeed" and (d.shape != "sequential" or d.schedule != "1f1b" or d.accum != 1
                                      or d.nas != "none" or d.extra != "none" or d.compiled != "none"
                                      or d.clip != "none" or d.moves != "forced"
                                      or d.counts != (d.layers // 2, d.layers - d.layers // 2)),
         "DeepSpeed draws: its uniform partition of a sequential stage, forced plans, no accumulation, "
         "layer edit, Muon, EMA, compile or clipping")
    rule(d.schedule in MULTI_STAGE and d.layers < 4, "four stages need four blocks")
    return out
