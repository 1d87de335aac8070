"""Rank program for tests/integration/test_stage_shapes.py: one scenario per run, results as JSON from rank 0.

Scenarios (``argv[1]``), launched by ``vpipe_lab.runtime.launch.spawn``:

- ``refusals`` (1 rank): stage shapes and set-ups attach must refuse, each error message;
- ``subgroup`` (2 ranks): pipelines on process groups smaller than the world that are not replicas of
  one pipeline (different blocks), and stages whose index is not their rank;
- ``traced`` (2 ranks): a ``pipeline()`` split (GraphModule stages) trained plainly, then with vpipe
  recomputing every layer and the planner on: losses, what moved, the log;
- ``nas`` (2 ranks): add and remove blocks in the tutorial-shaped ModuleDict;
- ``reattach`` (2 ranks): attach, train while plans come, detach, and again;
- ``budget`` (2 ranks): the tutorial trainer with and without the one line side by side, vpipe's copy under
  a memory budget it fits many times over;
- ``budget_interleaved`` (2 ranks): the tutorial's model split by hand into 4 stages under Interleaved 1F1B,
  with and without the one line side by side, vpipe's copy under a budget the rank's real peak fits and its
  stages' own peaks added up do not;
- ``new_shapes`` (1 rank): the tutorial's model as one stage, plain and with the one line under a roomy
  budget, the batch's sequence length changing between steps: which steps call the tensor manager;
- ``pipedream_budget`` (2 ranks): the PipeDream example's trainer, plain and with the one line under a roomy
  budget: which steps call the tensor manager, and what it counts in flight;
- ``swaps_skipped`` (2 ranks): the tutorial trainer plain and with the one line swapping every block side by
  side, under 1F1B without a budget and under GPipe with one: the losses and the bytes copied per step;
- ``misuse`` (2 ranks): an optimizer over other parameters, layer edits that differ between ranks, made
  inside a forward or on one rank only, attach on one rank only.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    SplitPoint,
    pipeline,
)

ROOT = Path(__file__).resolve().parents[2]


def _tutorial():
    spec = importlib.util.spec_from_file_location("train_tutorial", ROOT / "examples" / "train_tutorial.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_tutorial"] = module
    spec.loader.exec_module(module)
    return module


tut = _tutorial()
sys.path.insert(0, str(ROOT / "examples"))
from block_worker import pipeline_step  # noqa: E402  (this directory is the script's: on the path)

import train_sequential as seq_example  # noqa: E402  (the PipeDream example's model and data)


def _train_step(schedule, optimizer, step: int) -> list[float]:
    """One step of the torch pipelining tutorial's loop on its batch ``step``; the last stage's losses."""
    return pipeline_step(schedule, optimizer, *tut.batch(step, 8, 32, 256))


def _count_manager_calls(manager) -> list[int]:
    """Count the times vpipe's stage wrappers ask ``manager`` whether a micro-batch's forward is quiet
    (once per forward, twice for one that is not)."""
    calls = [0]
    inner = manager.quiet.begin_forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    manager.quiet.begin_forward = counted
    return calls


def _error(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def refusals() -> dict:
    import vpipe

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    def attach(module: nn.Module, **options) -> None:
        stage = PipelineStage(module, 0, 1, torch.device("cpu"))
        schedule = Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss)
        vp = vpipe.attach(schedule, optimizer=torch.optim.SGD(module.parameters()), planning=False, **options)
        vp.detach()

    model = tut.split_model(tut.Transformer(tut.ModelArgs(n_layers=2)), 0, [2])
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    return {
        "no_container": _error(lambda: attach(Flat())),
        "bad_path": _error(lambda: attach(model, layers="blocks")),
        "ddp": _error(lambda: attach(ddp)),
        "tutorial_ok": _error(lambda: attach(model)),
    }


def subgroup() -> dict:
    import vpipe

    rank = dist.get_rank()
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank makes each
    # two one-stage "replicas" that are not replicas: rank 1's pipeline has a block more
    module = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2 + rank)])
    stage = PipelineStage(module, 0, 1, torch.device("cpu"), group=groups[rank])
    schedule = Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss)
    error = _error(lambda: vpipe.attach(schedule, optimizer=torch.optim.SGD(module.parameters())))
    # stage indices that are not the ranks: stage 1 on rank 0, stage 0 on rank 1
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    stage = PipelineStage(module, 1 - rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss)
    swapped = _error(lambda: vpipe.attach(schedule, optimizer=torch.optim.SGD(module.parameters())))
    return {"error": error, "swapped": swapped}


def _traced_run(steps: int, with_vpipe: bool) -> tuple[list[list[float]], dict]:
    import vpipe

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = tut.Transformer(tut.ModelArgs())
    x0, _ = tut.batch(0, 8, 32, 256)
    pipe = pipeline(model, mb_args=(x0[:2],), split_spec={"layers.6": SplitPoint.BEGINNING})  # 6,2 on purpose
    module = pipe.get_stage_module(rank)
    stage = pipe.build_stage(rank, torch.device("cpu"))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    schedule = Schedule1F1B(stage, 4, loss_fn=tut.tokenwise_loss_fn)
    vp = None
    if with_vpipe:
        vp = vpipe.attach(schedule, optimizer=optimizer, policies={i: "R" for i in range(8)}, sample_every=2,
                          planner_options={"warmup_samples": 1})
    losses_per_step = []
    for step in range(steps):
        losses_per_step.append(_train_step(schedule, optimizer, step))
    info = {}
    if vp is not None:
        info = {"layers": vp.layer_ids, "policies": vp.memory_report()["policies"],
                "recomputes": sum(layer.recomputes for layer in vp.tensor_manager._layers.values())}
        vp.detach()
    return losses_per_step, info


def traced() -> dict:
    plain, _ = _traced_run(40, with_vpipe=False)
    with_vpipe, info = _traced_run(40, with_vpipe=True)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, info)
    return {"plain": plain, "vpipe": with_vpipe, "info": gathered}


def nas() -> dict:
    import vpipe

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    args = tut.ModelArgs()
    model = tut.split_model(tut.Transformer(args), rank, [4, 4])
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = Schedule1F1B(stage, 4, loss_fn=tut.tokenwise_loss_fn)

    def make_block(layer_id: int, spec: object) -> nn.Module:
        torch.manual_seed(layer_id)
        return nn.TransformerDecoderLayer(args.dim, args.n_heads, dim_feedforward=4 * args.dim, dropout=0.0)

    vp = vpipe.attach(schedule, optimizer=optimizer, layer_factory=make_block, planning=False)
    keys, new_before, new_after, losses_seen = [], None, None, []
    for step in range(6):
        if step == 2:
            new_ids = vp.add_layers(2, [None])  # before global position 2: on stage 0, between blocks 1 and 2
            keys.append(list(model.layers.keys()))
            if rank == 0:
                new_before = [p.detach().clone() for p in model.layers[str(new_ids[0])].parameters()]
        if step == 4:
            vp.remove_layers([1, 6])
            keys.append(list(model.layers.keys()))
        losses_seen += _train_step(schedule, optimizer, step)
    trained = None
    if rank == 0:
        new_after = list(model.layers[str(new_ids[0])].parameters())
        trained = all(not torch.equal(a, b.detach()) for a, b in zip(new_before, new_after))
    result = {"rank": rank, "new_ids": new_ids, "keys": keys, "new_layer_trained": trained,
              "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups),
              "module_params": len(list(model.parameters())), "losses": losses_seen}
    vp.detach()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    return {"ranks": gathered}


def budget() -> dict:
    """The tutorial trainer twice side by side (a plain copy on its own gloo group,
    and one with the one line and a memory budget it fits many times over): losses,
    and whether vpipe's copy ran its blocks without hooks."""
    import vpipe

    rank, world = dist.get_rank(), dist.get_world_size()

    def build(group):
        torch.manual_seed(0)
        model = tut.split_model(tut.Transformer(tut.ModelArgs()), rank, [4, 4])
        stage = PipelineStage(model, rank, world, torch.device("cpu"), group=group)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, Schedule1F1B(stage, 4, loss_fn=tut.tokenwise_loss_fn), optimizer

    copies = {"plain": build(dist.new_group(backend="gloo")), "vpipe": build(None)}
    model, schedule, optimizer = copies["vpipe"]
    vp = vpipe.attach(schedule, optimizer=optimizer, memory_budget=1 << 30, planning=False)
    calls = _count_manager_calls(vp.tensor_manager)
    losses: dict[str, list[float]] = {name: [] for name in copies}
    hooked_steps, called_steps = [], []
    for step in range(24):
        before = calls[0]
        for name, (_, sched, opt) in copies.items():
            losses[name] += _train_step(sched, opt, step)
        if any(block._forward_pre_hooks for block in model.layers.values()):
            hooked_steps.append(step)
        if calls[0] > before:
            called_steps.append(step)
    stats = vp.tensor_manager.stats()
    result = {"rank": rank, "losses": losses, "hooked_steps": hooked_steps, "called_steps": called_steps,
              "peak": stats.peak_resident_bytes, "budget": stats.budget_bytes,
              "max_sample_every": next(iter(vp.session.monitors.values())).schedule.max_every}
    vp.detach()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    return {"ranks": gathered}


