"""The axes added last to the fuzzer, drawn after every other choice of :func:`fuzz.draws.draw`.

Drawn last, so the choices a seed made before these axes existed stay what they were (a seed
reported before is still its reproduction, with these axes at their first value or constrained
here). Each constraint is a comment where it is applied.
"""

from __future__ import annotations

import random
from dataclasses import replace

from fuzz.draws import PIPEDREAM, STEPS, Draw, _policies, _split

DP_EVERY, DP_RESIDUE = 10, 4  # every 10th seed (ending in 4; FSDP2's end in 9) runs on data-parallel replicas
PIPEDREAM_SHARE = 0.3  # of the draws on two stages without FSDP2: about 15 % of all draws
TWO_BW_GAP = 3  # under 2BW a move holds the stream for two steps: the next one takes effect 3 steps later
TP_EVERY, TP_RESIDUE = 20, 7  # every 20th seed (07, 27, 47, ...) runs tensor-parallel blocks
DS_EVERY, DS_RESIDUE = 20, 17  # every 20th seed (17, 37, 57, ...) runs DeepSpeed's PipelineEngine


def draw_late(rng: random.Random, d: Draw) -> Draw:
    # a third of the draws compile their blocks; under FSDP2 a sixth (four ranks compiling on two cores),
    # then sharded (torchtitan's order: fully_shard over the block torch.compile wrapped, or one compiled
    # in place)
    share = 1 / 6 if d.fsdp else 1 / 3
    compiled = rng.choice(("wrap", "in_place")) if rng.random() < share else "none"
    if compiled == "wrap" and d.schedule == "zbv":
        # torch's ZBV refuses a stage module holding an OptimizedModule (the trainer without vpipe too): ZBV's
        # users compile their blocks in place
        compiled = "in_place"
    # a quarter of the draws (FSDP2's too: GradScaler unscales DTensor shards) scale their losses and make 1-2
    # drawn steps overflow (their first micro-batch's loss infinite, as a bad batch makes it): every stage's
    # gradients are then non-finite, so every rank's scaler skips the same steps and halves its scale
    scaler, inf_steps = "none", ()
    if rng.random() < 0.25:
        scaler, inf_steps = "skips", tuple(sorted(rng.sample(range(d.steps), rng.randint(1, 2))))
    d = replace(d, compiled=compiled, scaler=scaler, inf_steps=inf_steps)
    if fused_sgd_skips_its_first_step(d):
        # torch's fused SGD makes its momentum buffers with torch.empty_like at its first step and leaves them
        # to its kernel, which a step the scaler skips never runs: the next step reads uninitialised memory
        # (the trainer without vpipe too: seed 10323, weights of 1e11)
        d = replace(d, impl="foreach")
    if not d.fsdp and d.seed % DP_EVERY == DP_RESIDUE:
        return _replicas(rng, d)
    if not d.fsdp and d.seed % TP_EVERY == TP_RESIDUE:
        return tensor_parallel(rng, d)
    if not d.fsdp and d.seed % DS_EVERY == DS_RESIDUE:
        return deepspeed(rng, d)
    if d.fsdp or d.schedule not in ("gpipe", "1f1b") or rng.random() >= PIPEDREAM_SHARE:
        return d
    return _pipedream(rng, d, rng.choice(PIPEDREAM))


def fused_sgd_skips_its_first_step(d: Draw) -> bool:
    """Whether ``d``'s GradScaler skips the first optimizer step of a fused SGD (an infinite loss in the
    first accumulation window)."""
    return d.impl == "fused" and d.optimizer == "sgd" and bool(d.inf_steps) and min(d.inf_steps) < d.accum


def _replicas(rng: random.Random, d: Draw) -> Draw:
    """The draw on two data-parallel replicas of its pipeline (a 2x2 mesh in a drawn order), gradients
    all-reduced by the trainer; under ZeRO a third of the time."""
    dp = "zero" if rng.random() < 1 / 3 else "allreduce"
    mesh = rng.choice(("dp_pp", "pp_dp"))
    # four ranks on two cores: vpipe's planner would act on contention (as under FSDP2), so plans are forced;
    # a planner draw gets none (vpipe's other work, swap and recompute, still runs)
    extra = d.extra
    if dp == "zero" and extra == "muon":
        # ZeRO wraps one optimizer class: the Muon recipe's second optimizer is not drawn with it
        extra = "none"
    if d.moves == "planner":  # two plans of its own instead, over the blocks drawn (no block added then)
        d = replace(d, plans=_plans(rng, d, sorted(rng.sample(range(1, d.steps), 2))), nas_add=())
    return replace(d, dp=dp, mesh=mesh, extra=extra, moves="forced")


