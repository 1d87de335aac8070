"""Rank program for tests/integration/test_trainer_patterns.py: everyday trainer patterns that once changed
what the model learns under vpipe's moves, each against the same trainer without vpipe.

Each scenario (``argv[1]``) builds a torchtitan-shaped model (``layers`` a ModuleDict keyed by global id, an
input projection on the first stage, a head on the last) split 6,2 over two ranks, twice side by side: a
plain copy on a gloo group of its own and a copy with the one line. vpipe's copy is told to move blocks; both
train the same batches with the scenario's trainer loop, and rank 0 writes both copies' losses, the whole
model's state (merged by global key), the placements and vpipe's log records to ``argv[2]``.

- ``accumulation``: two ``schedule.step()`` calls per ``optimizer.step()`` (the loss halved, as Hugging
  Face's ``gradient_accumulation_steps`` does), plans taking effect between the two; the trainer also keeps a
  list of the stage's parameters taken before attach (for its own use), which a move leaves stale;
- ``groups``: Hugging Face's weight-decay groups, named, listed differently per stage (stage 0
  ``[embeddings, decay, no_decay]``, the last ``[decay, no_decay, head]``);
- ``groups_refused``: the last stage decays with another weight decay: no group there fits a moved block;
- ``mixed``: dense and MoE blocks interleaved (torchtitan's Llama 4 / DeepSeek shape), no ``layers=``;
- ``mixed_unbuildable``: the last stage holds dense blocks only and is asked to take an MoE block;
- ``autocast_splits``: no vpipe; the tutorial's trainer on two splits under an autocast around the step;
- ``removal_hooked``: blocks removed while a block with a user's stateful forward hook trains on;
- ``muon``: the Muon recipe, two optimizers per stage (Muon for the blocks' 2-D weights, AdamW for norms,
  biases, the input projection and the head) in a container holding ``.optimizers``;
- ``muon_only``: only the Muon optimizer given to attach: the blocks' norms and biases train in none;
- ``ema_averaged`` / ``ema_dict``: an EMA of the weights beside the stage (torch's ``AveragedModel``, a dict
  of clones by name), updated after each optimizer step;
- ``ema_averaged_carried`` / ``ema_dict_carried``: the same EMAs given to ``attach(..., carry=[ema])``, with
  an ``on_move`` hook recording what it hears; both copies' averages are written too;
- ``carry_refused``: ``attach`` with a ``carry=`` it cannot take (each on a fresh copy): the errors it raised;
- ``added_counted``: a block added inside stage 0 (``vp.add_layers``; by hand on the plain copy) while the
  loss counts its calls (a trainer that schedules by them): the copies' call counts are written too;
- ``added_last_hooked``: a block appended to the last stage, beside a block with a user's stateful hook.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from block_worker import CountingHook, batch, keep_buffers_through_shape_inference  # noqa: E402  (this script's directory)

DIM, LAYERS, COUNTS, EXPERTS, STEPS = 16, 8, [6, 2], 3, 8


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(self.norm(h))))


class MoE(nn.Module):
    """Top-1 routing over a ModuleList of experts; an int64 buffer counts the tokens each expert took."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))
                                     for _ in range(EXPERTS))
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS, dtype=torch.int64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        scores = self.router(x).softmax(-1)
        top = scores.argmax(-1)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(top, minlength=EXPERTS)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + (top == e).unsqueeze(-1) * scores[:, e:e + 1] * expert(x)
        return h + out


class Net(nn.Module):
    def __init__(self, kinds: str) -> None:
        super().__init__()
        self.inp: nn.Module | None = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleDict({str(i): MoE() if kinds[i] == "m" else Dense() for i in range(LAYERS)})
        self.out: nn.Module | None = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) if self.inp is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.out(h) if self.out is not None else h


def _split(model: Net, rank: int, counts: list[int] = COUNTS) -> Net:
    first = sum(counts[:rank])
    for name in [n for n in model.layers if not first <= int(n) < first + counts[rank]]:
        del model.layers[name]
    if rank != 0:
        model.inp = None
    if rank != len(counts) - 1:
        model.out = None
    return model


