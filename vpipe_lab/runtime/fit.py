"""Does a pipeline configuration fit a per-stage memory budget? Each stage, run for real, in this process.

A stage's memory depends only on its own layers, its schedule's order of forwards and
backwards, and its budget, so every stage of a configuration can be checked in one
process, one after another, without launching the pipeline: build the stage's layers,
feed them micro-batches of the right boundary shape in the order
:func:`vpipe_lab.runtime.simulate.action_order` gives, under the real tensor manager.

- **managed** (vpipe): the manager gets the activation budget ``attach`` would give it
  (budget minus the stage's fixed bytes) and escalates keep -> swap -> recompute as it
  does in training; the stage fits if no :class:`MemoryBudgetError` is raised;
- **unmanaged** (a baseline without vpipe, every layer on one fixed policy): the manager
  only counts; the stage fits if its footprint is within the budget.

Footprint = fixed bytes (weights, gradients, optimizer state, PipeDream's extra weight
versions) + peak saved activations (the manager's ledger) + the working set of the
largest recomputed layer (a recompute materialises that layer's activations in its
backward). Swapped bytes live in the host pool and do not count against the device.

Under a multi-stage schedule the budget is a rank's: its virtual stages run together in the
rank's own order (torch's action lists), each under its own tensor manager; managed, each
gets a share of what the rank's fixed bytes leave of the budget: equal, or, once every stage
measured what keeping its layers needs and the rank's peak with every layer kept fits, as
``vpipe.sharing`` divides it (after each step, as ``attach`` does). A rank's peak saved bytes
are the peak of its stages' sum (saved bytes only grow in forwards), or the sum of their
peaks where a managed stage swaps or recomputes (their transients peak inside a forward).
A zero-bubble schedule's activations
are freed at the weight pass (W), the input pass (I) frees nothing here: a slight
overestimate, never an underestimate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from vpipe.compat.torch_distributed import get_schedule_ops
from vpipe.plan import Policy
from vpipe.sharing import keep_all_shares
from vpipe.stage.pipeline import action_kind, flat_actions, in_flight_together
from vpipe.tensor_manager import MemoryBudgetError, TensorManager
from vpipe.tensor_manager.budget import expected_state_factor, stage_fixed_bytes
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.models import build_model
from vpipe_lab.runtime.optim import make_optimizer
from vpipe_lab.runtime.simulate import action_order
from vpipe_lab.runtime.stage_run import multi_stage_class, sub_spec

__all__ = ["StageFit", "PipelineFit", "pipeline_fit", "largest_fitting"]


@dataclass(frozen=True)
class StageFit:
    stage: int  # the rank, under a multi-stage schedule
    budget_bytes: int
    fixed_bytes: int
    peak_saved_bytes: int
    working_bytes: int
    error: str | None = None  # the MemoryBudgetError of a managed stage
    policies: str = ""  # per layer after the run, e.g. "DDSR" ("DD/SR": a rank's two stages)

    @property
    def footprint_bytes(self) -> int:
        return self.fixed_bytes + self.peak_saved_bytes + self.working_bytes

    @property
    def fits(self) -> bool:
        return self.error is None and self.footprint_bytes <= self.budget_bytes


@dataclass(frozen=True)
class PipelineFit:
    micro_batch_size: int
    stages: list[StageFit]

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "fits": self.fits,
                "stages": [{**s.__dict__, "footprint_bytes": s.footprint_bytes, "fits": s.fits}
                           for s in self.stages]}


def pipeline_fit(cfg: RunConfig, budget_bytes: int, *, managed: bool, policy: str = "D",
                 steps: int = 2) -> PipelineFit:
    """Run every stage of ``cfg`` (its schedule, partition, micro-batches) for ``steps`` steps and check its
    memory in the last step (the manager measures activation sizes in the first). One :class:`StageFit`
    per stage, or per rank under a multi-stage schedule."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        inputs = _stage_inputs(cfg)
        if cfg.multi_stage:
            fits = [_rank_fit(cfg, r, inputs, budget_bytes, managed=managed, policy=policy, steps=steps)
                    for r in range(cfg.stages)]
        else:
            fits = [_stage_fit(cfg, k, inputs[k], budget_bytes, managed=managed, policy=policy, steps=steps)
                    for k in range(cfg.stages)]
    finally:
        torch.set_num_threads(previous)
    return PipelineFit(cfg.micro_batch_size, fits)


def largest_fitting(fits: Callable[[int], bool], *, low: int = 1, high: int = 1024) -> int:
    """The largest ``n`` in ``[low, high]`` with ``fits(n)`` (0 if
    not even ``low``), assuming fit is monotone."""
    if not fits(low):
        return 0
    good, n = low, low
    while n < high:  # double until it fails, then bisect
        n = min(high, n * 2)
        if not fits(n):
            bad = n
            break
        good = n
    else:
        return good
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def _stage_inputs(cfg: RunConfig) -> list[list[torch.Tensor]]:
    """Per stage, the input of each micro-batch of step 0 (the boundary tensors the previous stage sends)."""
    spec = cfg.model_spec()
    model = build_model(spec, seed=cfg.seed)
    x, _ = spec.batch(0, cfg.batch_size, cfg.seed)
    chunks = list(x.tensor_split(cfg.micro_batches))
    per_stage: list[list[torch.Tensor]] = []
    start = 0
    layers = list(model)
    with torch.no_grad():
        for count in cfg.layer_counts():
            per_stage.append(chunks)
            for layer in layers[start:start + count]:
                chunks = [layer(c) for c in chunks]
            start += count
    return per_stage


