"""One copy of a drawn trainer on one rank: stage modules, schedule,
optimizer(s) and LR schedulers, and its step.

Both copies (plain and vpipe's) are built by :func:`build` from the same whole model, so their
initial tensors are equal; each runs on process groups of its own, made for the draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from fuzz.draws import GLOBAL_CLIP_NORM, PIPEDREAM, STAGE_CLIP_NORM, Draw
from fuzz.models import add_hooks, batch, container, loss_fn, stage_module
from fuzz.recipes import ScaledLoss, all_reduce_grads, compile_blocks, step_all, unscale

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "zbv": ScheduleZBVZeroBubble}
LR = {"sgd": 0.05, "adam": 0.01, "adamw": 0.01, "adagrad": 0.05, "rmsprop": 0.005}
NO_DECAY = ("bias", "norm", "ln_f", "bn.", "gain")  # Hugging Face's rule, by name: biases and norm weights


@dataclass
class Copy:
    """One rank's part of one copy of the trainer."""

    name: str
    stages: list[int]  # stage indices on this rank, in model order
    modules: list[nn.Module]
    schedule: Any
    optimizers: list[torch.optim.Optimizer]
    lr_schedulers: list[Any]
    pp_group: Any
    dp_group: Any = None
    replica: int = 0
    losses: list[list[float]] = field(default_factory=list)
    averages: list[Any] = field(default_factory=list)  # extra=ema: an AveragedModel of each stage module
    scaled: ScaledLoss | None = None  # scaler=skips: the loss function holding the GradScaler
    tp_mesh: Any = None  # tp=mlp: the 1-D mesh the blocks are parallelised over

    @property
    def optimizer_arg(self) -> Any:
        """What the trainer hands ``vpipe.attach``: its optimizer, or one per stage module in a list."""
        return self.optimizers[0] if len(self.optimizers) == 1 else list(self.optimizers)


def stages_of_rank(d: Draw, pp_rank: int) -> list[int]:
    """Interleaved 1F1B: stages r and r + 2; ZBV's V: stages r and 3 - r; else stage r."""
    if d.schedule == "interleaved":
        return [pp_rank, pp_rank + 2]
    if d.schedule == "zbv":
        return [pp_rank, 3 - pp_rank]
    return [pp_rank]


def keep_buffers_through_shape_inference(stage: PipelineStage) -> None:
    """torch's first ``step()`` infers shapes by running a stage's forward on uninitialised tensors, which
    puts garbage into BatchNorm statistics and counters, different garbage in each copy: restore the
    buffers after it (tests/workers/block_worker.py does the same)."""
    inner = stage._prepare_forward_infra

    def prepare(*args: Any, **kwargs: Any) -> Any:
        saved = [(b, b.clone()) for b in stage.submod.buffers()]
        try:
            return inner(*args, **kwargs)
        finally:
            for b, value in saved:
                if not torch.equal(b, value):
                    b.data.copy_(value)

    stage._prepare_forward_infra = prepare


def _groups(d: Draw, modules: list[tuple[int, nn.Module]], lr: float) -> list[dict[str, Any]]:
    """The param groups of an optimizer over ``(stage, module)`` pairs, trainable parameters only."""
    named = [(n, p) for _, m in modules for n, p in m.named_parameters() if p.requires_grad]
    if d.groups == "one":
        return [{"params": [p for _, p in named]}]
    decay = [p for n, p in named if not any(t in n for t in NO_DECAY)]
    no_decay = [p for n, p in named if any(t in n for t in NO_DECAY)]
    by_name = [{"params": decay, "name": "decay", "weight_decay": 0.01},
               {"params": no_decay, "name": "no_decay", "weight_decay": 0.0}]
    if d.groups == "by_name":
        return by_name
    # per_stage: one optimizer per stage module (``modules`` is one
    # stage) whose groups differ in order and count
    stage, module = modules[0]
    # no embeddings or head to give groups of their own: the order differs instead
    if d.shape == "sequential":
        return by_name if stage == 0 else by_name[::-1]
    first = [p for n, p in module.named_parameters() if n.split(".")[0] in ("inp", "wte") and p.requires_grad]
    last = [p for n, p in module.named_parameters() if n.split(".")[0] in ("out", "ln_f", "head")]
    ids = {id(p) for p in first + last}
    for g in by_name:
        g["params"] = [p for p in g["params"] if id(p) not in ids]
    groups = ([{"params": first, "name": "embeddings", "lr": lr * 0.5}] if first else []) + by_name
    return groups + ([{"params": last, "name": "head", "lr": lr * 2}] if last else [])


