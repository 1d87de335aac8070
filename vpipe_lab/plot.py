"""``vpipe plot RUN.log -o run.png``: throughput and layers per stage over a run's time.

The top panel is the pipeline's pace, from the last stage's per-step records (logger
``vpipe.steps``): micro-batches per second, each step and a rolling median. The bottom
panel is how many layers each stage held, from the decisions that change it
(``attached``, ``plan_applied``, ``layers_added``, ``layers_removed``). Vertical lines mark
the moments layers moved or were added, so a dip and its recovery line up with the
decision that caused them. matplotlib is an optional extra (``pip install vpipe[plot]``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpipe.checks import shorten
from vpipe.files import output_file
from vpipe.log import DECISIONS, STEPS, read_log
from vpipe.output_paths import check_output_file

__all__ = ["RunSeries", "series_from_log", "plot_run", "register"]

_EDITS = ("layers_added", "layers_removed")


@dataclass
class RunSeries:
    """What the plot draws, in seconds since the run's first record."""

    step_t: list[float] = field(default_factory=list)
    step: list[int] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)  # micro-batches per second
    layers: dict[int, list[tuple[float, int]]] = field(default_factory=dict)  # stage -> (t, layer count)
    marks: list[tuple[float, str]] = field(default_factory=list)  # (t, event) for moves and edits

    def rolling(self, window: int = 5) -> list[float]:
        """Median of the last ``window`` steps: one slow step should not look like a trend."""
        return [statistics.median(self.throughput[max(0, i - window + 1):i + 1])
                for i in range(len(self.throughput))]


def series_from_log(records: Sequence[dict[str, Any]]) -> RunSeries:
    """Extract the plotted series; a log without per-step records is an error (nothing to draw)."""
    if not records:
        raise ValueError("the log has no records")
    t0 = min(r["t"] for r in records if isinstance(r.get("t"), (int, float)))
    out = RunSeries()
    for r in records:
        t = _number(r, "t", t0) - t0
        if r.get("logger") == STEPS and _positive(r.get("step_s")):
            out.step_t.append(t)
            out.step.append(int(_number(r, "step", len(out.step))))
            out.throughput.append(int(_number(r, "micro_batches", 1)) / float(r["step_s"]))
        elif r.get("logger") == DECISIONS:
            _layers_event(out, r, t)
    if not out.throughput:
        raise ValueError("the log has no per-step records (logger vpipe.steps): was vpipe attached, "
                         "with --log-file, for more than one step?")
    return out


def _number(record: dict[str, Any], key: str, default: float) -> float:
    """``record[key]`` as a number (``default`` when absent);
    ``ValueError`` names the record and the field."""
    value = record.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        what = record.get("event") or record.get("logger") or "record"
        raise ValueError(f"a {what} record (rank {record.get('rank', '?')}) has "
                         f"{key}={value!r:.40}, not a number")
    return float(value)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 0


def _layers_event(out: RunSeries, r: dict[str, Any], t: float) -> None:
    event = r.get("event")
    if event in ("attached", "plan_applied") and isinstance(r.get("stage"),
                                                            int) and isinstance(r.get("layers"), list):
        count = len(r["layers"])
        history = out.layers.setdefault(r["stage"], [])
        if not history or history[-1][1] != count:
            history.append((t, count))
            if event == "plan_applied":
                out.marks.append((t, "moved"))
    elif event in _EDITS and isinstance(r.get("placement"), list):
        for stage, held in enumerate(r["placement"]):
            history = out.layers.setdefault(stage, [])
            if not history or history[-1][1] != len(held):
                history.append((t, len(held)))
        out.marks.append((t, "added" if event == "layers_added" else "removed"))


def plot_run(log_file: str | Path, output: str | Path, *, title: str | None = None) -> RunSeries:
    """Draw ``log_file``'s run into the PNG ``output``; returns the series it drew."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("vpipe plot needs matplotlib: pip install 'vpipe[plot]'") from None
    records = read_log(log_file)  # a path that is no log file says so itself
    try:
        series = series_from_log(records)
    except ValueError as e:
        raise ValueError(f"{log_file}: {e}") from None
    end = max([series.step_t[-1]] + [h[-1][0] for h in series.layers.values()])
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), height_ratios=[3, 2])
    top.plot(series.step_t, series.throughput, ".", color="0.6", markersize=3, label="each step")
    top.plot(series.step_t, series.rolling(), color="C0", label="rolling median (5 steps)")
    top.set_ylabel("micro-batches / s")
    top.set_ylim(bottom=0)
    top.legend(loc="lower right")
    for stage in sorted(series.layers):
        history = series.layers[stage]
        xs = [t for t, _ in history] + [end]
        ys = [n for _, n in history] + [history[-1][1]]
        bottom.step(xs, ys, where="post", label=f"stage {stage}")
    bottom.set_ylabel("layers")
    bottom.set_xlabel("seconds since start")
    bottom.legend(loc="upper right")
    colours = {"moved": "C2", "added": "C3", "removed": "C1"}
    for t, kind in sorted(set(series.marks)):
        for ax in (top, bottom):
            ax.axvline(t, color=colours[kind], linewidth=0.8, linestyle="--", alpha=0.7)
    top.set_title(title or f"{Path(log_file).name}: throughput and layers per stage "
                           f"(dashed: red added, orange removed, green moved)")
    fig.tight_layout()
    try:
        # never through a planted link; exactly ``output``: no ".png" added
        with output_file(output, "-o") as f:
            fig.savefig(f, dpi=110, format="png")
    finally:
        plt.close(fig)
    return series


def register(sub: Any) -> None:
    parser = sub.add_parser("plot", help="draw a run's throughput and layers per stage over time (PNG)")
    parser.add_argument("log_file", help="a run log written with --log-file")
    parser.add_argument("-o", "--output", required=True, help="PNG file to write")
    parser.add_argument("--title", default=None)
    parser.set_defaults(func=_cmd_plot)


def _cmd_plot(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if not args.output.strip():
        print("vpipe plot: -o is empty; give the PNG file to write", file=sys.stderr)
        return 2
    folder = Path(args.output).resolve().parent
    if not folder.is_dir():
        print(f"vpipe plot: cannot write {args.output}: the directory {folder} does not exist",
              file=sys.stderr)
        return 2
    try:
        check_output_file(args.output, "-o")  # a planted link or a directory there: said before drawing
        series = plot_run(args.log_file, args.output, title=args.title)
    except (ValueError, RuntimeError) as e:  # FileCheckError (a planted link, a full disk) included
        print(shorten(f"vpipe plot: {e}"), file=sys.stderr)
        return 2
    print(f"vpipe plot: {len(series.step)} steps, {len(series.layers)} stages, "
          f"{len(series.marks)} layer changes -> {args.output}")
    return 0