def _stage_fit(cfg: RunConfig, k: int, inputs: list[torch.Tensor], budget: int, *, managed: bool, policy: str,
               steps: int) -> StageFit:
    spec = cfg.model_spec()
    ids = cfg.stage_layer_ids()[k]
    module = build_model(sub_spec(spec, ids), seed=cfg.seed, ids=ids)
    optimizer = make_optimizer(cfg, module.parameters())
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    versions = (cfg.stages - k if cfg.schedule == "pipedream" else 2 if cfg.schedule == "pipedream2bw"
                else 2 if cfg.schedule == "wpipe" and k < cfg.stages else 1)
    fixed = stage_fixed_bytes(params, expected_state_factor(optimizer) * params, versions)
    layers = {int(name): child for name, child in module.named_children()}
    manager = TensorManager(layers, device="cpu", budget_bytes=(budget - fixed) if managed and budget > fixed
                            else None,
                            policies={lid: Policy(policy) for lid in layers})
    last = k == cfg.stages - 1
    loss_fn = spec.loss_fn()
    _, y = spec.batch(0, cfg.batch_size, cfg.seed)
    targets = list(y.tensor_split(cfg.micro_batches))
    error = (None if not managed or budget > fixed
             else f"stage {k}: fixed bytes {fixed} exceed the budget {budget}")
    try:
        if error is None:
            _run_stage(cfg, k, module, manager, optimizer, inputs, targets if last else None, loss_fn, steps,
                       action_order)
    except MemoryBudgetError as e:
        error = str(e)
    finally:
        stats = manager.stats()
        manager.close()
    recomputed = [lid for lid, s in stats.layers.items() if s.policy is Policy.RECOMPUTE]
    working = max((stats.layers[lid].activation_bytes_per_micro_batch for lid in recomputed), default=0)
    return StageFit(stage=k, budget_bytes=budget, fixed_bytes=fixed,
                    peak_saved_bytes=stats.peak_resident_bytes,
                    working_bytes=working, error=error,
                    policies="".join(stats.layers[lid].policy.value for lid in sorted(stats.layers)))


def _run_stage(cfg: RunConfig, k: int, module: torch.nn.Module, manager: Any,
               optimizer: torch.optim.Optimizer,
               inputs: list[torch.Tensor], targets: list[torch.Tensor] | None, loss_fn: Any, steps: int,
               action_order: Any) -> None:
    m = cfg.micro_batches
    outputs: dict[int, torch.Tensor] = {}
    for kind, mb in action_order(cfg.schedule, k, cfg.stages, m, steps):
        if kind == "F" and mb == (steps - 1) * m:
            manager.reset_peak()  # the last step is the steady state: the first ones still measure sizes
        if kind == "F":
            x = inputs[mb % m]
            x = x.detach().requires_grad_(x.is_floating_point())
            with manager.micro_batch(mb):
                out = module(x)
            outputs[mb] = loss_fn(out, targets[mb % m]) if targets is not None else out
        elif kind == "B":
            out = outputs.pop(mb)
            with manager.backward(mb):
                out.backward(None if targets is not None else torch.ones_like(out))
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def _rank_fit(cfg: RunConfig, rank: int, inputs: list[list[torch.Tensor]], budget: int, *, managed: bool,
              policy: str, steps: int) -> StageFit:
    """One rank of a multi-stage schedule: its stages in the rank's action order, one optimizer over them."""

    spec = cfg.model_spec()
    placement = cfg.stage_layer_ids()
    indices = cfg.rank_stages(rank)
    modules = {v: build_model(sub_spec(spec, placement[v]), seed=cfg.seed, ids=placement[v]) for v in indices}
    optimizer = make_optimizer(cfg, [p for v in indices for p in modules[v].parameters()])
    factor = expected_state_factor(optimizer)
    fixed, managers = {}, {}
    for v in indices:
        params = sum(p.numel() * p.element_size() for p in modules[v].parameters())
        fixed[v] = stage_fixed_bytes(params, factor * params)
    share = (budget - sum(fixed.values())) // len(indices)  # each stage's room for activations
    for v in indices:
        layers = {int(name): child for name, child in modules[v].named_children()}
        managers[v] = TensorManager(layers, device="cpu", budget_bytes=share if managed and share > 0
                                    else None,
                                    policies={lid: Policy(policy) for lid in layers})
    error = (f"rank {rank}: its stages' fixed bytes {sum(fixed.values())} exceed the budget {budget}"
             if managed and share <= 0 else None)

    together = in_flight_together({rank: _rank_actions(cfg, rank)}, len(placement))

    def reshare() -> None:  # between steps, as vpipe.rank.memory shares a rank's budget
        needs = [managers[v].keep_all_need() for v in indices]
        shares = keep_all_shares(budget - sum(fixed.values()), [kept for kept, _ in needs],
                                 [count for _, count in needs], together, indices)
        if managed and shares is not None:
            for v, part in zip(indices, shares):
                managers[v].budget_bytes = int(part)
                managers[v].relax()

    peak = 0
    try:
        if error is None:
            peak = _run_rank(cfg, rank, modules, managers, optimizer, inputs, spec, steps, reshare)
    except MemoryBudgetError as e:
        error = str(e)
    finally:
        stats = {v: managers[v].stats() for v in indices}
        for manager in managers.values():
            manager.close()
    if managed and any(layer.policy is not Policy.KEEP for s in stats.values()
                       for layer in s.layers.values()):
        # a swap's or recompute's transients: own peaks
        peak = sum(s.peak_resident_bytes for s in stats.values())
    working = max((s.layers[lid].activation_bytes_per_micro_batch for s in stats.values() for lid in s.layers
                   if s.layers[lid].policy is Policy.RECOMPUTE), default=0)
    return StageFit(stage=rank, budget_bytes=budget, fixed_bytes=sum(fixed.values()), peak_saved_bytes=peak,
                    working_bytes=working, error=error,
                    policies="/".join("".join(s.layers[lid].policy.value for lid in sorted(s.layers))
                                      for s in stats.values()))


