"""Per-step metrics where people look: TensorBoard and Weights & Biases, turned on by one option.

``vpipe.attach(..., metrics="tensorboard")`` (or ``"wandb"``, or both comma-separated; the
environment's ``VPIPE_METRICS``) writes, after every step, one scalar per field below for
each of this rank's stages into ``metrics_dir/rank{r}`` (TensorBoard event files; a W&B run
named ``rank{r}`` in that directory). Fields (docs/timeline.md has them with their units):

- every step: ``step_time_s`` (the rank's step, wall clock), ``plan_epoch``, and per stage
  ``stage{k}/layers``, ``stage{k}/peak_saved_bytes`` (what the tensor manager held at most),
  ``stage{k}/budget_bytes`` (when there is a budget), ``stage{k}/swapped_bytes`` (copied to
  the host this step) and ``stage{k}/recompute_s``;
- the steps the monitor samples (``sample_every``): ``stage{k}/compute_s`` (its layers' and
  other modules' forwards and backwards), ``stage{k}/bubble`` (the step's share not spent
  computing) and ``stage{k}/device_peak_bytes`` (the device's own peak: allocated on CUDA).

The writers are made when vpipe attaches (a missing package is a clear error then) and
flushed and closed when it detaches.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "METRIC_KINDS", "parse_metric_kinds"]

METRIC_KINDS = ("tensorboard", "wandb")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def parse_metric_kinds(text: str | None) -> tuple[str, ...]:
    """``"tensorboard"``, ``"wandb"``, ``"tensorboard,wandb"`` -> the kinds; None or "" -> none."""
    if not text:
        return ()
    kinds = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [k for k in kinds if k not in METRIC_KINDS]
    if unknown or not kinds:
        raise ValueError(f"metrics must name {' and/or '.join(METRIC_KINDS)} (comma-separated), got {text!r}")
    return kinds


class MetricsWriter:
    """One rank's per-step scalars, to each backend named."""

    def __init__(self, kinds: tuple[str, ...], directory: str | Path, *, rank: int) -> None:
        missing = [k for k in kinds if importlib.util.find_spec(_PACKAGES[k]) is None]
        if missing:
            raise ValueError(f"metrics={','.join(kinds)!r} needs the {', '.join(missing)} package: "
                             f"pip install {' '.join(_PACKAGES[k] for k in missing)}")
        self.directory = Path(directory) / f"rank{rank}"
        self._tensorboard: Any = None
        self._wandb: Any = None
        if "tensorboard" in kinds:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(self.directory))
        if "wandb" in kinds:
            import wandb

            self.directory.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(project="vpipe", name=f"rank{rank}", dir=str(self.directory), reinit=True)
        self._last: dict[int, tuple[int, float]] = {}  # stage -> (d2h bytes, recompute s) at the last step's end

    def step(self, iteration: int, step_s: float, epoch: int, stages: Mapping[int, tuple[int, Any]],
             records: list[Any]) -> dict[str, float]:
        """Write the step's scalars; ``stages``: stage -> (layers, tensor manager or None); ``records``: the
        monitor's StageRecords when the step was sampled. Returns what was written."""
        values: dict[str, float] = {"step_time_s": step_s, "plan_epoch": float(epoch)}
        for stage, (layers, manager) in stages.items():
            values[f"stage{stage}/layers"] = float(layers)
            if manager is None:
                continue
            summary = manager.summary()
            d2h, recompute = summary["d2h_bytes"], summary["recompute_s"]
            last_d2h, last_recompute = self._last.get(stage, (0, 0.0))
            self._last[stage] = (d2h, recompute)
            values[f"stage{stage}/peak_saved_bytes"] = float(manager.ledger.step_peak)
            if manager.budget_bytes is not None:
                values[f"stage{stage}/budget_bytes"] = float(manager.budget_bytes)
            values[f"stage{stage}/swapped_bytes"] = float(d2h - last_d2h)
            values[f"stage{stage}/recompute_s"] = recompute - last_recompute
            manager.ledger.reset_step_peak()  # (the run's peak, which memory reports read, stays)
        for record in records:
            compute = sum(layer.fwd_s + layer.bwd_s for layer in record.layers) \
                + record.outside_fwd_s + record.outside_bwd_s
            values[f"stage{record.stage}/compute_s"] = compute
            values[f"stage{record.stage}/bubble"] = max(0.0, 1.0 - compute / record.step_s) if record.step_s else 0.0
            values[f"stage{record.stage}/device_peak_bytes"] = float(record.device_peak_bytes)
        if self._tensorboard is not None:
            for tag, value in values.items():
                self._tensorboard.add_scalar(tag, value, global_step=iteration)
        if self._wandb is not None:
            self._wandb.log(values, step=iteration)
        return values

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.flush()
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

