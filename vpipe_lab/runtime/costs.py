"""Measured costs of a reference model, and the per-stage costs a simulation runs on.

:func:`measure_model_costs` times every layer of a :class:`RunConfig`'s model in this
process, one after another (:func:`vpipe.profiling.profile_layers`), plus what a pipeline adds around
the layers: the loss on the last stage, each layer's optimizer update and the input
batch. :func:`stage_costs` sums them for a partition under keep / swap / recompute
policies (recompute adds the forward to the backward, a swap adds the copy time that the
copy link cannot hide), which is what :func:`vpipe_lab.runtime.simulate.simulate` takes.

Costs vary with load from other processes, never downwards: a cost is the minimum over
``rounds`` independent profiles (each the median of ``repeats``), the estimate least
disturbed by a busy machine.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from vpipe.profiling.layers import profile_layers
from vpipe.tensor_manager.accounting import tensor_bytes
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.models import build_model
from vpipe_lab.runtime.simulate import StageCost
from vpipe_lab.runtime.trainer import make_optimizer

__all__ = ["LayerCost", "ModelCosts", "Link", "measure_model_costs", "stage_costs", "ideal_step_s", "scaled",
           "balanced_counts"]


@dataclass(frozen=True)
class LayerCost:
    """One layer, one micro-batch: seconds and bytes."""

    fwd_s: float
    bwd_s: float
    act_bytes: int  # saved for the backward when kept (D)
    input_bytes: int  # what a recomputed (R) micro-batch keeps: its input
    param_bytes: int
    out_bytes: int  # the boundary tensor when a stage ends after this layer
    opt_s: float  # one optimizer update of its parameters


@dataclass(frozen=True)
class ModelCosts:
    """All layers of a model at one micro-batch size, plus the pipeline's own work."""

    model: str
    micro_batch_size: int
    layers: list[LayerCost]
    loss_fwd_s: float  # the last stage's loss, per micro-batch
    loss_bwd_s: float
    batch_s: float  # making one step's input batch (stage 0) or targets (last stage)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelCosts:
        return cls(**{**data, "layers": [LayerCost(**layer) for layer in data["layers"]]})

    @property
    def compute_s(self) -> float:
        """Forward + backward of every layer and the loss for one micro-batch."""
        return sum(c.fwd_s + c.bwd_s for c in self.layers) + self.loss_fwd_s + self.loss_bwd_s


@dataclass(frozen=True)
class Link:
    """What moving bytes costs: boundary transfers between stages, swaps to the host.

    ``overlap`` says how much of a swap hides behind compute: 0 when copies are
    synchronous (CPU: the copy runs on the compute thread), 1 when an idle copy engine can
    run a layer's swap out and back entirely under its stage's compute (a GPU's DMA
    engine, as long as the link is not the bottleneck).
    """

    send_bytes_per_s: float = 2e9  # loopback gloo on this kind of machine
    send_latency_s: float = 0.0
    swap_bytes_per_s: float = 4e9  # device<->host copies (on CPU: memcpy)
    overlap: float = 0.0

    def __post_init__(self) -> None:
        if self.send_bytes_per_s <= 0 or self.swap_bytes_per_s <= 0:
            raise ValueError("link bandwidths must be positive")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")