def _decay_groups(model: Net, weight_decay: float) -> list[dict[str, Any]]:
    """Hugging Face's grouping: decay on weights, none on biases and norms, groups named."""
    named = [(n, p) for n, p in model.layers.named_parameters()]
    decay = [p for n, p in named if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in named if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": rest, "weight_decay": 0.0, "name": "no_decay"}]


def groups_per_stage(model: Net, last_decay: float = 0.1) -> torch.optim.Optimizer:
    if dist.get_rank() == 0:
        groups = [{"params": list(model.inp.parameters()), "lr": 5e-4, "weight_decay": 0.0,
                   "name": "embeddings"},
                  *_decay_groups(model, 0.1)]
    else:
        groups = [*_decay_groups(model, last_decay),
                  {"params": list(model.out.parameters()), "lr": 2e-3, "weight_decay": 0.0, "name": "head"}]
    return torch.optim.AdamW(groups, lr=1e-3)


class CountingLoss:
    """The trainer's loss, counting its calls."""

    def __init__(self, accumulation: int) -> None:
        self.accumulation, self.calls = accumulation, 0

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return F.mse_loss(out, y) / self.accumulation


LOSSES: dict[int, CountingLoss] = {}  # id(stage module) -> its schedule's loss


def _build(group: Any, kinds: str, accumulation: int, make_optimizer: Callable[[Net], torch.optim.Optimizer],
           counts: list[int] = COUNTS):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _split(Net(kinds), rank, counts)
    stage = PipelineStage(model, rank, world, torch.device("cpu"), group=group)
    keep_buffers_through_shape_inference(stage)
    loss = LOSSES[id(model)] = CountingLoss(accumulation)
    schedule = Schedule1F1B(stage, 4, loss_fn=loss)
    return model, schedule, make_optimizer(model)


def new_dense(layer_id: int) -> Dense:
    """The block ``vp.add_layers`` builds (the layer factory) and the plain copy inserts: seeded by its id."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 + layer_id)
        return Dense()


def _add(model: Net, opt: torch.optim.Optimizer, position: int, layer_id: int) -> None:
    """What a trainer without vpipe does to add a block before model
    position ``position`` of the first split."""
    first, last = sum(COUNTS[:dist.get_rank()]), dist.get_rank() == len(COUNTS) - 1
    if not first <= position < first + COUNTS[dist.get_rank()] + last:  # the last stage's may append
        return
    block = new_dense(layer_id)
    items = list(model.layers.items())
    items.insert(position - first, (str(layer_id), block))
    model.layers.clear()
    model.layers.update(items)
    opt.param_groups[0]["params"].extend(block.parameters())


def _remove(model: Net, opt: torch.optim.Optimizer, layer_ids: list[int]) -> None:
    """What a trainer without vpipe does to drop blocks (a NAS
    step): out of the container and the optimizer."""
    for lid in layer_ids:
        if str(lid) in model.layers:
            gone = {id(p) for p in model.layers[str(lid)].parameters()}
            del model.layers[str(lid)]
            for group in opt.param_groups:
                group["params"][:] = [p for p in group["params"] if id(p) not in gone]


def side_by_side(plans: dict[int, list[list[int]]], *, kinds: str = "d" * LAYERS, accumulation: int = 1,
                 make_optimizer: Callable[[Net], Any] = lambda m: torch.optim.Adam(
                     m.parameters(), lr=1e-2), removals: dict[int, list[int]] | None = None,
                 hooked: tuple[int, ...] = (), attach_optimizer: Callable[[Any], Any] = lambda o: o,
                 ema: str | None = None, carried: bool = False, additions: dict[int, int] | None = None,
                 **options: Any) -> dict:
    """Train both copies on the same batches; vpipe's applies ``plans``
    (schedule.step() call -> placement); both remove the blocks of ``removals`` before
    those steps; ``hooked`` blocks carry a :class:`CountingHook`."""
    import vpipe
    from vpipe.plan import Plan

    copies = {"plain": _build(dist.new_group(backend="gloo"), kinds, accumulation, make_optimizer),
              "vpipe": _build(None, kinds, accumulation, make_optimizer)}
    for m, _, _ in copies.values():
        for lid in hooked:
            if str(lid) in m.layers:
                m.layers[str(lid)].register_forward_hook(CountingHook())
    # a carried average is made before attach; the plain copy's after it (attach would find it and pin the
    # blocks: it is named as the vpipe copy's stage module is, and not carried)
    averages = {name: _average(ema, m) for name, (m, _, _) in copies.items()
                if not (carried and name == "plain")} if ema else {}
    model, schedule, opt = copies["vpipe"]
    kept_params = list(model.parameters())  # the trainer's own list, taken once before attach
    heard: list[dict] = []
    if additions:
        options["layer_factory"] = lambda layer_id, spec: new_dense(layer_id)
    if carried:
        options.update(carry=[averages["vpipe"][0]], on_move=lambda e: heard.append(
            {"stage": e.stage, "arrived": sorted(e.arrived), "left": list(e.left), "cause": e.cause,
             "in_container": all(model.layers[str(lid)] is block for lid, block in e.arrived.items())}))
    vp = vpipe.attach(schedule, optimizer=attach_optimizer(opt), planning=False, **options)
    if carried:
        averages["plain"] = _average(ema, copies["plain"][0])  # the plain copy has not trained yet: alike
    for epoch, (step, stages) in enumerate(sorted(plans.items()), start=1):
        vp.request_plan(Plan(epoch=epoch, stages=stages), at_step=step)
    losses: dict[str, list[float]] = {name: [] for name in copies}
    placements = []
    for step in range(STEPS):
        if step in (removals or {}):
            vp.remove_layers(removals[step])
            _remove(copies["plain"][0], copies["plain"][2], removals[step])
        if step in (additions or {}):
            assert vp.add_layers(additions[step], [{}]) == [LAYERS]
            _add(copies["plain"][0], copies["plain"][2], additions[step], LAYERS)
        for name, (_, sched, o) in copies.items():
            for micro in range(accumulation):
                x, y = batch(step * accumulation + micro)
                out: list[torch.Tensor] = []
                if dist.get_rank() == 0:
                    sched.step(x)
                else:
                    sched.step(target=y, losses=out)
                losses[name] += [float(loss.detach()) for loss in out]
                if name == "vpipe":
                    placements.append([list(s) for s in vp.placement])
            o.step()
            o.zero_grad(set_to_none=True)
            if name in averages:
                averages[name][1](copies[name][0])
    vp.detach()
    del kept_params
    states = {name: {k: v.tolist() for k, v in m.state_dict().items()} for name, (m, _, _) in copies.items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, states)
    merged = {name: {k: v for rank_states in gathered for k, v in rank_states[name].items()}
              for name in copies}
    mine = {name: {k: v.tolist() for k, v in _averaged_state(average).items()} for name, (average, _) in
            averages.items()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged_averages = {name: {k: v for rank_states in every for k, v in rank_states.get(name, {}).items()}
                       for name in averages}
    heard_all: list = [None] * dist.get_world_size()
    dist.all_gather_object(heard_all, heard)
    return {"losses": losses if dist.get_rank() == 1 else None, "states": merged, "placements": placements,
            "averages": merged_averages, "heard": heard_all,
            "loss_calls": {name: LOSSES[id(m)].calls for name, (m, _, _) in copies.items()}}


def autocast_splits() -> dict:
    """No vpipe: the torch pipelining tutorial's trainer on a 6,2 and a 4,4 split with a bf16
    autocast around each schedule.step(), with torch's default cache of down-cast weights and
    without it: what docs/stage-shapes.md says about autocast."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tutorial", ROOT / "examples" / "train_tutorial.py")
    tut = importlib.util.module_from_spec(spec)
    sys.modules["train_tutorial"] = tut
    spec.loader.exec_module(tut)
    rank = dist.get_rank()
    losses: dict[str, list[float]] = {}
    for counts in ([6, 2], [4, 4]):
        for cache in (True, False):
            torch.manual_seed(0)
            model = tut.split_model(tut.Transformer(tut.ModelArgs()), rank, counts)
            stage = PipelineStage(model, rank, 2, torch.device("cpu"), group=dist.new_group(backend="gloo"))
            schedule = Schedule1F1B(stage, 4, loss_fn=tut.tokenwise_loss_fn)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            name = losses.setdefault(f"{counts[0]},{counts[1]} cache={cache}", [])
            for step in range(3):
                x, y = tut.batch(step, 8, 32, 256)
                out: list[torch.Tensor] = []
                with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
                    schedule.step(x) if rank == 0 else schedule.step(target=y, losses=out)
                name += [float(loss.detach()) for loss in out]
                opt.step()
                opt.zero_grad(set_to_none=True)
    return {"losses": losses if rank == 1 else None}