def _optimizer(d: Draw, groups: list[dict[str, Any]], dp_group: Any = None) -> torch.optim.Optimizer:
    impl: dict[str, Any] = {"foreach": {"foreach": True}, "forloop": {"foreach": False},
                            "fused": {"fused": True}}[d.impl]
    lr = LR[d.optimizer]
    if d.optimizer == "sgd":
        impl["momentum"] = 0.9
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
           "adagrad": torch.optim.Adagrad,
           "rmsprop": torch.optim.RMSprop}[d.optimizer]
    if d.dp == "zero":  # each replica keeps the state of its share of the parameters (torch's ZeRO-1)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=dp_group, lr=lr, **impl)
    return cls(groups, lr=lr, **impl)


def _lr_scheduler(d: Draw, optimizer: torch.optim.Optimizer) -> Any:
    sched = torch.optim.lr_scheduler
    if d.lr_scheduler == "lambda":
        return sched.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.25 * s))
    if d.lr_scheduler == "step":
        return sched.StepLR(optimizer, step_size=2, gamma=0.5)
    if d.lr_scheduler == "cosine":
        return sched.CosineAnnealingLR(optimizer, T_max=4, eta_min=1e-4)
    return None


def _shard(d: Draw, module: nn.Module, dp_mesh: Any) -> nn.Module:
    """torchtitan's ``apply_fsdp`` for a pipeline stage: every block, then the stage module."""
    from torch.distributed.fsdp import fully_shard

    from fuzz.models import container

    for block in container(d, module).children():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
    return module


def build(d: Draw, name: str, parts: Any, pp_group: Any, pp_rank: int, dp_mesh: Any = None,
          replica: int = 0, dp_group: Any = None, tp_mesh: Any = None) -> Copy:
    """This rank's stages of one copy, on ``pp_group`` (sharded over ``dp_mesh``
    for an FSDP2 draw; data-parallel replicas, FSDP2's or plain ones, over
    ``dp_group``; blocks tensor-parallel over ``tp_mesh``)."""
    stages = stages_of_rank(d, pp_rank)
    modules = []
    for v in stages:
        module = stage_module(d, parts, v)
        if tp_mesh is not None:
            from fuzz.tensor_parallel import parallelize_blocks

            parallelize_blocks(container(d, module), tp_mesh)
        compile_blocks(d.compiled, container(d, module), d.schedule)
        add_hooks(d, module)
        modules.append(_shard(d, module, dp_mesh) if dp_mesh is not None else module)
    pipe_stages = []
    for v, module in zip(stages, modules):
        stage = PipelineStage(module, v, d.num_stages, torch.device("cpu"), group=pp_group)
        keep_buffers_through_shape_inference(stage)
        pipe_stages.append(stage)
    lr = LR[d.optimizer]
    if d.groups == "per_stage":
        optimizers = [_optimizer(d, _groups(d, [(v, m)], lr), dp_group) for v, m in zip(stages, modules)]
    else:
        optimizers = [_optimizer(d, _groups(d, list(zip(stages, modules)), lr), dp_group)]
    scaled = ScaledLoss(loss_fn(d)) if d.scaler == "skips" else None
    # vpipe's schedule, without vpipe attached on the plain copy: it owns the optimizer
    if d.schedule in PIPEDREAM:
        import vpipe

        cls = vpipe.SchedulePipeDream if d.schedule == "pipedream" else vpipe.SchedulePipeDream2BW
        schedule = cls(pipe_stages[0], d.micro_batches, loss_fn(d), optimizers[0])
    else:
        schedule = SCHEDULES[d.schedule](pipe_stages[0] if len(pipe_stages) == 1 else pipe_stages,
                                         d.micro_batches, loss_fn=scaled if scaled is not None
                                         else loss_fn(d))
    if d.extra == "muon":
        optimizers = [o for optimizer in optimizers for o in _with_muon(d, optimizer, modules)]
    schedulers = [s for s in (_lr_scheduler(d, o) for o in optimizers) if s is not None]
    averages = [_ema(m, carried=name == "vpipe") for m in modules] if d.extra == "ema" else []
    return Copy(name, stages, modules, schedule, optimizers, schedulers, pp_group,
                dp_group=dp_group, replica=replica, averages=averages,
                scaled=scaled, tp_mesh=tp_mesh)


