"""The ``engine`` axis: the draw trained by DeepSpeed's ``PipelineEngine`` instead of torch's schedules.

Both copies are DeepSpeed engines, as GPT-NeoX and Megatron-DeepSpeed build theirs: a
``PipelineModule`` of the draw's blocks (the same initial tensors in both), DeepSpeed's uniform
partition over 2 stages, fp32 without ZeRO, the drawn torch optimizer and LR scheduler handed
to ``deepspeed.initialize`` and stepped by ``engine.train_batch`` (4 micro-batches a step). The
vpipe copy is ``vpipe.attach(engine)`` with the drawn plans forced. DeepSpeed's engines run on
groups of their own (its grid); its p2p goes over the world group, one step at a time.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import psutil
import torch
import torch.distributed as dist

from fuzz.draws import Draw
from fuzz.models import CountingHook, batch, loss_fn, whole_model
from fuzz.trainer import LR, Copy, _groups, _lr_scheduler, _optimizer

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def warm_up() -> None:
    """DeepSpeed's communication backend over the job's world, made once a job before its first draw: the
    first time on a machine it builds its CPU communication op (2-4 minutes on 2 shared cores), which no
    draw's timeout should count."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def _engine(d: Draw, name: str, blocks: list[torch.nn.Module]) -> Copy:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(layers=[copy.deepcopy(b) for b in blocks], num_stages=d.num_stages,
                            loss_fn=loss_fn(d), partition_method="uniform")
    stage = int(module.stage_id)
    for f in module.forward_funcs:  # a user's stateful hook on the pinned block, where it is built
        if getattr(f, "layer_id", None) in d.pinned and d.block_state == "hook":
            f.register_forward_hook(CountingHook())
    optimizer = _optimizer(d, _groups(d, [(stage, module)], LR[d.optimizer]))
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
                              "gradient_accumulation_steps": d.micro_batches, "wall_clock_breakdown": False}
    # DeepSpeed clips by default (gradient_clipping 1.0), by a norm over the parameters of its model-parallel
    # rank 0 only (deepspeed.runtime.utils.clip_grad_norm_ skips the other stages' plain parameters): stage
    # 0's blocks, a different set on every split, so moves change the clip factor (fuzzer seed 17, 1e-3 of a
    # weight a step). DeepSpeed draws turn it off, as users who clip themselves do
    config["gradient_clipping"] = 0.0
    engine, _, _, scheduler = deepspeed.initialize(model=module, optimizer=optimizer, config=config,
                                                   lr_scheduler=_lr_scheduler(d, optimizer))
    schedulers = [s for s in (scheduler,) if s is not None]
    return Copy(name, [stage], [engine.module], engine, [optimizer], schedulers,
                pp_group=engine.grid.get_pipe_parallel_group())


def _micro_batches(d: Draw, step: int) -> Any:
    x, y = batch(d, step, 0)
    return iter(list(zip(x.chunk(d.micro_batches), y.chunk(d.micro_batches))))


def held(c: Copy) -> list[Any]:
    """The layer ids this stage's engine runs, in order."""
    return [getattr(f, "layer_id", type(f).__name__) for f in c.schedule.module.forward_funcs]


def _attach(d: Draw, st: Any, moved: Copy, log_file: Any) -> Any:
    """``vpipe.attach(engine)`` with the drawn policies, and the drawn plans requested."""
    import vpipe
    from vpipe.plan import Plan, Policy

    st.phase = "attach"
    st.vp = vp = vpipe.attach(moved.schedule, planning=False, min_swap_bytes=0, log_file=str(log_file),
                              policies=dict(enumerate(d.policies)), agree_timeout_s=30)
    for epoch, (at, counts, policies) in enumerate(d.plans, start=1):
        stages = d.plan_stages(at, counts)
        vp.request_plan(Plan(epoch=epoch, stages=tuple(tuple(s) for s in stages),
                             policies={i: Policy(policies[i]) for s in stages for i in s}), at_step=at)
    return vp


def train_deepspeed(d: Draw, st: Any, log_file: Any) -> dict[str, Any]:
    """Build both engines, attach vpipe to one, force the plans, train both step by step (collective)."""
    from fuzz.compare import fingerprint, snapshot

    _, blocks, _ = whole_model(d)
    copies = {name: _engine(d, name, blocks) for name in ("plain", "vpipe")}
    prints: dict[str, list] = {name: [] for name in copies}
    placements: list = []
    vp: Any = None
    last = d.num_stages - 1
    for name, c in copies.items():
        if name == "vpipe":  # after the plain copy trained: nothing of vpipe's is there while it does
            vp = _attach(d, st, c, log_file)
            placements.append([list(s) for s in vp.placement])
        for step in range(d.steps):
            st.phase = f"train:{name}@{step}"
            loss = c.schedule.train_batch(data_iter=_micro_batches(d, step))
            if last in c.stages:
                c.losses.append([float(loss)])
            prints[name].append(fingerprint(d, c))
            if name == "vpipe":
                placements.append([list(s) for s in vp.placement])
    st.phase = "detach"
    moved = copies["vpipe"]
    stage = moved.stages[0]
    mismatch = {stage: held(moved)} if held(moved) != list(vp.placement[stage]) else {}
    vp.detach()
    st.phase = "snapshot"
    return {"rank": dist.get_rank(), "losses": {name: {0: c.losses} for name, c in copies.items()},
            "prints": prints, "states": {name: snapshot(d, c) for name, c in copies.items()},
            "placements": placements, "mismatch": {str(k): v for k, v in mismatch.items()},
            "rss_mb": psutil.Process().memory_info().rss / 2**20}