def measure_model_costs(cfg: RunConfig, *, micro_batch_size: int | None = None, repeats: int = 5,
                        rounds: int = 3, threads: int = 1) -> ModelCosts:
    """Profile ``cfg``'s model layer by layer in this process (``threads`` intra-op threads, like a rank)."""
    mbs = micro_batch_size or cfg.micro_batch_size
    spec = cfg.model_spec()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_model(spec, seed=cfg.seed)
        x, y = spec.batch(0, mbs, cfg.seed)
        best: list[Any] = []
        for _ in range(max(1, rounds)):
            profiles = profile_layers(list(model), x, repeats=repeats)
            best = profiles if not best else [p if p.fwd_s + p.bwd_s < b.fwd_s + b.bwd_s else b
                                              for p, b in zip(profiles, best)]
        inputs = [tensor_bytes(x)] + [p.out_bytes for p in best[:-1]]
        opt_s = [_optimizer_s(cfg, layer, repeats, rounds, make_optimizer) for layer in model]
        with torch.no_grad():
            logits = model(x)
        loss_fwd, loss_bwd = _loss_s(spec.loss_fn(), logits, y, repeats * max(1, rounds))
        batch_s = min(_timed(lambda: spec.batch(1, mbs * cfg.micro_batches, cfg.seed))
                      for _ in range(repeats))
    finally:
        torch.set_num_threads(previous_threads)
    layers = [LayerCost(fwd_s=p.fwd_s, bwd_s=p.bwd_s, act_bytes=p.act_bytes, input_bytes=i,
                        param_bytes=p.param_bytes, out_bytes=p.out_bytes, opt_s=o)
              for p, i, o in zip(best, inputs, opt_s)]
    return ModelCosts(model=spec.name, micro_batch_size=mbs, layers=layers, loss_fwd_s=loss_fwd,
                      loss_bwd_s=loss_bwd, batch_s=batch_s)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _optimizer_s(cfg: RunConfig, layer: torch.nn.Module, repeats: int, rounds: int,
                 make_optimizer: Any) -> float:
    params = [p for p in layer.parameters() if p.requires_grad]
    if not params:
        return 0.0
    saved = [p.detach().clone() for p in params]
    opt = make_optimizer(cfg, params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # Adam creates its state on the first step: time the later ones
    times = [_timed(opt.step) for _ in range(repeats * max(1, rounds))]
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None
    return min(times)


def _loss_s(loss_fn: Any, logits: torch.Tensor, target: torch.Tensor, repeats: int) -> tuple[float, float]:
    fwd, bwd = [], []
    for _ in range(repeats):
        leaf = logits.detach().requires_grad_(True)
        t0 = time.perf_counter()
        loss = loss_fn(leaf, target)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return min(fwd), min(bwd)


def stage_costs(costs: ModelCosts, counts: Sequence[int], *, schedule: str = "gpipe",
                policies: Mapping[int, str] | None = None, link: Link | None = None,
                action_overhead_s: float = 0.0, step_overhead_s: float = 0.0) -> list[StageCost]:
    """Per-stage seconds per micro-batch for ``counts`` layers per stage (in model order).

    ``policies`` maps layer index -> ``"D" | "S" | "R"`` (default keep). A recomputed
    layer runs its forward again in the backward; a swapped layer copies its activations
    out and back, of which ``link.overlap`` hides behind the stage's compute.
    ``action_overhead_s`` is the framework's fixed cost per forward or backward action and
    ``step_overhead_s`` its fixed cost per step (both measured by calibration, see
    :mod:`vpipe_lab.runtime.calibrate`). The loss runs on the last stage, the input batch is
    made on the first and the last.
    """
    if sum(counts) != len(costs.layers) or any(c < 1 for c in counts):
        raise ValueError(
            f"counts {list(counts)} must give every stage >= 1 of the {len(costs.layers)} layers"
        )
    link = link or Link()
    policies = policies or {}
    out: list[StageCost] = []
    start = 0
    p = len(counts)
    for k, n in enumerate(counts):
        idx = range(start, start + n)
        start += n
        fwd = sum(costs.layers[i].fwd_s for i in idx)
        bwd = sum(costs.layers[i].bwd_s for i in idx)
        exposed_swap = 0.0
        for i in idx:
            policy = policies.get(i, "D")
            if policy == "R":
                bwd += costs.layers[i].fwd_s
            elif policy == "S":
                exposed_swap += 2 * costs.layers[i].act_bytes / link.swap_bytes_per_s
            elif policy != "D":
                raise ValueError(f"layer {i}: policy must be D, S or R, got {policy!r}")
        bwd += max(0.0, exposed_swap - link.overlap * (fwd + bwd))
        if k == p - 1:
            fwd += costs.loss_fwd_s
            bwd += costs.loss_bwd_s
        boundary = costs.layers[start - 1].out_bytes if k < p - 1 else 0
        send = link.send_latency_s + boundary / link.send_bytes_per_s if k < p - 1 else 0.0
        per_step = step_overhead_s + (costs.batch_s if k in (0, p - 1) else 0.0)
        opt = sum(costs.layers[i].opt_s for i in idx)
        if schedule != "pipedream":
            opt += per_step
        out.append(StageCost(fwd_s=fwd + action_overhead_s, bwd_s=bwd + action_overhead_s, send_s=send,
                             optimizer_s=opt))
    return out


def ideal_step_s(costs: ModelCosts, stages: int, micro_batches: int, *, cores: int | None = None) -> float:
    """Perfect balance, no bubble, no recompute, unlimited memory: the model's compute split evenly.

    ``cores`` (when fewer than ``stages``) caps the parallelism: stages that share cores
    cannot run faster together than the cores allow.
    """
    parallel = stages if cores is None else min(stages, cores)
    return micro_batches * costs.compute_s / parallel


def scaled(costs: ModelCosts, factor: float) -> ModelCosts:
    """Every time multiplied by ``factor`` (a faster or slower device), bytes unchanged."""
    layers = [replace(c, fwd_s=c.fwd_s * factor, bwd_s=c.bwd_s * factor, opt_s=c.opt_s * factor)
              for c in costs.layers]
    return replace(costs, layers=layers, loss_fwd_s=costs.loss_fwd_s * factor,
                   loss_bwd_s=costs.loss_bwd_s * factor,
                   batch_s=costs.batch_s * factor)


def balanced_counts(costs: ModelCosts, stages: int) -> list[int]:
    """Layers per stage minimising the slowest stage's forward + backward (the loss on the last stage).

    What a static partitioner such as torchgpipe's ``balance_by_time`` or PipeDream's
    planner gives a baseline: exact min-max over contiguous splits (a small DP).
    """
    n = len(costs.layers)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")
    w = [c.fwd_s + c.bwd_s for c in costs.layers]
    w[-1] += costs.loss_fwd_s + costs.loss_bwd_s
    prefix = [0.0]
    for x in w:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[k][j]: first j layers on k stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j] - 1e-15:
                    best[k][j], cut[k][j] = value, i
    counts, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]