def _with_muon(d: Draw, optimizer: torch.optim.Optimizer,
               modules: list[nn.Module]) -> list[torch.optim.Optimizer]:
    """The Muon recipe: the blocks' 2-D weights leave ``optimizer`` for a Muon of their own (norms, biases,
    embeddings and the head stay): two optimizers over the same stages."""
    from fuzz.models import container

    matrices = {id(p) for m in modules for p in container(d, m).parameters() if p.ndim == 2
                and p.requires_grad}
    mine = [p for g in optimizer.param_groups for p in g["params"] if id(p) in matrices]
    for g in optimizer.param_groups:
        g["params"] = [p for p in g["params"] if id(p) not in matrices]
    rest = [g for g in optimizer.param_groups if g["params"]]
    parts = [torch.optim.Muon(mine, lr=0.02, momentum=0.9, weight_decay=0.01)] if mine else []
    if rest:
        optimizer.param_groups[:] = rest
        parts.append(optimizer)
    return parts


def _ema(module: nn.Module, carried: bool) -> Any:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    if carried:
        return AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    return PlainEMA(module)


class PlainEMA:
    """The plain copy's EMA: ``AveragedModel``'s arithmetic (its first update copies, later ones
    ``get_ema_multi_avg_fn``; buffers copied from the model, as ``use_buffers=False`` does) over a copy of
    the stage module, but not an ``AveragedModel``: both copies live in one process, and vpipe's scan at
    attach takes an AveragedModel whose parameters are named as its stage's for an average of that stage
    (it would keep the vpipe copy's blocks from moving)."""

    def __init__(self, module: nn.Module) -> None:
        import copy

        from torch.optim.swa_utils import get_ema_multi_avg_fn

        self.module = copy.deepcopy(module)
        self._average = get_ema_multi_avg_fn(0.9)
        self.n_averaged = 0

    def update_parameters(self, model: nn.Module) -> None:
        mine = [p.detach() for p in self.module.parameters()]
        theirs = [p.detach() for p in model.parameters()]
        if self.n_averaged == 0:
            for a, b in zip(mine, theirs):
                a.copy_(b)
        else:
            self._average(mine, theirs, torch.tensor(self.n_averaged))
        for a, b in zip(self.module.buffers(), model.buffers()):
            a.detach().copy_(b.detach())
        self.n_averaged += 1