def swaps_skipped() -> dict:
    """The tutorial trainer side by side, plain and with the one line swapping every
    block: under 1F1B without a budget, and under GPipe with a budget; the losses,
    and per step the bytes each rank copied to the host."""
    import vpipe

    rank, world = dist.get_rank(), dist.get_world_size()

    def build(schedule_class, group):
        torch.manual_seed(0)
        model = tut.split_model(tut.Transformer(tut.ModelArgs()), rank, [4, 4])
        stage = PipelineStage(model, rank, world, torch.device("cpu"), group=group)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return schedule_class(stage, 4, loss_fn=tut.tokenwise_loss_fn), optimizer

    result: dict = {"rank": rank}
    for case, schedule_class, budget in (("1f1b", Schedule1F1B, None), ("gpipe", ScheduleGPipe, 8_000_000)):
        copies = {"plain": build(schedule_class, dist.new_group(backend="gloo")),
                  "vpipe": build(schedule_class, None)}
        schedule, optimizer = copies["vpipe"]
        vp = vpipe.attach(schedule, optimizer=optimizer, memory_budget=budget, planning=False,
                          min_swap_bytes=0,
                          policies=dict.fromkeys(range(8), "S"))
        losses: dict[str, list[float]] = {name: [] for name in copies}
        copied = []
        for step in range(6):
            before = vp.tensor_manager.stats().d2h_bytes
            for name, (sched, opt) in copies.items():
                losses[name] += _train_step(sched, opt, step)
            copied.append(vp.tensor_manager.stats().d2h_bytes - before)
        stats = vp.tensor_manager.stats()
        result[case] = {"losses": losses, "copied": copied, "peak": stats.peak_resident_bytes,
                        "budget": stats.budget_bytes, "sync_fallbacks": stats.sync_fallbacks,
                        "policies": sorted(set(p.value for p in stats.policies.values()))}
        vp.detach()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    return {"ranks": gathered}


