"""Predict a real run's step time with the simulator, and calibrate the framework's fixed cost per action.

Layer profiles (:func:`vpipe.runtime.costs.measure_model_costs`) time the layers alone. A
pipeline adds a fixed cost to every forward and backward action: the schedule's Python,
autograd's engine starting a backward, gloo's send and receive calls. That cost does not
grow with the micro-batch, so it is measured where it matters most: one real run of the
same model and pipeline at micro-batch size 1, for which the overhead per action that makes
the simulation match is found by bisection (step time grows monotonically with it). The
calibrated overhead is then used, unchanged, to predict runs at other sizes.

A shared machine's other processes take cores away from the ranks. Each real run reports
that load (``external_cores``, see :mod:`vpipe.runtime.measure`), and the simulation shares
the cores between the computing stages and that many always-busy outside threads.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass
from typing import Any

from vpipe.runtime.config import RunConfig
from vpipe.runtime.costs import Link, ModelCosts, measure_model_costs, stage_costs
from vpipe.runtime.measure import MeasuredRun, run_training
from vpipe.runtime.simulate import simulate

__all__ = ["REFERENCE_RUN", "Prediction", "predict_step_s", "calibrate_action_overhead", "validate"]

# The reference run the simulator is validated on (tests and benchmarks/simulator_bench.py): the
# transformer LM of `vpipe train` at 8 blocks, 4 micro-batches of 8 under GPipe; ``stages`` is set per case.
REFERENCE_RUN = RunConfig(model="transformer", blocks=8, d_model=64, seq_len=64, schedule="gpipe", micro_batches=4,
                          micro_batch_size=8, steps=14, progress=False)


@dataclass(frozen=True)
class Prediction:
    """Simulated and measured steady step time of one configuration."""

    stages: int
    schedule: str
    micro_batch_size: int
    predicted_s: float  # the median measured step x the median over runs of predicted / measured
    measured_s: float
    external_cores: float
    action_overhead_s: float
    measured_runs_s: tuple[float, ...] = ()

    @property
    def error(self) -> float:
        """Relative error of the prediction (positive: predicted slower than measured)."""
        return self.predicted_s / self.measured_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "error": self.error}


def predict_step_s(cfg: RunConfig, costs: ModelCosts, *, action_overhead_s: float = 0.0, background: float = 0.0,
                   cores: int | None = None, link: Link | None = None, steps: int = 8) -> float:
    """Steady step time the simulator predicts for ``cfg`` (its schedule, partition, micro-batches)."""
    per_stage = stage_costs(costs, cfg.layer_counts(), schedule=cfg.schedule, link=link,
                            action_overhead_s=action_overhead_s)
    return simulate(per_stage, schedule=cfg.schedule, micro_batches=cfg.micro_batches, steps=steps,
                    cores=cores or os.cpu_count() or 1, background=background).step_s


def _measure(cfg: RunConfig, repeats: int) -> list[tuple[float, float]]:
    """Per real run: its median steady step and the outside load during it (cores)."""
    runs: list[MeasuredRun] = [run_training(cfg) for _ in range(repeats)]
    return [(statistics.median(r.steady()), r.external_cores) for r in runs]


def _ratio(cfg: RunConfig, costs: ModelCosts, runs: list[tuple[float, float]], overhead: float) -> float:
    """Median over runs of predicted / measured, each run simulated under its own outside load."""
    return statistics.median(predict_step_s(cfg, costs, action_overhead_s=overhead, background=load) / step
                             for step, load in runs)


def calibrate_action_overhead(cfg: RunConfig, runs: list[tuple[float, float]], costs: ModelCosts, *,
                              high_s: float = 0.1) -> float:
    """Seconds per forward/backward action that make the simulation of ``cfg`` match its real ``runs``
    (the median over runs of predicted / measured is 1); 0 when the layers alone already match."""
    if _ratio(cfg, costs, runs, 0.0) >= 1.0:
        return 0.0
    low, high = 0.0, high_s
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if _ratio(cfg, costs, runs, mid) < 1.0 else (low, mid)
    return (low + high) / 2


def validate(cfg: RunConfig, *, repeats: int = 3) -> Prediction:
    """Predict ``cfg``'s step time and compare with ``repeats`` real runs.

    The overhead per action is calibrated on runs of ``cfg`` at micro-batch size 1, each run
    right before one of ``cfg`` so that both see about the same outside load; every run is
    predicted under its own outside load, and the reported ratio is the median over runs.
    """
    tiny = dataclasses.replace(cfg, micro_batch_size=1)
    tiny_runs: list[tuple[float, float]] = []
    runs: list[tuple[float, float]] = []
    for _ in range(repeats):
        tiny_runs += _measure(tiny, 1)
        runs += _measure(cfg, 1)
    overhead = calibrate_action_overhead(tiny, tiny_runs, measure_model_costs(tiny))
    ratio = _ratio(cfg, measure_model_costs(cfg), runs, overhead)
    measured = statistics.median(step for step, _ in runs)
    return Prediction(stages=cfg.stages, schedule=cfg.schedule, micro_batch_size=cfg.micro_batch_size,
                      predicted_s=measured * ratio, measured_s=measured,
                      external_cores=statistics.median(load for _, load in runs), action_overhead_s=overhead,
                      measured_runs_s=tuple(step for step, _ in runs))
