"""One random trainer per seed: a feature combination vpipe must run
underneath without changing what is learnt.

``draw(seed)`` makes one choice per axis of :data:`AXES` with ``random.Random(seed)``, then the
numbers that follow from them (layers, the first split, the forced plans and their steps). A
combination that cannot work is re-drawn or adjusted; every such constraint is a comment where
it is applied. The same seed always gives the same draw (the reproduction of a failure is its seed).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, replace
from typing import Any

# every axis and its values; ``fsdp`` is not drawn freely: every
# ``fsdp_every``-th seed is an FSDP2 draw (4 ranks)
AXES: dict[str, tuple[Any, ...]] = {
    "shape": ("sequential", "moduledict", "modulelist", "mixed"),
    # vpipe's own PipeDream schedules (drawn late, tests/fuzz/late.py): asynchronous 1F1B with weight stashing
    # and an optimizer step per micro-batch, and PipeDream-2BW (double-buffered weights, a step per period)
    "schedule": ("gpipe", "1f1b", "interleaved", "zbv", "pipedream", "2bw"),
    "optimizer": ("sgd", "adam", "adamw", "adagrad", "rmsprop"),
    "impl": ("foreach", "forloop", "fused"),
    "groups": ("one", "by_name", "per_stage"),
    "lr_scheduler": ("none", "lambda", "step", "cosine"),
    "accum": (1, 2, 3),
    "clip": ("none", "global", "stage"),
    "autocast": ("none", "bf16"),
    "block_state": ("plain", "batchnorm", "frozen", "tied", "hook"),
    "fsdp": (False, True),
    # the 2x2 mesh's dimension order: FSDP2's or the data-parallel replicas' (dp), or tensor parallelism's
    "mesh": ("", "dp_pp", "pp_dp", "tp_pp", "pp_tp"),
    # vp.remove_layers of one block at a step, or vp.add_layers of a new one, next to the moves
    "nas": ("none", "remove", "add"),
    # beside the optimizer (drawn last): the Muon recipe (Muon for the blocks'
    # matrices, the drawn optimizer for the rest: several optimizers a stage), or an
    # EMA of each stage module (AveragedModel) that vpipe carries
    "extra": ("none", "muon", "ema"),
    # who chooses the moves: plans forced at drawn steps, or vpipe's own planner (sampling every step, acting
    # on one sample) from the drawn split, no plan forced: moves at steps and of blocks no one drew
    "moves": ("forced", "planner"),
    # the blocks' first Linear under torch's weight_norm
    # parametrization (``parametrizations.weight.original0/1`` train;
    # the weight is computed on each forward), as users apply it
    "weights": ("plain", "parametrized"),
    # each block compiled as torchtitan compiles them: replaced by ``torch.compile(block)`` in its container,
    # or ``block.compile()`` in place (tests/fuzz/recipes.py)
    "compiled": ("none", "wrap", "in_place"),
    # torch's AMP recipe: a GradScaler (CPU) scales each micro-batch's loss, unscale_ before clipping, and its
    # ``step`` skips the drawn steps whose first micro-batch's loss is infinite (tests/fuzz/recipes.py)
    "scaler": ("none", "skips"),
    # data-parallel replicas without FSDP2 (a 2x2 mesh, 4 ranks): the trainer all-reduces the gradients itself
    # after the window's last schedule.step; or those replicas under
    # torch.distributed.optim.ZeroRedundancyOptimizer, which vpipe refuses (moves off for the run, one line):
    # counted refused, never passed (tests/fuzz/late.py)
    "dp": ("none", "allreduce", "zero"),
    # every block under DTensor tensor parallelism over the tp dimension of a 2x2 (pp, tp) mesh (4 ranks):
    # torchtitan's feed-forward plan, ColwiseParallel then RowwiseParallel (tests/fuzz/tensor_parallel.py)
    "tp": ("none", "mlp"),
    # who runs the pipeline: torch's schedules (or vpipe's PipeDream), or DeepSpeed's PipelineEngine on both
    # copies, vpipe attached to one (tests/fuzz/deepspeed_draw.py)
    "engine": ("torch", "deepspeed"),
}
# axes drawn after the others, not in the first round of choices (and
# schedule's PipeDream values, tests/fuzz/late.py)
LATE = ("fsdp", "mesh", "nas", "extra", "moves", "weights", "compiled", "scaler", "dp", "tp",
        "engine")
DERIVED = ("mid_window_plan",)  # properties of a draw that the report groups failures by, next to the axes
MULTI_STAGE = ("interleaved", "zbv")  # two stages per rank, four stages in all
TORCH_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")  # the first round's choices (PipeDream's are late)
PIPEDREAM = ("pipedream", "2bw")  # vpipe's schedules that own the optimizer steps
# optimizers with a fused CPU kernel in torch 2.13 (RMSprop has none)
FUSED = ("sgd", "adam", "adamw", "adagrad")
FSDP_FUSED = ("adam", "adamw")  # fused kernels DTensor can run
STEPS = {1: 8, 2: 8, 3: 9}  # schedule.step calls per run, by accumulation: whole windows only
FSDP_STEPS = {1: 6, 2: 6, 3: 6}  # four ranks on two cores: fewer steps
MICRO_BATCHES = 4
STAGE_CLIP_NORM = 1e9  # per-stage clipping depends on the split by definition: a norm no gradient reaches
GLOBAL_CLIP_NORM = 0.5  # clips on most steps
FSDP_EVERY = 10


@dataclass(frozen=True)
class Draw:
    """One trainer: the axes' values, the first split and the forced plans ``(at_step, counts, policies)``."""

    seed: int
    shape: str
    schedule: str
    optimizer: str
    impl: str
    groups: str
    lr_scheduler: str
    accum: int
    clip: str
    autocast: str
    block_state: str
    fsdp: bool
    mesh: str  # "dp_pp" / "pp_dp": the FSDP2 mesh's dimension order; "" without FSDP
    layers: int
    counts: tuple[int, ...]  # blocks per stage at the start
    steps: int  # schedule.step calls
    policies: str  # one of D, S, R per layer id, given to attach
    # (at_step, blocks per stage, policies) per forced plan
    plans: tuple[tuple[int, tuple[int, ...], str], ...]
    pinned: tuple[int, ...]  # blocks vpipe must never move (tied pair, hooked block)
    micro_batches: int = MICRO_BATCHES
    nas_remove: tuple[int, ...] = ()  # (step, layer id): the block removed before that step on both copies
    extra: str = "none"
    moves: str = "forced"
    # (step, position): a new block (id ``layers``) inserted before that position
    nas_add: tuple[int, ...] = ()
    weights: str = "plain"
    compiled: str = "none"
    scaler: str = "none"
    # scaler=skips: the schedule.step calls whose first micro-batch's loss is inf
    inf_steps: tuple[int, ...] = ()
    dp: str = "none"
    tp: str = "none"
    engine: str = "torch"

    @property
    def nas(self) -> str:
        return "remove" if self.nas_remove else "add" if self.nas_add else "none"

    @property
    def edit_step(self) -> int | None:
        """The step before which a block is removed or added, if one is."""
        edit = self.nas_remove or self.nas_add
        return edit[0] if edit else None

    def plan_stages(self, at: int, counts: tuple[int, ...]) -> list[list[int]]:
        """The blocks of each stage a plan at step ``at`` asks for (after an edit, over the blocks then)."""
        ids = list(range(self.layers))
        if self.nas_remove and at >= self.nas_remove[0]:
            ids.remove(self.nas_remove[1])
        if self.nas_add and at >= self.nas_add[0]:
            ids.insert(self.nas_add[1], self.layers)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [ids[s:s + c] for s, c in zip(starts, counts)]

    @property
    def num_stages(self) -> int:
        return 4 if self.schedule in MULTI_STAGE else 2

    @property
    def ranks(self) -> int:
        return 4 if self.fsdp or self.dp != "none" or self.tp != "none" else 2

    @property
    def rounding(self) -> bool:
        """Whether torch's own arithmetic depends on the split: the global norm sums per-stage norms, in a
        different grouping for every split, so results agree to rounding only."""
        return self.clip == "global"

    @property
    def mid_window_plan(self) -> bool:
        """Whether a plan applies between two ``schedule.step`` calls of one accumulation window."""
        return any(at % self.accum for at, _, _ in self.plans)

    def stage_blocks(self, counts: tuple[int, ...] | None = None) -> list[list[int]]:
        return stage_blocks(self.counts if counts is None else counts)

    def describe(self) -> str:
        impl = f"{self.optimizer}[{self.impl}]"
        clip = {"none": "clip=none", "global": f"clip=global({GLOBAL_CLIP_NORM}, to rounding)",
                "stage": f"clip=stage(max_norm {STAGE_CLIP_NORM:g}: never clips)"}[self.clip]
        state = self.block_state + (f"(pinned {','.join(map(str, self.pinned))})" if self.pinned else "")
        plans = " ".join(f"@{s}:{','.join(map(str, c))}" for s, c, _ in self.plans)
        nas = f" nas=remove L{self.nas_remove[1]}@{self.nas_remove[0]}" if self.nas_remove else ""
        nas += (
            f" nas=add L{self.layers} before position {self.nas_add[1]}@{self.nas_add[0]}"
            if self.nas_add
            else ""
        )
        extra = f" extra={self.extra}" if self.extra != "none" else ""
        extra += " moves=planner" if self.moves == "planner" else ""
        extra += " weights=parametrized" if self.weights == "parametrized" else ""
        extra += f" compiled={self.compiled}" if self.compiled != "none" else ""
        extra += (
            f" scaler=skips(inf at {','.join(map(str, self.inf_steps))})" if self.scaler != "none" else ""
        )
        extra += f" dp={self.dp}({self.mesh})" if self.dp != "none" else ""
        extra += f" tp={self.tp}({self.mesh})" if self.tp != "none" else ""
        extra += " engine=deepspeed" if self.engine == "deepspeed" else ""
        return (f"seed={self.seed} {self.shape}/{self.schedule} {impl}{extra} groups={self.groups} "
                f"lr={self.lr_scheduler} accum={self.accum} {clip} autocast={self.autocast} state={state} "
                f"{'fsdp(' + self.mesh + ') ' if self.fsdp else ''}L{self.layers} "
                f"{','.join(map(str, self.counts))} pol={self.policies} plans {plans}{nas}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Draw:
        raw = json.loads(text)
        raw["counts"] = tuple(raw["counts"])
        raw["pinned"] = tuple(raw["pinned"])
        raw["plans"] = tuple((s, tuple(c), p) for s, c, p in raw["plans"])
        raw["nas_remove"] = tuple(raw.get("nas_remove", ()))
        raw["nas_add"] = tuple(raw.get("nas_add", ()))
        raw["inf_steps"] = tuple(raw.get("inf_steps", ()))
        return cls(**raw)


def stage_blocks(counts: tuple[int, ...]) -> list[list[int]]:
    """The global ids of each stage's blocks for a contiguous split."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [list(range(s, s + c)) for s, c in zip(starts, counts)]


def _split(rng: random.Random, layers: int, stages: int) -> tuple[int, ...]:
    """A random contiguous partition of ``layers`` blocks into ``stages`` non-empty runs."""
    cuts = sorted(rng.sample(range(1, layers), stages - 1))
    edges = [0, *cuts, layers]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def _policies(rng: random.Random, layers: int) -> str:
    return "".join(rng.choice("DSR") for _ in range(layers))


def block_kind(shape: str, layer_id: int) -> str:
    """``mixed`` alternates dense and MoE blocks (dense first); every other shape repeats one kind."""
    return "moe" if shape == "mixed" and layer_id % 2 else "dense"


def _pinned(rng: random.Random, shape: str, state: str, counts: tuple[int, ...]) -> tuple[int, ...] | None:
    """The blocks a tied or hooked draw pins; None when the split leaves no two blocks of one kind to tie."""
    if state == "hook":
        return (rng.randrange(sum(counts)),)
    if state != "tied":
        return ()
    # the two blocks that share a module are on one stage at the start (sharing cannot span processes) and are
    # both dense: in ``mixed`` the nearest dense neighbour is two ids away
    pairs = []
    for ids in stage_blocks(counts):
        dense = [i for i in ids if block_kind(shape, i) == "dense"]
        pairs += list(zip(dense, dense[1:]))
    return rng.choice(pairs) if pairs else None


def draw(seed: int, fsdp_every: int = FSDP_EVERY) -> Draw:
    """The trainer of ``seed``: every ``fsdp_every``-th seed (``seed
    % fsdp_every == fsdp_every - 1``) is FSDP2."""
    rng = random.Random(seed)
    pick = {axis: rng.choice(TORCH_SCHEDULES if axis == "schedule" else values)
            for axis, values in AXES.items() if axis not in LATE}
    fsdp = fsdp_every > 0 and seed % fsdp_every == fsdp_every - 1
    mesh = rng.choice(("dp_pp", "pp_dp")) if fsdp else ""
    if pick["impl"] == "fused" and pick["optimizer"] not in (FSDP_FUSED if fsdp else FUSED):
        # torch has no fused RMSprop, and DTensor (FSDP2's parameters)
        # no sharding rule for fused SGD or Adagrad
        pick["impl"] = rng.choice(("foreach", "forloop"))
    if pick["block_state"] == "tied" and (fsdp or pick["schedule"] == "zbv"):
        # fully_shard on each block cannot shard one module that two blocks hold; torch's ZBV computes weight
        # gradients apart from input gradients and fails on a parameter two blocks share ("backward through
        # the graph a second time", the trainer without vpipe too): these draws tie nothing
        pick["block_state"] = rng.choice(("plain", "batchnorm", "frozen", "hook"))
    if pick["clip"] == "global" and (pick["block_state"] == "batchnorm" or pick["shape"] == "mixed"):
        # global clipping agrees to rounding only, and a rounding difference does not stay small where a 2-row
        # micro-batch's BatchNorm divides by its variance, or a token changes expert under MoE's top-1 routing
        # (seen as 2 % and 30 % after 8 steps): these draws clip per stage or not at all
        pick["clip"] = rng.choice(("none", "stage"))
    stages = 4 if pick["schedule"] in MULTI_STAGE else 2
    layers = 8 if stages == 4 else rng.choice((4, 6, 8))
    for _ in range(100):  # a tied draw needs two dense blocks on one stage at the start: re-draw the split
        counts = _split(rng, layers, stages)
        pinned = _pinned(rng, pick["shape"], pick["block_state"], counts)
        if pinned is not None:
            break
    else:
        raise AssertionError(f"seed {seed}: no split ties two blocks")
    steps = (FSDP_STEPS if fsdp else STEPS)[pick["accum"]]
    # 2-4 forced plans at distinct steps 1 .. steps-1 (each leaves a step to train
    # after it), each a different contiguous split with every stage non-empty: moves
    # in both directions, some inside an accumulation window
    at_steps = sorted(rng.sample(range(1, steps), rng.randint(2, 4)))
    plans, last = [], counts
    for at in at_steps:
        new = _split(rng, layers, stages)
        for _ in range(20):
            if new != last:
                break
            new = _split(rng, layers, stages)
        plans.append((at, new, _policies(rng, layers)))
        last = new
    policies = _policies(rng, layers)
    nas, plans = _removal(rng, fsdp, steps, counts, plans, tuple(pinned))
    # FSDP2 draws: Muon has no DTensor support, and an AveragedModel
    # copy of a sharded root is not what users keep
    extra = "none" if fsdp else rng.choice(AXES["extra"])
    if extra == "muon" and pick["clip"] == "global":
        # Muon orthogonalises each update in bfloat16: global clipping's rounding difference (the stages'
        # norms summed in another grouping) comes out of it 0.5 % of a weight apart (seen: seed 1206 of the
        # old draws, identical with clip none or per stage): these draws clip per stage or not at all
        pick["clip"] = rng.choice(("none", "stage"))
    # a quarter of the draws leave the moves to vpipe's planner: no plan is forced and no block removed (a
    # removal must leave its stage a block whatever the placement, which only forced plans make known); not
    # under FSDP2 (four ranks on two cores: the planner would act on contention)
    moves = "planner" if not fsdp and rng.random() < 0.25 else "forced"
    if moves == "planner":
        plans, nas = [], ()
    # a quarter of the draws parametrize their blocks' weights; not under FSDP2 (fully_shard of a parametrized
    # module is not what torchtitan users build)
    weights = "parametrized" if not fsdp and rng.random() < 0.25 else "plain"
    added, plans = _addition(rng, fsdp or bool(nas), steps, layers, plans)
    if added and pick["impl"] == "fused" and pick["optimizer"] == "sgd":
        # torch's fused SGD makes momentum buffers only for a group that has none: a block added to a group
        # that has stepped fails its first step (the trainer without vpipe too, seeds 10002 and 10075)
        pick["impl"] = "foreach"
    d = Draw(seed=seed, fsdp=fsdp, mesh=mesh, layers=layers, counts=counts, steps=steps, policies=policies,
             plans=tuple(plans), pinned=tuple(pinned), nas_remove=nas, extra=extra, moves=moves,
             weights=weights,
             nas_add=added, **pick)
    from fuzz.late import draw_late  # the axes added last, in a module of their own

    return draw_late(rng, d)


def _addition(rng: random.Random, excluded: bool, steps: int, layers: int, plans: list
              ) -> tuple[tuple[int, ...], list]:
    """A fifth of the draws that remove nothing add a block (``vp.add_layers`` with the trainer's layer
    factory; the plain copy inserts the same block by hand) before a random step and model position; plans
    from that step on place it too (one more block on the stage that holds its position in that plan's
    split). Not under FSDP2 (attach refuses a factory's unsharded blocks there). Drawn last."""
    if excluded or rng.random() >= 0.2:
        return (), plans
    at, position = rng.randrange(1, steps), rng.randrange(0, layers + 1)
    kept = []
    for s, c, p in plans:
        if s >= at:
            holder = len(c) - 1 if position == layers else _stage_of(c, position)
            c = tuple(n + (i == holder) for i, n in enumerate(c))
            p = p + rng.choice("DSR")  # policies by layer id: the new block's id is the last
        kept.append((s, c, p))
    return (at, position), kept


def _restore(d: Draw, at: int, counts: tuple[int, ...], policies: str) -> tuple[int, tuple[int, ...], str]:
    """A plan after the removal, with the removed block back on the stage of its next block (or the last)."""
    if at < d.nas_remove[0]:
        return at, counts, policies
    x = d.nas_remove[1]
    stages = d.plan_stages(at, counts)
    s = next((i for i, ids in enumerate(stages) if ids[-1] > x), len(stages) - 1)
    return at, tuple(c + (i == s) for i, c in enumerate(counts)), policies


def _stage_of(counts: tuple[int, ...], layer_id: int) -> int:
    return next(s for s, ids in enumerate(stage_blocks(counts)) if layer_id in ids)


def _removal(rng: random.Random, fsdp: bool, steps: int, counts: tuple[int, ...], plans: list,
             pinned: tuple[int, ...]
             ) -> tuple[tuple[int, ...], list]:
    """A third of the draws remove one block (``vp.remove_layers``; the plain copy deletes it from its
    container and optimizer) before a random step; plans from that step on place the blocks left. Drawn
    last, so a seed's other choices stay what they were without this axis."""
    # FSDP2: the plain copy cannot take a block out of a sharded root by hand
    if rng.random() >= 1 / 3 or fsdp:
        return (), plans
    at = rng.randrange(1, steps)
    # the block is pinned by nothing, and its stage keeps a block whatever placement is in force when it goes
    # (a refused plan leaves an earlier one) and in every plan after it
    placements = [counts] + [c for s, c, _ in plans]
    options = [x for x in range(sum(counts)) if x not in pinned
               and all(c[_stage_of(c, x)] >= 2 for c in placements)]
    if not options:
        return (), plans
    x = rng.choice(options)
    kept = [(s, c, p) for s, c, p in plans if s < at]
    for s, c, p in plans:
        if s >= at:
            new = list(c)
            new[_stage_of(c, x)] -= 1
            kept.append((s, tuple(new), p))
    return (at, x), kept


def override(d: Draw, settings: list[str]) -> Draw:
    """``d`` with axes set by hand (``["autocast=none", "accum=1"]``), to bisect a failure; also
    ``policies=X`` (X one of D, S, R: every layer, at attach and in every plan) and ``plans=none`` (no
    forced plan). A forced value's own constraints are applied again (tests/fuzz/constraints.py); a
    combination still unsupported raises Unsupported (a ValueError), in one line that says why."""
    changes: dict[str, Any] = {}
    for setting in settings:
        axis, _, value = setting.partition("=")
        if axis == "policies" and value in ("D", "S", "R"):
            changes["policies"] = value * d.layers
            changes["plans"] = tuple((at, counts, value * d.layers)
                                     for at, counts, _ in changes.get("plans", d.plans))
            continue
        if axis == "plans" and value == "none":
            changes["plans"] = ()
            continue
        if axis == "nas" and value == "none" and d.nas_remove:
            changes["nas_remove"] = ()
            changes["plans"] = tuple(_restore(d, at, c, p) for at, c, p in changes.get("plans", d.plans))
            continue
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; axes: {', '.join(AXES)}, policies, plans")
        allowed = {str(v): v for v in AXES[axis]}
        if value not in allowed:
            raise ValueError(f"{axis} takes {', '.join(allowed)}, not {value!r}")
        changes[axis] = allowed[value]
    if not changes:
        return d
    from fuzz.constraints import Unsupported, force, violations

    forced = force(d, replace(d, **changes), changes)
    if broken := violations(forced):
        raise Unsupported(f"seed {d.seed} with {' '.join(settings)}: {'; '.join(broken)}")
    return forced


def covering_seeds(count: int = 20, pool: range = range(600), fsdp_every: int = FSDP_EVERY,
                   four_rank_draws: int = 5) -> list[int]:
    """A small sample of seeds that together take every value of every axis (greedy), at most
    ``four_rank_draws`` of them on 4 ranks (FSDP2 and data-parallel draws: the slow ones), padded to
    ``count`` with seeds that add the most pairs of values not yet seen together."""
    draws = [draw(s, fsdp_every) for s in pool]
    values = {(axis, str(getattr(d, axis))) for d in draws for axis in AXES}

    def singles(d: Draw) -> set[tuple[str, str]]:
        return {(axis, str(getattr(d, axis))) for axis in AXES}

    def pairs(d: Draw) -> set[tuple[tuple[str, str], tuple[str, str]]]:
        items = sorted(singles(d))
        return {(a, b) for i, a in enumerate(items) for b in items[i + 1:]}

    chosen: list[Draw] = []
    seen: set[Any] = set()
    seen_pairs: set[Any] = set()
    for target, gain in ((values, singles), (None, pairs)):
        while len(chosen) < count and (target is None or not target <= seen):
            four_left = sum(d.ranks == 4 for d in chosen) < four_rank_draws
            pool_left = [d for d in draws if d not in chosen and (four_left or d.ranks == 2)]
            known = seen if gain is singles else seen_pairs
            best = max(pool_left, key=lambda d: (len(gain(d) - known), -d.seed))
            chosen.append(best)
            seen |= singles(best)
            seen_pairs |= pairs(best)
    return sorted(d.seed for d in chosen)
