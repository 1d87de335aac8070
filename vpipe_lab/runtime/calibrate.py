"""Predict a real run's step time with the simulator, and calibrate the framework's fixed cost per action.

Layer profiles (:func:`vpipe_lab.runtime.costs.measure_model_costs`) time the layers alone. A
pipeline adds a fixed cost to every forward and backward action (the schedule's Python,
autograd's engine starting a backward, gloo's send and receive calls), and its layers run
at a somewhat different speed than in the profile. Both are fitted to real runs of the same
model and pipeline at several micro-batch sizes: the fixed cost does not grow with the
micro-batch, so the smallest size pins it, and the largest pins the compute scale. The
fitted pair is then used, unchanged, to predict the run at the size in between.

A shared machine's other processes take cores away from the ranks. Each real run reports
how many outside threads were runnable on average (``outside_threads``, see
:mod:`vpipe_lab.runtime.measure`; the CPU time other processes used where that is not
available), and the simulation shares the cores between the computing stages and that many
always-busy outside threads, as the scheduler does.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from dataclasses import dataclass
from typing import Any

from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.costs import Link, ModelCosts, measure_model_costs, scaled, stage_costs
from vpipe_lab.runtime.measure import run_training
from vpipe_lab.runtime.simulate import simulate

__all__ = ["REFERENCE_RUN", "Calibration", "Prediction", "predict_step_s", "calibrate", "calibration_sizes",
           "typical", "validate"]

# The reference run the simulator is validated on (tests and benchmarks/simulator_bench.py): the
# transformer LM of `vpipe train` at 8 blocks, 4 micro-batches of 8 under GPipe; ``stages`` is set per case.
REFERENCE_RUN = RunConfig(model="transformer", blocks=8, d_model=64, seq_len=64, schedule="gpipe",
                          micro_batches=4,
                          micro_batch_size=8, steps=14, progress=False)


@dataclass(frozen=True)
class Prediction:
    """Simulated and measured steady step time of one configuration."""

    stages: int
    schedule: str
    micro_batch_size: int
    predicted_s: float  # the median measured step x the median over runs of predicted / measured
    measured_s: float
    background: float  # outside threads the simulation shared the cores with (median over runs)
    action_overhead_s: float
    compute_scale: float = 1.0
    measured_runs_s: tuple[float, ...] = ()
    # every real run: (micro-batch size, step seconds, outside load)
    runs: tuple[tuple[int, float, float], ...] = ()
    calibrated_on_stages: int = 0  # the pipeline depth whose runs gave the overhead and scale

    @property
    def calibration(self) -> Calibration:
        return Calibration(action_overhead_s=self.action_overhead_s, compute_scale=self.compute_scale)

    @property
    def error(self) -> float:
        """Relative error of the prediction (positive: predicted slower than measured)."""
        return self.predicted_s / self.measured_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "error": self.error}


def predict_step_s(cfg: RunConfig, costs: ModelCosts, *, action_overhead_s: float = 0.0,
                   background: float = 0.0,
                   cores: int | None = None, link: Link | None = None, steps: int = 8) -> float:
    """Steady step time the simulator predicts for ``cfg`` (its schedule, partition, micro-batches)."""
    per_stage = stage_costs(costs, cfg.layer_counts(), schedule=cfg.schedule, link=link,
                            action_overhead_s=action_overhead_s)
    return simulate(per_stage, schedule=cfg.schedule, micro_batches=cfg.micro_batches, steps=steps,
                    cores=cores or os.cpu_count() or 1, background=background).step_s


def _measure_run(cfg: RunConfig) -> tuple[float, float]:
    """One real run: its median steady step and the outside load during it (runnable threads)."""
    run = run_training(cfg)
    return (statistics.median(run.steady()), run.external_cores if run.outside_threads is None
            else run.outside_threads)


def _ratio(cfg: RunConfig, costs: ModelCosts, runs: list[tuple[float, float]], overhead: float) -> float:
    """Median over runs of predicted / measured, each run simulated under its own outside load."""
    return statistics.median(predict_step_s(cfg, costs, action_overhead_s=overhead, background=load) / step
                             for step, load in runs)


@dataclass(frozen=True)
class Calibration:
    """What a running pipeline adds to the layer profiles."""

    action_overhead_s: float  # fixed seconds per forward or backward action
    compute_scale: float  # layer time in a running pipeline / in the single-threaded profile


CalibrationPoint = tuple[RunConfig, ModelCosts, list[tuple[float, float]]]


def calibrate(*points: CalibrationPoint, iterations: int = 30) -> Calibration:
    """The overhead per action and compute scale that make the simulation best match real runs at two or more
    micro-batch sizes, each ``(config, profile, runs)``: least squares of log(predicted / measured) over the
    sizes. A small size pins the overhead, a large one the scale; with more than two sizes, noise in one run
    moves the fit less than it moves an exact solve through two.

    The simulated step is close to linear in both unknowns (compute scales, every action pays the overhead),
    so Gauss-Newton with finite-difference slopes converges in a few simulations per size; the overhead
    is kept at or above zero."""
    if len(points) < 2:
        raise ValueError(f"calibration needs runs at two or more micro-batch sizes, got {len(points)}")

    def residuals(overhead: float, scale: float) -> list[float]:
        return [math.log(_ratio(cfg, scaled(costs, scale), runs, overhead)) for cfg, costs, runs in points]

    overhead, scale = 1e-3, 1.0
    for _ in range(iterations):
        r = residuals(overhead, scale)
        d_overhead, d_scale = 1e-4, 1e-3 * scale
        j_overhead = [(b - a) / d_overhead for a, b in zip(r, residuals(overhead + d_overhead, scale))]
        j_scale = [(b - a) / d_scale for a, b in zip(r, residuals(overhead, scale + d_scale))]
        step_overhead, step_scale = _least_squares_step(j_overhead, j_scale, r)
        if overhead + step_overhead < 0.0:  # the overhead stops at zero: fit the scale alone
            step_overhead = -overhead
            step_scale = _least_squares_step(None, j_scale,
                                             [a + ja * step_overhead for a, ja in zip(r, j_overhead)])[1]
        overhead = overhead + step_overhead
        scale = min(max(scale + step_scale, 0.05), 20.0)
        if abs(step_overhead) < 1e-8 and abs(step_scale) < 1e-6 * scale:
            break
    return Calibration(action_overhead_s=overhead, compute_scale=scale)


def _least_squares_step(a: list[float] | None, b: list[float], r: list[float]) -> tuple[float, float]:
    """``(x, y)`` minimising ``sum((a_i x + b_i y + r_i)^2)`` (``x = 0`` when ``a`` is None)."""
    bb, br = sum(v * v for v in b), sum(v * w for v, w in zip(b, r))
    if a is None:
        return 0.0, (-br / bb if bb > 0 else 0.0)
    aa, ab, ar = sum(v * v for v in a), sum(v * w for v, w in zip(a, b)), sum(v * w for v, w in zip(a, r))
    det = aa * bb - ab * ab
    if abs(det) <= 1e-12 * max(aa * bb, 1e-300):
        return 0.0, (-br / bb if bb > 0 else 0.0)
    return (-ar * bb + br * ab) / det, (-br * aa + ar * ab) / det


def calibration_sizes(cfg: RunConfig) -> list[int]:
    """The micro-batch sizes :func:`validate` calibrates on: 1, half
    and twice ``cfg``'s (``cfg`` in between)."""
    return sorted({1, max(1, cfg.micro_batch_size // 2), 2 * cfg.micro_batch_size})


def _profile_round(cfg: RunConfig, taken: dict[int, list[ModelCosts]]) -> None:
    """One profile of ``cfg``'s model at every size in ``taken``, one after another, appended there."""
    for size, profiles in taken.items():
        profiles.append(measure_model_costs(dataclasses.replace(cfg, micro_batch_size=size), rounds=1))


def typical(profiles: list[ModelCosts]) -> ModelCosts:
    """Per layer, the median over profiles of the same model and size (the loss and batch likewise).

    A shared virtual machine's speed wanders by +-15% over seconds (another tenant's work, not
    ours): a profile of a few milliseconds catches one moment of it. The fastest of a few
    rounds is then as noisy as any one round; the median of many, taken at different moments,
    is not.
    """
    if not profiles:
        raise ValueError("typical needs at least one profile")
    first = profiles[0]
    if any((p.model, p.micro_batch_size, len(p.layers)) != (first.model, first.micro_batch_size,
                                                            len(first.layers))
           for p in profiles):
        raise ValueError("typical combines profiles of one model at one micro-batch size only")
    layers = [dataclasses.replace(layer, fwd_s=statistics.median(p.layers[i].fwd_s for p in profiles),
                                  bwd_s=statistics.median(p.layers[i].bwd_s for p in profiles),
                                  opt_s=statistics.median(p.layers[i].opt_s for p in profiles))
              for i, layer in enumerate(first.layers)]
    return dataclasses.replace(first, layers=layers, loss_fwd_s=statistics.median(p.loss_fwd_s
                                                                                  for p in profiles),
                               loss_bwd_s=statistics.median(p.loss_bwd_s for p in profiles),
                               batch_s=statistics.median(p.batch_s for p in profiles))


def validate(cfg: RunConfig, *, repeats: int = 3, profiles: dict[int, ModelCosts] | None = None,
             calibration: Calibration | None = None, calibrated_on_stages: int = 0) -> Prediction:
    """Predict ``cfg``'s step time and compare with ``repeats`` real runs.

    The overhead per action and the compute scale are calibrated on runs of the same
    pipeline at micro-batch sizes 1, half and twice ``cfg``'s (so ``cfg`` is interpolated,
    never extrapolated), interleaved with the runs of ``cfg`` so that all see about the same
    outside load; every run is predicted under its own outside load, and the reported ratio
    is the median over runs. Every micro-batch size is profiled once after each run and the
    rounds combined by :func:`typical`, so the profiles see the machine at as many moments as
    the runs do. ``profiles`` (by micro-batch size) is a cache: sizes already in it are not
    profiled again, the others are added to it, so that several stage counts of one model
    share one set (the compute scale is relative to the profiles it was fitted with).

    With ``calibration`` (another depth's, from its :attr:`Prediction.calibration`; that
    depth in ``calibrated_on_stages``) no calibration runs are made: the prediction then
    also tests that the fitted overhead and scale carry over to a pipeline they were not
    fitted on.
    """
    sizes = [] if calibration is not None else calibration_sizes(cfg)
    configs = [dataclasses.replace(cfg, micro_batch_size=size) for size in sizes]
    wanted = [*sizes, cfg.micro_batch_size]
    profiles = {} if profiles is None else profiles
    taken: dict[int, list[ModelCosts]] = {size: [] for size in wanted if size not in profiles}
    calibration_runs: list[list[tuple[float, float]]] = [[] for _ in sizes]
    runs: list[tuple[float, float]] = []

    def measure(c: RunConfig) -> tuple[float, float]:
        measured = _measure_run(c)
        if taken:
            _profile_round(cfg, taken)  # every size still missing, right after each run
        return measured

    for _ in range(repeats):
        for i, c in enumerate(configs):
            calibration_runs[i].append(measure(c))
        runs.append(measure(cfg))
    profiles.update({size: typical(rounds) for size, rounds in taken.items()})
    if calibration is None:
        calibration = calibrate(*zip(configs, (profiles[size] for size in sizes), calibration_runs))
        calibrated_on_stages = cfg.stages
    costs = scaled(profiles[cfg.micro_batch_size], calibration.compute_scale)
    ratio = _ratio(cfg, costs, runs, calibration.action_overhead_s)
    measured_s = statistics.median(step for step, _ in runs)
    return Prediction(stages=cfg.stages, schedule=cfg.schedule, micro_batch_size=cfg.micro_batch_size,
                      predicted_s=measured_s * ratio, measured_s=measured_s,
                      background=statistics.median(load for _, load in runs),
                      action_overhead_s=calibration.action_overhead_s,
                      compute_scale=calibration.compute_scale,
                      measured_runs_s=tuple(step for step, _ in runs),
                      runs=tuple((c.micro_batch_size, step, load)
                                 for c, r in zip([*configs, cfg], [*calibration_runs, runs])
                                 for step, load in r),
                      calibrated_on_stages=calibrated_on_stages)