def budget_interleaved() -> dict:
    """The tutorial's model split by hand into 4 stages, 2 per rank under ScheduleInterleaved1F1B, plain
    and with the one line side by side. vpipe's copy gets a budget between the rank's real peak with every
    block kept and its two stages' own peaks added up, as measured by a first attach with room to spare."""
    import vpipe
    from vpipe.sharing import joint_peak

    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [2, 2, 2, 2]

    def build(group):
        torch.manual_seed(0)
        stages = [PipelineStage(tut.split_model(tut.Transformer(tut.ModelArgs()), v, counts), v, len(counts),
                                torch.device("cpu"), group=group) for v in (rank, rank + world)]
        optimizer = torch.optim.AdamW([p for s in stages for p in s.submod.parameters()], lr=1e-3)
        return ScheduleInterleaved1F1B(stages, 4, loss_fn=tut.tokenwise_loss_fn), optimizer

    probe, probe_optimizer = build(dist.new_group(backend="gloo"))
    vp = vpipe.attach(probe, optimizer=probe_optimizer, memory_budget=1 << 30, planning=False)
    for step in range(3):
        _train_step(probe, probe_optimizer, step)
    local = sorted(vp.tensor_managers)
    needs = [vp.tensor_managers[v].keep_all_need() for v in local]
    kept, in_flight = [k for k, _ in needs], [n for _, n in needs]
    # what a stage that escalated before keeping every layer counts instead: its blocks' activations summed
    summed = [sum(vp.tensor_managers[v].ledger.activation_bytes(lid)
                  for lid in vp.tensor_managers[v].policies())
              for v in local]
    together = [[row[v] for v in local] for row in vp.pipeline.in_flight_together()]
    fixed = vp.fixed_bytes()
    vp.detach()
    rank_peak = joint_peak(kept, in_flight, together)
    counted_peak = joint_peak(summed, in_flight, together)
    own_peaks = sum(n * k for n, k in zip(in_flight, kept))
    room = int(max(rank_peak, counted_peak) + own_peaks) // 2
    rooms: list = [None] * world
    dist.all_gather_object(rooms, (fixed + room, rank))
    budget, decided_by = max(rooms)

    copies = {"plain": build(dist.new_group(backend="gloo")), "vpipe": build(None)}
    schedule, optimizer = copies["vpipe"]
    vp = vpipe.attach(schedule, optimizer=optimizer, memory_budget=budget, planning=False)
    calls = {v: _count_manager_calls(vp.tensor_managers[v]) for v in local}
    losses: dict[str, list[float]] = {name: [] for name in copies}
    called_steps: dict[int, list[int]] = {v: [] for v in local}
    for step in range(16):
        before = {v: c[0] for v, c in calls.items()}
        for name, (sched, opt) in copies.items():
            losses[name] += _train_step(sched, opt, step)
        for v, c in calls.items():
            if c[0] > before[v]:
                called_steps[v].append(step)
    managers = [vp.tensor_managers[v] for v in local]
    result = {"rank": rank, "losses": losses, "budget": budget, "decided_by": decided_by, "fixed": fixed,
              "rank_peak": rank_peak, "counted_peak": counted_peak, "own_peaks": own_peaks,
              "policies": [{str(k): p.value for k, p in m.policies().items()} for m in managers],
              "escalations": [len(m.stats().escalations) for m in managers],
              "hooked": [m.hooked for m in managers],
              "called_steps": [called_steps[v] for v in local]}
    vp.detach()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    return {"ranks": gathered}


