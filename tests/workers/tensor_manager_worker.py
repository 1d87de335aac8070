"""A pipeline run under real torch.distributed (gloo), with and without a tensor manager.

Run as ``python -m tensor_manager_worker --schedule gpipe --scenarios S,R,... --out DIR``
(``tests/`` on the path): without ``RANK`` it spawns its ranks through vpipe's launcher,
as ``vpipe train`` does. Every rank trains the same steps once without a manager (the
baseline) and once per scenario with one, reseeding the RNG identically (dropout is on),
and writes ``rankN.json``: per scenario, whether every gradient of every step and every
final parameter equals the baseline bit for bit, and the manager's statistics.

Scenarios: ``D``/``S``/``R`` (every layer), ``mix`` (a fixed random mix), ``switch``
(policies change before every micro-batch's forward, mid-step), ``budget`` (a budget of
``--budget-fraction`` of the ``D`` scenario's peak on this rank; needs ``D`` first).
Schedules: ``gpipe``, ``1f1b``, ``pipedream`` (one stage per rank) and the zero-bubble
ones, two stages per rank, which split every backward into an input and a weight pass:
``zb`` (ScheduleInterleavedZeroBubble, stages r and r + ranks), ``zbv``
(ScheduleZBVZeroBubble) and ``dualpipev`` (ScheduleDualPipeV), both V-shaped (stages r and
2 ranks - 1 - r, so rank 0 holds the first and the last stage).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from vpipe.plan import Policy
from vpipe.schedules.pipedream import SchedulePipeDream
from vpipe.tensor_manager import TensorManager, install_on_stage
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.models import build_model
from vpipe_lab.runtime.optim import make_optimizer
from vpipe_lab.runtime.stage_run import build_stage_run

CYCLE = (Policy.SWAP, Policy.RECOMPUTE, Policy.KEEP)
SPLIT = {"zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "pipedream", *SPLIT), required=True)
    p.add_argument("--model", choices=("transformer", "cnn"), default="transformer")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--scenarios", default="D,S,R,mix")
    p.add_argument("--budget-fraction", type=float, default=0.4)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def run_config(args: argparse.Namespace) -> RunConfig:
    stages = args.ranks * (2 if args.schedule in SPLIT else 1)
    return RunConfig(model=args.model, blocks=args.blocks, d_model=32, n_heads=2, seq_len=16, dropout=0.1,
                     stages=stages, schedule="1f1b" if args.schedule in SPLIT else args.schedule,
                     micro_batches=args.micro_batches, micro_batch_size=2, steps=args.steps, progress=False)


class Pipeline:
    """This rank's stages, schedule and optimizer for one training run."""

    def __init__(self, args: argparse.Namespace, cfg: RunConfig, rank: int, device: torch.device) -> None:
        self.args, self.cfg, self.rank = args, cfg, rank
        if args.schedule in SPLIT:
            spec = cfg.model_spec()
            v_shaped = args.schedule != "zb"
            self.stage_ids = [rank, 2 * args.ranks - 1 - rank if v_shaped else rank + args.ranks]
            self.modules = []
            stages = []
            for s in self.stage_ids:
                ids = cfg.stage_layer_ids()[s]
                module = build_model(replace(spec, layers=[spec.layers[i] for i in ids]), seed=cfg.seed,
                                     ids=ids)
                self.modules.append(module)
                stages.append(PipelineStage(module, s, cfg.stages, device))
            self.stages = stages
            self.schedule: Any = SPLIT[args.schedule](stages, cfg.micro_batches, loss_fn=spec.loss_fn())
            self.optimizer = make_optimizer(cfg, [p for m in self.modules for p in m.parameters()])
        else:
            run = build_stage_run(cfg, rank, device)
            self.stage_ids, self.modules, self.stages = [rank], [run.module], [run.stage]
            self.schedule, self.optimizer = run.schedule, run.optimizer
        self.managers: list[TensorManager] = []

    @property
    def first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def last(self) -> bool:
        return self.cfg.stages - 1 in self.stage_ids

    def attach(self, policies: dict[int, Policy], budget: int | None) -> None:
        for module, stage in zip(self.modules, self.stages):
            layers = {int(name): child for name, child in module.named_children()}
            manager = TensorManager(layers, device=torch.device("cpu"), min_swap_bytes=0, budget_bytes=budget,
                                    host_pool_bytes=64 << 20, host_pool_chunk_bytes=1 << 20,
                                    policies={lid: policies[lid] for lid in layers})
            install_on_stage(stage, manager)
            self.managers.append(manager)

    def switch_policies_before_each_forward(self) -> None:
        """Wrap (outside the manager's wrapper) so policies change between micro-batches mid-step."""
        self.forwards = 0
        for stage, manager in zip(self.stages, self.managers):
            inner = stage.forward_one_chunk

            def forward(chunk: int, *a: Any, _inner: Any = inner, _manager: TensorManager = manager,
                        **kw: Any) -> Any:
                self.forwards += 1
                for lid in _manager.layer_ids:
                    _manager.set_policy(lid, CYCLE[(lid + self.forwards) % len(CYCLE)])
                return _inner(chunk, *a, **kw)

            stage.__dict__["forward_one_chunk"] = forward

    def train(self) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        grads = []
        spec = self.cfg.model_spec()
        for step in range(self.cfg.steps):
            x, y = spec.batch(step, self.cfg.batch_size, self.cfg.seed)
            args = (x,) if self.first else ()
            target = y if self.last else None
            self.schedule.step(*args, target=target, losses=[] if self.last else None)
            if isinstance(self.schedule, SchedulePipeDream):
                continue  # it steps its optimizer per micro-batch itself
            grads.append({f"{sid}.{n}": p.grad.clone() for sid, m in zip(self.stage_ids, self.modules)
                          for n, p in m.named_parameters() if p.grad is not None})
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if isinstance(self.schedule, SchedulePipeDream):
            self.schedule.flush()
        params = {f"{sid}.{n}": p.detach().clone() for sid, m in zip(self.stage_ids, self.modules)
                  for n, p in m.named_parameters()}
        return grads, params