class Optimizers:
    """A trainer's own container of several optimizers (torchtitan's
    shape: ``.optimizers``), stepped together."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def _average(kind: str, model: Net) -> tuple[Any, Callable[[Net], None]]:
    """An EMA of the weights kept beside the stage (torch's AveragedModel, or a dict of clones by name),
    and the update the trainer calls after each optimizer step."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    if kind == "averaged":
        averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        return averaged, averaged.update_parameters
    clones = {name: p.detach().clone() for name, p in model.named_parameters()}

    def update(m: Net) -> None:
        with torch.no_grad():
            for name, p in m.named_parameters():
                clones[name].lerp_(p, 0.1)

    return clones, update


def _averaged_state(average: Any) -> dict[str, torch.Tensor]:
    return average if isinstance(average, dict) else average.state_dict()


def carry_refused() -> dict:
    """attach(..., carry=...) with what it cannot carry, each on a
    fresh copy of the model: the one-line errors."""
    from torch.optim.swa_utils import AveragedModel

    import vpipe

    errors = {}
    for name, bad in [("other_module", lambda m: AveragedModel(nn.Linear(DIM, DIM))),
                      ("bad_keys", lambda m: {"decoder.weight": torch.zeros(1)}),
                      ("unsupported", lambda m: [p.detach().clone() for p in m.parameters()])]:
        model, schedule, opt = _build(None, "d" * LAYERS, 1,
                                      lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
        try:
            vpipe.attach(schedule, optimizer=opt, planning=False, carry=[bad(model)])
        except ValueError as e:
            errors[name] = str(e)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, errors)
    return {"losses": [], "errors": every}


def muon_recipe(model: Net) -> Optimizers:
    matrices = [p for p in model.layers.parameters() if p.ndim == 2]
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    return Optimizers([torch.optim.Muon(matrices, lr=2e-2), torch.optim.AdamW(rest, lr=1e-3)])


def muon_only() -> dict:
    """The trainer steps both, but gives vpipe only Muon: the blocks' norms and
    biases are in no optimizer vpipe sees, so its blocks stay where they are (the
    plan is refused) and training matches the plain copy."""
    return side_by_side({2: [[0, 1, 2, 3], [4, 5, 6, 7]]}, make_optimizer=muon_recipe,
                        attach_optimizer=lambda o:
                        o.optimizers[0])


ALL_TO_4_4 = {1: [[0, 1, 2, 3], [4, 5, 6, 7]], 4: [[0, 1, 2, 3, 4], [5, 6, 7]],
              7: [[0, 1, 2], [3, 4, 5, 6, 7]]}
SCENARIOS: dict[str, Callable[[], dict]] = {
    # plans at odd schedule.step() calls: between the two calls of an accumulation window
    "accumulation": lambda: side_by_side({3: [[0, 1, 2, 3], [4, 5, 6, 7]], 9: [[0, 1, 2, 3, 4, 5], [6, 7]]},
                                         accumulation=2),
    "groups": lambda: side_by_side(ALL_TO_4_4, make_optimizer=groups_per_stage),
    "groups_refused": lambda: side_by_side({2: [[0, 1, 2, 3], [4, 5, 6, 7]]},
                                           make_optimizer=lambda m: groups_per_stage(m, last_decay=0.05)),
    "mixed": lambda: side_by_side(ALL_TO_4_4, kinds="dmdmdmdm"),
    "mixed_unbuildable": lambda: side_by_side({2: [[0, 1, 2, 3, 4, 5, 6], [7]],
                                               4: [[0, 1, 2], [3, 4, 5, 6, 7]]},
                                              kinds="dmdmdmdd"),
    "autocast_splits": autocast_splits,
    # block 6 carries a stateful hook; removing block 7 leaves stage
    # 1's boundary alike: no second shape inference
    "removal_hooked": lambda: side_by_side({}, removals={3: [2], 5: [7]}, hooked=(6,)),
    "muon": lambda: side_by_side(ALL_TO_4_4, make_optimizer=muon_recipe),
    "muon_only": muon_only,
    "ema_averaged": lambda: side_by_side({2: [[0, 1, 2, 3], [4, 5, 6, 7]]}, ema="averaged"),
    "ema_dict": lambda: side_by_side({2: [[0, 1, 2, 3], [4, 5, 6, 7]]}, ema="dict"),
    "ema_averaged_carried": lambda: side_by_side(ALL_TO_4_4, ema="averaged", carried=True),
    "ema_dict_carried": lambda: side_by_side(ALL_TO_4_4, ema="dict", carried=True),
    "carry_refused": carry_refused,
    # block 8 added before model position 2, inside stage 0: no boundary changes, no second shape inference
    "added_counted": lambda: side_by_side({}, additions={3: 2}),
    # block 8 appended to the last stage, which block 6 (hooked) trains on: the new block ends the stage, so
    # every rank infers shapes again, quiet
    "added_last_hooked": lambda: side_by_side({}, additions={3: LAYERS}, hooked=(6,)),
}


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = SCENARIOS[scenario]()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        last = next(r for r in gathered if r["losses"] is not None)  # the rank that computes the loss
        Path(out).write_text(json.dumps(dict(gathered[0], losses=last["losses"],
                                             loss_calls=last.get("loss_calls"))))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