def new_shapes() -> dict:
    """One rank, the tutorial's whole model as one stage under Schedule1F1B, plain and with
    the one line side by side, vpipe's copy under a roomy budget; the batch's sequence length
    changes from 32 to 16 at step 6 and back to 32 at step 10. Per step: how many calls
    vpipe's stage wrappers made into the tensor manager."""
    import vpipe

    def build(group):
        torch.manual_seed(0)
        model = tut.split_model(tut.Transformer(tut.ModelArgs()), 0, [8])
        stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=group)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return Schedule1F1B(stage, 4, loss_fn=tut.tokenwise_loss_fn), optimizer

    copies = {"plain": build(dist.new_group(backend="gloo")), "vpipe": build(None)}
    schedule, optimizer = copies["vpipe"]
    vp = vpipe.attach(schedule, optimizer=optimizer, memory_budget=1 << 30, planning=False)
    manager = vp.tensor_manager
    calls = _count_manager_calls(manager)
    losses: dict[str, list[float]] = {name: [] for name in copies}
    per_step, seq_lens, metering, shapes = [], [], [], []
    for step in range(15):  # the last step quiet (13, the second metered sample, hooks its layers)
        seq_len = 16 if 6 <= step < 10 else 32
        before = calls[0]
        for name, (sched, opt) in copies.items():
            x, y = tut.batch(step, 8, seq_len, 256)
            step_losses: list[torch.Tensor] = []
            sched.step(x, target=y, losses=step_losses)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name] += [float(loss.detach()) for loss in step_losses]
        per_step.append(calls[0] - before)
        seq_lens.append(seq_len)
        metering.append(manager.metering)
        shapes.append(None if manager.quiet.input_shapes is None
                      else [list(s) for s in manager.quiet.input_shapes])
    result = {"losses": losses, "calls": per_step, "seq_lens": seq_lens, "metering": metering,
              "input_shapes": shapes, "hooked": manager.hooked}
    vp.detach()
    return result


def pipedream_budget() -> dict:
    """The PipeDream example's trainer (vpipe.SchedulePipeDream, residual MLP blocks split 4,4) plain and
    with the one line side by side, vpipe's copy under a roomy budget. Per step: whether vpipe's stage
    wrappers called the tensor manager, what its ledger counted when the step's first forward reached it
    and when the step ended, and the micro-batches in flight after it."""
    from collections import OrderedDict

    import torch.nn.functional as F

    import vpipe

    rank, world = dist.get_rank(), dist.get_world_size()

    def build(group):
        torch.manual_seed(0)
        layers = [seq_example.ResidualMLP(32) for _ in range(8)]
        module = nn.Sequential(OrderedDict((str(i), layers[i]) for i in range(4 * rank, 4 * rank + 4)))
        stage = PipelineStage(module, rank, world, torch.device("cpu"), group=group)
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
        return module, vpipe.SchedulePipeDream(stage, 4, F.mse_loss, optimizer)

    copies = {"plain": build(dist.new_group(backend="gloo")), "vpipe": build(None)}
    module, schedule = copies["vpipe"]
    vp = vpipe.attach(schedule, optimizer=schedule.optimizer, memory_budget=1 << 30, planning=False)
    manager = vp.tensor_manager
    at_first_forward: dict[int, int] = {}
    step_now = [0]
    inner = manager.quiet.begin_forward

    def first_forward(*args, **kwargs):
        at_first_forward.setdefault(step_now[0], manager.ledger.resident)
        return inner(*args, **kwargs)

    manager.quiet.begin_forward = first_forward
    losses: dict[str, list[float]] = {name: [] for name in copies}
    resident, in_flight = [], []
    for step in range(24):
        step_now[0] = step
        x, y = seq_example.batch(step, 8, 16, 32)
        for name, (_, sched) in copies.items():
            step_losses: list[torch.Tensor] = []
            sched.step(x) if rank == 0 else sched.step(target=y, losses=step_losses)
            losses[name] += [float(loss.detach()) for loss in step_losses]
        resident.append(manager.ledger.resident)
        in_flight.append(len(schedule.in_flight))
    per_mb = sum(layer.kept_bytes for layer in manager._layers.values())
    for _, sched in copies.values():
        sched.flush()
    plain_state, vpipe_state = (m.state_dict() for m, _ in copies.values())
    result = {"rank": rank, "losses": losses, "called_steps": sorted(at_first_forward),
              "at_first_forward": at_first_forward, "resident": resident, "in_flight": in_flight,
              "per_mb": per_mb,
              "after_flush": manager.ledger.resident,
              "counted_after_flush": len(manager._interceptor.counted),
              "same_weights": all(torch.equal(plain_state[k], vpipe_state[k]) for k in plain_state)}
    vp.detach()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    return {"ranks": gathered}