def policies_for(scenario: str, cfg: RunConfig) -> dict[int, Policy]:
    layers = range(cfg.n_layers)
    if scenario in ("D", "budget", "switch"):
        return {lid: Policy.KEEP for lid in layers}
    if scenario in ("S", "R"):
        return {lid: Policy(scenario) for lid in layers}
    rng = random.Random(7)
    return {lid: rng.choice(list(Policy)) for lid in layers}


def compare(base: tuple, got: tuple) -> str | None:
    """None if equal bit for bit, else where the first difference is."""
    (base_grads, base_params), (grads, params) = base, got
    if len(base_grads) != len(grads):
        return f"{len(grads)} steps of gradients, baseline has {len(base_grads)}"
    for step, (want, have) in enumerate(zip(base_grads, grads)):
        if sorted(want) != sorted(have):
            return f"step {step}: gradient names differ"
        for name in want:
            if not torch.equal(want[name], have[name]):
                diff = (want[name] - have[name]).abs().max().item()
                return f"step {step}: gradient of {name} differs (max abs {diff:.3e})"
    for name in base_params:
        if not torch.equal(base_params[name], params[name]):
            return f"final parameter {name} differs"
    return None


def stats_record(managers: list[TensorManager]) -> list[dict[str, Any]]:
    out = []
    for m in managers:
        s = m.stats()
        out.append({
            "layers": m.layer_ids,
            "peak": s.peak_resident_bytes, "resident": s.resident_bytes, "budget": s.budget_bytes,
            "d2h_bytes": s.d2h_bytes, "h2d_bytes": s.h2d_bytes, "sync_fallbacks": s.sync_fallbacks,
            "prefetched": s.prefetched, "budget_swaps": s.budget_swaps, "recompute_s": s.recompute_s,
            "escalations": [[lid, a.value, b.value] for lid, a, b in s.escalations],
            "live": s.live_saved_storages, "multi_phase": s.multi_phase_storages,
            "weights_skipped": s.weight_tensors_skipped, "host_used": s.host_pool_used_bytes,
            "policies": {str(k): v.value for k, v in s.policies.items()},
            "refetched": s.refetched_bytes, "h2d_by_phase": s.h2d_bytes_by_phase,
                    "lag_dropped": s.lag_dropped,
            "recomputes": sum(v.recomputes for v in s.layers.values()),
            "recompute_calls": sum(v.recompute_calls for v in s.layers.values()),
            "repeat_recomputes": s.repeat_recomputes,
            "layer_copies": {str(k): [v.d2h_bytes, v.h2d_bytes] for k, v in s.layers.items()},
            "activation": {str(k): v.activation_bytes_per_micro_batch for k, v in s.layers.items()},
        })
    return out


def rank_main(args: argparse.Namespace, ctx: Any) -> None:
    torch.set_num_threads(1)
    cfg = run_config(args)

    def run(policies: dict[int, Policy] | None, budget: int | None = None, switch: bool = False) -> tuple:
        torch.manual_seed(1234 + ctx.rank)
        pipe = Pipeline(args, cfg, ctx.rank, ctx.device)
        if policies is not None:
            pipe.attach(policies, budget)
            if switch:
                pipe.switch_policies_before_each_forward()
        result = pipe.train()
        return result, pipe.managers

    base, _ = run(None)
    record: dict[str, Any] = {"rank": ctx.rank, "scenarios": {}}
    peaks: list[int] = []
    for scenario in args.scenarios.split(","):
        budget = None
        if scenario == "budget":
            if not peaks:
                raise ValueError("the budget scenario needs the D scenario before it (to measure the peak)")
            budget = max(1, int(args.budget_fraction * max(peaks)))
        result, managers = run(policies_for(scenario, cfg), budget, switch=scenario == "switch")
        stats = stats_record(managers)
        if scenario == "D":
            peaks = [s["peak"] for s in stats]
        record["scenarios"][scenario] = {"diff": compare(base, result), "stats": stats}
        for m in managers:
            m.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(record))


def main(argv: list[str]) -> int:
    from vpipe_lab.runtime.launch import init_distributed, rank_env, run_rank, spawn

    args = parse(argv)
    if rank_env() is None:
        return spawn([sys.executable, "-m", "tensor_manager_worker", *argv], args.ranks)
    ctx = init_distributed()
    run_rank(ctx, rank_main, args, ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