def _clip_global(c: Copy, aux_group: Any) -> None:
    """torchtitan's clipping under pipelining: each rank's norm (full over its dp
    shards), squared, summed over the pipeline, the same factor on every stage
    (the sum's grouping depends on the split: to rounding)."""
    from torch.distributed.tensor import DTensor

    params = [p for m in c.modules for p in m.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    total = norm.detach().clone() ** 2
    dist.all_reduce(total, group=aux_group)  # over every rank: each dp replica counts its stage once per rank
    if c.dp_group is not None:
        total /= dist.get_world_size(c.dp_group)
    total **= 0.5
    torch.nn.utils.clip_grads_with_norm_(params, GLOBAL_CLIP_NORM, total)


def train_step(d: Draw, c: Copy, step: int, aux_group: Any) -> None:
    """One ``schedule.step`` and, at the end of an accumulation window, clipping, ``optimizer.step()``, the LR
    schedulers' step and ``zero_grad``; the last stage's losses are kept."""
    x, y = batch(d, step, c.replica)
    losses: list[torch.Tensor] = []
    inputs = (x,) if 0 in c.stages else ()
    if c.scaled is not None:  # the step's first micro-batch is a bad one (its rows start y)
        c.scaled.overflow(y if step in d.inf_steps else None)
    if d.num_stages - 1 in c.stages:
        c.schedule.step(*inputs, target=y, losses=losses)
    else:
        c.schedule.step(*inputs)
    if losses:
        c.losses.append([float(loss.detach()) for loss in losses])
    if (step + 1) % d.accum or d.schedule in PIPEDREAM:  # PipeDream's schedules step the optimizer themselves
        return
    if d.dp != "none":
        all_reduce_grads(c)
    unscale(c.scaled, c.optimizers)  # the AMP recipe: unscale_ before clipping
    if d.clip == "global":
        _clip_global(c, aux_group)
    elif d.clip == "stage":
        for m in c.modules:  # the module's parameters asked for each time: a list captured once goes stale
            torch.nn.utils.clip_grad_norm_(m.parameters(), STAGE_CLIP_NORM)
    step_all(c.scaled, c.optimizers)
    for average, module in zip(c.averages, c.modules):
        average.update_parameters(module)
    for s in c.lr_schedulers:
        s.step()
    for o in c.optimizers:
        o.zero_grad(set_to_none=True)


def finish(d: Draw, c: Copy) -> None:
    """After the last step: PipeDream's schedules run the backward of every micro-batch still in flight."""
    if d.schedule in PIPEDREAM:
        losses: list[torch.Tensor] = []
        c.schedule.flush(losses)
        if losses:
            c.losses.append([float(loss.detach()) for loss in losses])


def remove_block(d: Draw, c: Copy, layer_id: int) -> None:
    """What a trainer without vpipe does to drop a block (a NAS step): out of its
    container, its optimizer and its EMA's copy of the stage."""
    for average in c.averages:
        _drop(d, average.module, layer_id)
    for module in c.modules:
        block = _drop(d, module, layer_id)
        if block is None:
            continue
        gone = {id(p) for p in block.parameters()}
        for o in c.optimizers:
            for g in o.param_groups:
                g["params"] = [p for p in g["params"] if id(p) not in gone]
            for p in [p for p in o.state if id(p) in gone]:
                del o.state[p]
        return


def _drop(d: Draw, module: nn.Module, layer_id: int) -> nn.Module | None:
    """Take block ``layer_id`` out of ``module``'s container: the
    block, or None where the module does not hold it."""
    from fuzz.models import container

    blocks = container(d, module)
    for position, (key, block) in enumerate(list(blocks.named_children())):
        if getattr(block, "layer_id", None) == layer_id:
            if isinstance(blocks, nn.ModuleDict):
                del blocks[key]
            else:  # Sequential and ModuleList renumber what follows
                del blocks[position]
            return block
    return None


def add_block(d: Draw, c: Copy, position: int, block: nn.Module) -> None:
    """What a trainer without vpipe does to add a block before model ``position`` (a NAS step), on the
    stage of the first split that holds that position (the last when appending): into its container, each
    trainable parameter into a group of that stage's optimizers by the trainer's own rule (Muon for the
    blocks' matrices under the Muon recipe; decay or no-decay by name), and a copy into the stage's EMA."""
    import copy

    from fuzz.models import insert_block

    starts = [sum(d.counts[:v]) for v in range(d.num_stages)]
    holder = d.num_stages - 1 if position == d.layers else max(v for v in range(d.num_stages)
                                                                if starts[v] <= position)
    if holder not in c.stages:
        return
    index = c.stages.index(holder)
    module = c.modules[index]
    mine = {id(p) for p in module.parameters()}
    optimizers = [o for o in c.optimizers if any(id(p) in mine for g in o.param_groups for p in g["params"])]
    insert_block(d, module, position - starts[holder], block)
    for name, p in block.named_parameters():
        if p.requires_grad:
            _group_by_rule(d, optimizers, name, p)["params"].append(p)
    if c.averages:
        insert_block(d, c.averages[index].module, position - starts[holder], copy.deepcopy(block))


def _group_by_rule(d: Draw, optimizers: list[torch.optim.Optimizer], name: str,
                   p: torch.Tensor) -> dict[str, Any]:
    """The param group the trainer's own rule (:func:`_groups`,
    :func:`_with_muon`) puts a block's parameter in."""
    muon = [o for o in optimizers if isinstance(o, torch.optim.Muon)]
    if muon and p.ndim == 2:
        return muon[0].param_groups[0]
    rest = [o for o in optimizers if not isinstance(o, torch.optim.Muon)]
    if d.groups == "one":
        return rest[0].param_groups[0]
    want = "no_decay" if any(t in name for t in NO_DECAY) else "decay"
    return next(g for o in rest for g in o.param_groups if g.get("name") == want)