def reattach() -> dict:
    """attach -> train with the planner planning -> detach, twice on the same pipeline (plans in both)."""
    import vpipe

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = tut.split_model(tut.Transformer(tut.ModelArgs()), rank, [6, 2])
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = Schedule1F1B(stage, 4, loss_fn=tut.tokenwise_loss_fn)
    applied, step = [], 0
    for policies in ({}, {i: "R" for i in range(8)}):  # the second attach gets plans that turn R back to D
        vp = vpipe.attach(schedule, optimizer=optimizer, sample_every=2,
                          planner_options={"warmup_samples": 1},
                          policies=policies)
        first_plan = None
        for _ in range(100):  # until a plan took effect (at the same step on every rank), and two steps more
            x, y = tut.batch(step, 8, 32, 256)
            schedule.step(x) if rank == 0 else schedule.step(target=y, losses=[])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if first_plan is None and vp.layer_manager.epoch >= 1:
                first_plan = step
            if first_plan is not None and step >= first_plan + 2:
                break
        applied.append(vp.layer_manager.epoch)
        vp.detach()
    leftover = [k for k in ("vpipe/attach-0/layers/0", "vpipe/attach-0/apply/1", "vpipe/attach-1/layers/0")
                if dist.distributed_c10d._get_default_store().check([k])]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"epochs": applied, "layers": list(model.layers.keys()),
                                      "leftover": leftover})
    return {"ranks": gathered}


def misuse() -> dict:
    """Calls that must end in a clear error on every rank involved, not a hang or a gloo abort."""
    import vpipe

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = tut.split_model(tut.Transformer(tut.ModelArgs()), rank, [4, 4])
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, 4, loss_fn=tut.tokenwise_loss_fn)
    out = {"foreign_optimizer": _error(lambda: vpipe.attach(
        schedule, optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)))}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vp = vpipe.attach(schedule, optimizer=optimizer, planning=False, agree_timeout_s=3.0)
    out["different_edits"] = _error(lambda: vp.remove_layers([0] if rank == 0 else [7]))
    seen: list[str] = []  # the hook keeps the error: raising in one rank's forward would stall the other
    handle = model.register_forward_hook(lambda *a: seen.append(_error(lambda: vp.remove_layers([1]))))
    x, y = tut.batch(0, 8, 32, 256)
    schedule.step(x) if rank == 0 else schedule.step(target=y, losses=[])
    handle.remove()
    out["edit_in_forward"] = seen[0] if seen else "never called"
    out["layers_after"] = list(model.layers.keys())
    out["one_rank_edit"] = _error(lambda: vp.remove_layers([0])) if rank == 0 else "not called"
    vp.detach()
    if rank == 0:  # attach on one rank only
        out["one_rank_attach"] = _error(lambda: vpipe.attach(schedule, optimizer=optimizer, planning=False,
                                                             agree_timeout_s=3.0))
    dist.barrier()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, out)
    return {"ranks": gathered}


def run_ranks(scenario: Callable[[], dict], out: str) -> None:
    """Run ``scenario`` on every rank (gloo, one thread each); rank 0 writes its result to ``out`` as JSON."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = scenario()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    run_ranks({"refusals": refusals, "subgroup": subgroup, "traced": traced, "nas": nas,
               "reattach": reattach, "misuse": misuse, "budget": budget,
               "budget_interleaved": budget_interleaved, "new_shapes": new_shapes,
               "pipedream_budget": pipedream_budget, "swaps_skipped": swaps_skipped}[scenario], out)


if __name__ == "__main__":
    main()
