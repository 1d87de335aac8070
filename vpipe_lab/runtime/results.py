"""What a rank of the reference trainer reports: its :class:`RunResult`, the files it writes, what it shows.

``out_dir`` gets ``rank<r>.pt`` (parameters and optimizer state by name, after any moves)
and ``rank<r>.json`` (losses, step times, layers per stage, memory), each a new file (``0600``)
renamed into place (never written through a link); one that cannot be written (a full disk) is
said once and the run still ends cleanly. The last stage shows a progress bar while it trains and
a summary table at the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from vpipe.compat.torch_internals import child_modules
from vpipe.files import make_dirs, replacing, write_atomic
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.reference import optimizer_state_by_name
from vpipe_lab.runtime.stage_run import StageRun
from vpipe_lab.runtime.watchdog import stderr_line

__all__ = ["RunResult", "RunProgress", "save_rank_result", "samples_per_s", "print_summary"]


@dataclass
class RunResult:
    steps: int
    seconds: float
    losses: list[float] = field(default_factory=list)  # mean loss per step (last stage only)
    step_s: list[float] = field(default_factory=list)  # wall time of each step on this rank
    boundary_s: list[float] = field(default_factory=list)  # vpipe: of which applying plans before the step
    memory: dict[str, Any] | None = None  # vpipe: Vpipe.memory_report() at the end


def save_rank_result(cfg: RunConfig, run: StageRun, result: RunResult) -> None:
    """This rank's files in ``cfg.out_dir``; a write that fails is said in one line, never a traceback."""
    out = Path(cfg.out_dir or ".")
    try:
        _write_rank_result(out, run, result)
    except OSError as e:
        stderr_line(f"vpipe [rank {run.rank}]: cannot write this rank's results to {out} "
                    f"({e.strerror or e}); training finished without them")


def _write_rank_result(out: Path, run: StageRun, result: RunResult) -> None:
    make_dirs(out, "out_dir")  # 0700, never through a link another user planted
    layers = run.layers_view()
    state = {
        "params": {k: v.detach().cpu() for k, v in layers.state_dict().items()},
        "optimizer": optimizer_state_by_name(dict(layers.named_parameters()), [run.optimizer]),
    }
    with replacing(out / f"rank{run.rank}.pt") as f:
        torch.save(state, f)
    # after migrations, not the initial ones: all of the rank's layers, and each of its stages' layers
    per_stage = [[int(name) for name in child_modules(module)] for module in run.modules]
    meta = {"stage": run.stage_index, "layer_ids": [lid for ids in per_stage for lid in ids],
            "stages": run.stage_indices, "stage_layer_ids": per_stage, "losses": result.losses,
            "steps": result.steps, "seconds": result.seconds, "step_s": result.step_s,
            "boundary_s": result.boundary_s, "memory": result.memory,
            "lrs": [group["lr"] for group in run.optimizer.param_groups]}
    if run.streams:
        meta["trace"] = [list(event) for event in run.schedule.trace]
    write_atomic(out / f"rank{run.rank}.json", json.dumps(meta).encode())


def samples_per_s(cfg: RunConfig, result: RunResult) -> float:
    return 0.0 if result.seconds <= 0 else result.steps * cfg.batch_size / result.seconds


def print_summary(cfg: RunConfig, result: RunResult) -> None:
    table = Table(title="vpipe run summary", show_header=False)
    table.add_row("model", f"{cfg.model_spec().name} ({cfg.n_layers} layers)")
    stages = (f"{cfg.virtual_stages} stages on {cfg.stages} ranks" if cfg.multi_stage
              else f"{cfg.stages} stages")
    table.add_row("pipeline", f"{stages}, {cfg.schedule}, layers per stage {cfg.layer_counts()}")
    table.add_row("batch", f"{cfg.micro_batches} micro-batches x {cfg.micro_batch_size}")
    table.add_row("steps", f"{result.steps} in {result.seconds:.1f} s")
    table.add_row("throughput", f"{samples_per_s(cfg, result):.1f} samples/s")
    if result.losses:
        table.add_row("loss", f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
    Console(stderr=False).print(table)


class RunProgress:
    """A rich progress bar with loss and samples/s, shown by one rank only."""

    def __init__(self, cfg: RunConfig, enabled: bool) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> RunProgress:
        if self.enabled:
            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
                TimeRemainingColumn(),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.cfg.steps, loss="-", rate="-")
        return self

    def update(self, step: int, result: RunResult, elapsed: float) -> None:
        if self._bar is None:
            return
        loss = f"{result.losses[-1]:.3f}" if result.losses else "-"
        rate = f"{(step + 1) * self.cfg.batch_size / max(elapsed, 1e-9):.1f}"
        self._bar.update(self._task, completed=step + 1, loss=loss, rate=rate)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