def tensor_parallel(rng: random.Random, d: Draw) -> Draw:
    """The draw with its blocks tensor-parallel over a 2x2 (pp, tp) mesh in a drawn order (4 ranks)."""
    # four ranks on two cores: forced plans, as for the data-parallel replicas (a planner draw gets two)
    if d.moves == "planner":
        d = replace(d, plans=_plans(rng, d, sorted(rng.sample(range(1, d.steps), 2))), nas_add=())
    block_state, pinned = d.block_state, d.pinned
    if block_state == "tied":  # parallelize_module cannot distribute one module that two blocks hold
        block_state, pinned = "plain", ()
    return replace(
        d, tp="mlp", mesh=rng.choice(("tp_pp", "pp_tp")), moves="forced", block_state=block_state,
        pinned=pinned,
        # a stage holds DTensors (the blocks' projections) and plain tensors (norms, embeddings, head), and
        # torch's foreach and fused kernels, and the norm clipping stacks, refuse a list mixing them: the
        # optimizer steps parameter by parameter (torch's CPU default), and nothing clips
        impl="forloop", clip="none",
        # not drawn with tensor parallelism yet: compiled blocks and GradScaler over DTensors (four ranks on
        # two cores, as under FSDP2); Muon (no DTensor support) and a carried EMA (vpipe carries no DTensor
        # average); weight_norm, whose parameters' dotted names parallelize_module cannot register
        compiled="none", scaler="none", inf_steps=(), extra="none", weights="plain")


def deepspeed(rng: random.Random, d: Draw) -> Draw:
    """The draw trained by DeepSpeed's PipelineEngine on 2 ranks (tests/fuzz/deepspeed_draw.py)."""
    # a PipelineModule of the blocks alone (an nn.Sequential's shape: no embeddings or head to pin at either
    # end), on DeepSpeed's uniform partition, under its own 1F1B TrainSchedule; one train_batch is one step
    layers = d.layers
    counts = (layers // 2, layers - layers // 2)
    d = replace(d, shape="sequential", schedule="1f1b", counts=counts, accum=1, steps=STEPS[1])
    plans = _plans(rng, d, sorted(rng.sample(range(1, d.steps), rng.randint(2, 4))))
    block_state, pinned = d.block_state, d.pinned
    if block_state == "tied":  # a module shared by two LayerSpec layers is DeepSpeed's TiedLayerSpec's job
        block_state, pinned = "plain", ()
    return replace(
        d, engine="deepspeed", plans=plans, block_state=block_state, pinned=pinned, moves="forced",
        # DeepSpeed's own clipping measures the first stage's gradients only: a norm that depends on the split
        # (tests/fuzz/deepspeed_draw.py); the draws clip nothing
        clip="none",
        # vpipe refuses layer edits under DeepSpeed (its checkpoint files are numbered by layer at initialize)
        # and a carried EMA; DeepSpeed holds one optimizer and scales fp16 losses itself; not compiled here
        nas_remove=(), nas_add=(), extra="none", scaler="none", inf_steps=(), compiled="none")


def _plans(rng: random.Random, d: Draw, steps: list[int]) -> tuple[tuple[int, tuple[int, ...], str], ...]:
    """Forced plans at ``steps``, each a new split of the draw's blocks (no edit in these draws)."""
    plans: list[tuple[int, tuple[int, ...], str]] = []
    last = d.counts
    for at in steps:
        new = _split(rng, d.layers, d.num_stages)
        for _ in range(20):
            if new != last:
                break
            new = _split(rng, d.layers, d.num_stages)
        plans.append((at, new, _policies(rng, d.layers)))
        last = new
    return tuple(plans)


def _pipedream(rng: random.Random, d: Draw, schedule: str) -> Draw:
    """A two-stage draw run under vpipe's PipeDream (or 2BW) schedule instead, both copies alike."""
    plans: list[tuple[int, tuple[int, ...], str]] = []
    if schedule == "2bw":
        # 2BW runs a micro-batch on one weight version on every stage, so where a block trains does not change
        # what it learns: 1-2 forced plans, TWO_BW_GAP steps apart (sooner, vpipe refuses the second)
        first = rng.randrange(2, STEPS[1] - TWO_BW_GAP)
        steps = [first] + ([rng.randrange(first + TWO_BW_GAP, STEPS[1])] if rng.random() < 0.5 else [])
        plans = list(_plans(rng, d, steps))
    # PipeDream's weight stashing keeps p - k versions on stage k: a block that moves trains on another delay,
    # so two runs on two splits differ (docs/schedules.md, the schedule's own arithmetic): PipeDream draws
    # force no plan, and what vpipe does under it (swap, recompute by the drawn policies) must change nothing
    return replace(
        # vpipe's PipeDream streams move blocks only in an nn.Sequential named by
        # global layer id (docs/schedules.md): the stage module users give those
        # schedules (tests/fuzz/models.py builds it so under them)
        d, shape="sequential", schedule=schedule, plans=tuple(plans), moves="forced", nas_remove=(),
                   nas_add=(),
        # the schedule steps the optimizer inside step() (one per micro-batch, or per period
        # at its last backward), at points that differ per stage: no accumulation window, no
        # LR scheduler stepped between step() calls, no clipping or GradScaler between
        # backward and step (nowhere for the trainer to put them)
        accum=1, steps=STEPS[1], lr_scheduler="none", clip="none", scaler="none", inf_steps=(),
        # an EMA under PipeDream is refused at attach with carry= (docs/identical.md), and the schedule holds
        # one optimizer (the Muon recipe's two cannot be given to it): nothing beside the optimizer
        extra="none",
        # vpipe defers BatchNorm's statistics to the step's end under PipeDream; the plain copy would have to
        # defer them by hand (tests/workers/norm_worker.py): BatchNorm draws run plain blocks here
        block_state="plain" if d.block_state == "batchnorm" else d.block_state)
