"""Per-step metrics where people look: TensorBoard and Weights & Biases, turned on by one option.

``vpipe.attach(..., metrics="tensorboard")`` (or ``"wandb"``, or both comma-separated; the
environment's ``VPIPE_METRICS``) writes, after every step, one scalar per field below for
each of this rank's stages into ``metrics_dir/rank{r}`` (TensorBoard event files; a W&B run
named ``rank{r}`` in that directory). Fields (docs/timeline.md has them with their units):

- every step: ``step_time_s`` (the rank's step, wall clock), ``plan_epoch``, and per stage
  ``stage{k}/layers``, ``stage{k}/peak_saved_bytes`` (what the tensor manager held at most),
  ``stage{k}/budget_bytes`` (when there is a budget), ``stage{k}/swapped_bytes`` (copied to
  the host this step) and ``stage{k}/recompute_s``; ``stage{k}/speed_factor`` once a plan says
  how much slower than the fastest stage the stage's device runs its blocks;
- the steps the monitor samples (``sample_every``): ``stage{k}/compute_s`` (its layers' and
  other modules' forwards and backwards), ``stage{k}/bubble`` (the step's share not spent
  computing) and ``stage{k}/device_peak_bytes`` (the device's own peak: allocated on CUDA).

The writers are made when vpipe attaches (a missing package, or a ``metrics_dir`` that is not
a directory this user can write, is a clear error then) and flushed and closed when it detaches.
A write that fails later (a full disk) is said once on stderr and drops that backend: metrics
never end training. ``metrics_dir/rank{r}`` must be this user's own directory (not a link, not
another user's), reached through no link another user could have planted, so the backends'
files are never made where someone else can plant a link; vpipe makes it ``0700``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vpipe.files import DIR_MODE, PlantedLinkError, open_dir
from vpipe.settings import METRIC_KINDS, parse_metric_kinds

__all__ = ["MetricsWriter", "METRIC_KINDS", "parse_metric_kinds"]

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


class MetricsWriter:
    """One rank's per-step scalars, to each backend named."""

    def __init__(self, kinds: tuple[str, ...], directory: str | Path, *, rank: int) -> None:
        missing = [k for k in kinds if importlib.util.find_spec(_PACKAGES[k]) is None]
        if missing:
            raise ValueError(f"metrics={','.join(kinds)!r} needs the {', '.join(missing)} package: "
                             f"pip install {' '.join(_PACKAGES[k] for k in missing)}")
        self.rank = rank
        self.directory = _own_directory(Path(directory), f"rank{rank}")
        self._tensorboard: Any = None
        self._wandb: Any = None
        self._failed = False  # a write failed: said once, that backend dropped
        try:
            if "tensorboard" in kinds:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(log_dir=str(self.directory))
            if "wandb" in kinds:
                import wandb

                self._wandb = wandb.init(project="vpipe", name=f"rank{rank}", dir=str(self.directory),
                                         reinit=True)
        except OSError as e:
            raise ValueError(
                f"metrics_dir {directory}: cannot write in {self.directory}: {e.strerror or e}"
            ) from None
        # stage -> (d2h bytes, recompute s) at the last step's end
        self._last: dict[int, tuple[int, float]] = {}

    def step(self, iteration: int, step_s: float, epoch: int, stages: Mapping[int, tuple[int, Any]],
             records: list[Any], speeds: tuple[float, ...] | None = None) -> dict[str, float]:
        """Write the step's scalars; ``stages``: stage -> (layers, tensor manager or None); ``records``: the
        monitor's StageRecords when the step was sampled; ``speeds``: each stage's time factor, as the plan in
        force measured it. Returns what was written."""
        values: dict[str, float] = {"step_time_s": step_s, "plan_epoch": float(epoch)}
        for stage, (layers, manager) in stages.items():
            values[f"stage{stage}/layers"] = float(layers)
            if speeds is not None and stage < len(speeds):
                values[f"stage{stage}/speed_factor"] = float(speeds[stage])
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
            values[f"stage{record.stage}/bubble"] = (max(0.0, 1.0 - compute / record.step_s) if record.step_s
                                                     else 0.0)
            values[f"stage{record.stage}/device_peak_bytes"] = float(record.device_peak_bytes)
        if self._tensorboard is not None:
            try:
                for tag, value in values.items():
                    self._tensorboard.add_scalar(tag, value, global_step=iteration)
            except Exception as e:  # noqa: BLE001 - a full disk, or the backend's writer thread failing
                self._failed_write(e)
                _quietly(self._tensorboard.close)
                self._tensorboard = None
        if self._wandb is not None:
            try:
                self._wandb.log(values, step=iteration)
            except Exception as e:  # noqa: BLE001 - the same for W&B
                self._failed_write(e)
                _quietly(self._wandb.finish)
                self._wandb = None
        return values

    def close(self) -> None:
        backends, self._tensorboard, self._wandb = (self._tensorboard, self._wandb), None, None
        tensorboard, run = backends
        try:
            if tensorboard is not None:
                tensorboard.flush()
                tensorboard.close()
        except Exception as e:  # noqa: BLE001 - the last write failing ends nothing either
            self._failed_write(e)
        try:
            if run is not None:
                run.finish()
        except Exception as e:  # noqa: BLE001
            self._failed_write(e)

    def _failed_write(self, error: Exception) -> None:
        """A backend's write failed: said once, on the first failure; the caller drops that backend."""
        if self._failed:
            return
        self._failed = True
        reason = (error.strerror if isinstance(error, OSError)
                  else None) or str(error) or type(error).__name__
        try:
            sys.stderr.write(f"vpipe [rank {self.rank}]: cannot write the metrics to {self.directory} "
                             f"({reason}); training goes on, and its further metrics are dropped\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def _quietly(close: Any) -> None:
    try:
        close()
    except Exception:  # noqa: BLE001 - a backend that failed a write may fail its close too: dropped already
        pass


def _own_directory(base: Path, name: str) -> Path:
    """``base/name``, made if missing: checked at attach, where a ``metrics_dir``
    that is a file (or not writable) is a ValueError naming it; the rank's directory
    must be this user's own, not a link or another user's."""
    if base.exists() and not base.is_dir():
        raise ValueError(f"metrics_dir {base} is a file, not a directory")
    path = base / name
    try:
        dir_fd = open_dir(base, "metrics_dir", create=True)  # 0700, never through a link another user planted
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.close(dir_fd)
    except PlantedLinkError:
        raise
    except OSError as e:
        raise ValueError(f"metrics_dir {base}: cannot make {path}: {e.strerror or e}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"metrics_dir {base}: {path} is a symbolic link or a file, not a "
                         "directory of this user's")
    if info.st_uid != os.geteuid():
        raise ValueError(f"metrics_dir {base}: {path} belongs to another user (uid "
                         f"{info.st_uid}); give metrics_dir a directory of your own")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"metrics_dir {base}: cannot write in {path}: permission denied")
    return path