def _run_rank(cfg: RunConfig, rank: int, modules: Mapping[int, torch.nn.Module], managers: dict[int, Any],
              optimizer: torch.optim.Optimizer, inputs: list[list[torch.Tensor]], spec: Any, steps: int,
              between_steps: Callable[[], None]) -> int:
    """Run ``steps`` steps of the rank; returns the peak of its
    stages' summed saved bytes in the last step."""
    m, last = cfg.micro_batches, cfg.virtual_stages - 1
    loss_fn = spec.loss_fn()
    _, y = spec.batch(0, cfg.batch_size, cfg.seed)
    targets = list(y.tensor_split(m))
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    peak = 0
    for kind, v, mb in rank_action_order(cfg, rank, steps):
        if kind == "F" and mb == (steps - 1) * m and v == min(modules):
            peak = 0
            for manager in managers.values():
                manager.reset_peak()  # the last step is the steady state: the first ones still measure sizes
        if kind == "F":
            x = inputs[v][mb % m]
            x = x.detach().requires_grad_(x.is_floating_point())
            with managers[v].micro_batch(mb):
                out = modules[v](x)
            outputs[(v, mb)] = loss_fn(out, targets[mb % m]) if v == last else out
            peak = max(peak, sum(manager.ledger.resident for manager in managers.values()))
        elif kind == "B":
            out = outputs.pop((v, mb))
            with managers[v].backward(mb):
                out.backward(None if v == last else torch.ones_like(out))
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            between_steps()
    return peak


def _rank_actions(cfg: RunConfig, rank: int) -> list[Any]:
    """One step's actions of ``rank`` under ``cfg``'s multi-stage schedule, as torch lists them."""
    if get_schedule_ops is None:
        raise RuntimeError(f"torch {torch.__version__} has no schedule visualizer to read "
                           f"{cfg.schedule}'s action lists from")
    return get_schedule_ops(multi_stage_class(cfg.schedule), cfg.stages, cfg.micro_batches,
                            cfg.n_local_stages)[rank]


def rank_action_order(cfg: RunConfig, rank: int, steps: int) -> list[tuple[str, int, int]]:
    """``(kind, stage, global micro-batch)`` of ``rank`` under ``cfg``'s multi-stage schedule over
    ``steps`` steps, read off torch's own action lists: ``F`` forward, ``B`` backward (a zero-bubble weight
    pass ``W``; its input pass ``I`` is left out), ``O`` the optimizer step at the end of each step."""
    one_step = []
    for action in flat_actions(_rank_actions(cfg, rank)):
        kind = action_kind(action)
        if kind in ("F", "B", "W"):
            one_step.append(("F" if kind == "F" else "B", action.stage_index, action.microbatch_index))
    out = []
    for step in range(steps):
        out += [(kind, v, step * cfg.micro_batches + mb) for kind, v, mb in one_step]
        out.append(("O", -1, (step + 1) * cfg.micro_batches - 1))
    return out




def with_micro_batch(cfg: RunConfig, micro_batch_size: int, global_batch: int | None = None) -> RunConfig:
    """``cfg`` at another micro-batch size, keeping the global batch when ``global_batch`` is given."""
    micro_batches = cfg.micro_batches if global_batch is None else max(1, global_batch // micro_batch_size)
    return replace(cfg, micro_batch_size=micro_batch_size, micro_batches=micro_batches)
