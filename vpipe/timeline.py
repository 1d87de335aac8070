"""The pipeline timeline: what every stage did in a window of steps, merged into one Chrome trace.

**Recording.** ``vpipe.attach(..., trace_steps=(start, count))`` (or the environment's
``VPIPE_TRACE_STEPS=start,count``) records on every rank steps ``start`` to ``start + count -
1``: each stage's forward and backward of every micro-batch, the schedule's waits for sends
and receives, swap-outs and prefetches, recomputes, and plan applications (moves). At the
window's end each rank writes ``timeline-rank{r}.json`` into ``trace_dir`` (a new file renamed
into place, so a link planted there is never followed; a write that fails is said once on
stderr and training goes on without it). Outside the window nothing is recorded: every
producer asks :func:`span`, which hands back one shared do-nothing context. Each window is its
owner's :class:`Recorder` (an attach's): a second attach, or a detach, in the same process
starts and stops only its own.

**torch.profiler.** The same spans open ``record_function`` ranges named ``vpipe.*`` while
torch's profiler runs, window or not, so vpipe's work shows under its own names in a user's
trace; with the profiler off that costs one check. This module never imports torch: it uses
the torch a producer already loaded.

**Merging.** ``vpipe trace RUN_DIR -o trace.json`` reads every rank's file and writes one
Chrome trace (Perfetto, chrome://tracing): a process per rank, a track per stage, the rank's
communication and plan applications on a track of their own. Times are the ranks' wall
clocks, relative to the first event: one clock on one host, as close as the hosts' clocks
across several. It prints each stage's fractions of the window: *busy* (forward and
backward), *bubble* (the rest) and *waiting* (the part of the bubble its rank spent blocked
in a send or receive wait).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import stat
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from vpipe.files import make_dirs, output_file, write_atomic, write_output
from vpipe.output_paths import check_output_file

__all__ = ["span", "active", "start", "stop", "recording", "Recorder", "set_track", "RANK_TRACK", "merge",
           "stage_fractions", "load_rank_file", "load_run", "draw", "register", "FILE_PATTERN"]

FORMAT = "vpipe-timeline"
VERSION = 1
FILE_PATTERN = "timeline-rank{rank}.json"
RANK_TRACK = -1  # a rank's own track: its send/receive waits and plan applications
COMPUTE, COMM, MEMORY, PLAN = "compute", "comm", "memory", "plan"
MAX_FILE_BYTES = 256 << 20  # a rank's file; a window of a few steps is kilobytes to a few MiB
MAX_EVENTS = 2_000_000  # per rank and window: a window too long for memory stops recording, said in the file


class Recorder:
    """One rank's events of one window, written as one JSON file when it ends."""

    def __init__(self, rank: int, path: Path, stages: list[int]) -> None:
        self.rank = rank
        self.path = path
        self.stages = stages
        self.events: list[tuple[str, str, int, int, int, dict[str, Any]]] = []
        self.dropped = 0

    def add(self, name: str, cat: str, track: int, start_ns: int, end_ns: int, args: dict[str, Any]) -> None:
        if len(self.events) >= MAX_EVENTS:
            self.dropped += 1
            return
        self.events.append((name, cat, track, start_ns, end_ns, args))

    def write(self) -> Path:
        body = {"format": FORMAT, "version": VERSION, "rank": self.rank, "stages": self.stages,
                "dropped": self.dropped,
                "events": [{"name": n, "cat": c, "track": t, "start_ns": s, "end_ns": e, "args": a}
                           for n, c, t, s, e, a in self.events]}
        try:
            make_dirs(self.path.parent, "trace_dir")  # 0700, never through a link another user planted
            _replace_file(self.path, json.dumps(body))
        except OSError as e:  # the trace is for the user: said once here, and training goes on without it
            _say(f"vpipe [rank {self.rank}]: cannot write the timeline {self.path} "
                 f"({e.strerror or e}); training goes on without it")
            raise
        return self.path


def _replace_file(path: Path, text: str) -> None:
    """``text`` as the whole of ``path``, never written through a
    link planted there (:func:`write_atomic`)."""
    write_atomic(path, text.encode("utf-8"))


def _say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


# The windows open in this process, each its owner's (an attach's TraceWindow): a producer (the tensor
# manager, a schedule) does not know its attach, so what it reports goes to every open window; each owner
# starts and stops its own, and stopping one leaves the others recording.
_recorders: list[Recorder] = []
_track = 0  # the stage whose forward or backward runs now (one at a time per rank): where memory work goes


def start(rank: int, directory: str | Path, stages: Iterable[int]) -> Recorder:
    """Begin recording a window of this rank (its file: ``directory/timeline-rank{rank}.json``); the
    recorder is the caller's, to :func:`stop`."""
    recorder = Recorder(rank, Path(directory) / FILE_PATTERN.format(rank=rank), sorted(stages))
    _recorders.append(recorder)
    return recorder


def stop(recorder: Recorder | None = None) -> Path | None:
    """End ``recorder``'s window (default: the one opened last) and write its
    file; returns the file (None when it was not recording)."""
    if recorder is None:
        recorder = _recorders[-1] if _recorders else None
    if recorder is None or recorder not in _recorders:
        return None
    _recorders.remove(recorder)
    return recorder.write()


def recording(recorder: Recorder | None = None) -> bool:
    """Whether ``recorder`` (default: any window of this process) records."""
    return recorder in _recorders if recorder is not None else bool(_recorders)


def set_track(track: int) -> None:
    """The stage running now: spans that name no track (the tensor manager's) go on its track."""
    global _track
    _track = track


_profiler_enabled: Any = None  # torch's profiler flag (vpipe.compat), once a producer has loaded torch


def _profiling() -> bool:
    global _profiler_enabled
    if _profiler_enabled is None:
        if "torch" not in sys.modules:
            return False
        from vpipe.compat.torch_internals import profiler_enabled
        _profiler_enabled = profiler_enabled
    return bool(_profiler_enabled())


class _Span:
    __slots__ = ("name", "cat", "track", "args", "t0", "range")

    def __init__(self, name: str, cat: str, track: int | None, args: dict[str, Any]) -> None:
        self.name, self.cat, self.track, self.args = name, cat, track, args
        self.t0 = 0
        self.range: Any = None

    def __enter__(self) -> _Span:
        if _profiling():
            self.range = sys.modules["torch"].profiler.record_function(self.name)
            self.range.__enter__()
        self.t0 = time.time_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        end = time.time_ns()
        for recorder in _recorders:
            recorder.add(self.name, self.cat, _track if self.track is None else self.track, self.t0, end,
                         self.args)
        if self.range is not None:
            self.range.__exit__(None, None, None)


_NOTHING = contextlib.nullcontext()


def active() -> bool:
    """Whether a span now would do anything (a window records, or torch's profiler runs)."""
    return bool(_recorders) or _profiling()


def span(name: str, cat: str, track: int | None = None,
         **args: Any) -> contextlib.AbstractContextManager[Any]:
    """A context around one piece of vpipe's or the stage's work: recorded inside the window, a profiler range
    while torch's profiler runs, nothing otherwise. ``track``: the stage (None: the one running now) or
    :data:`RANK_TRACK`."""
    if not _recorders and not _profiling():
        return _NOTHING
    return _Span(name, cat, track, args)


# ====================================================================== reading and merging
@dataclass(frozen=True)
class RankTimeline:
    rank: int
    stages: list[int]
    events: list[dict[str, Any]]
    dropped: int


def load_rank_file(path: Path) -> RankTimeline:
    """One rank's file, checked: a regular file of bounded size holding this module's format."""
    try:
        info = path.stat()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file")
    if info.st_size > MAX_FILE_BYTES:
        raise ValueError(
            f"{path} is {info.st_size} bytes, more than a timeline file holds ({MAX_FILE_BYTES})"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a vpipe timeline file ({e})") from None
    except RecursionError:
        raise ValueError(f"{path} is not a vpipe timeline file (its JSON nests too deeply)") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ValueError(f"{path} is not a vpipe timeline file (format {FORMAT} version {VERSION})")
    rank, stages, events = data.get("rank"), data.get("stages"), data.get("events")
    if not isinstance(rank, int) or not isinstance(stages, list) or not all(isinstance(s, int)
                                                                            for s in stages) \
            or not isinstance(events, list):
        raise ValueError(f"{path}: rank, stages or events missing or of the wrong type")
    for i, ev in enumerate(events):
        if not (isinstance(ev, dict) and isinstance(ev.get("name"), str) and isinstance(ev.get("cat"), str)
                and isinstance(ev.get("track"), int) and isinstance(ev.get("start_ns"), int)
                and isinstance(ev.get("end_ns"), int) and ev["end_ns"] >= ev["start_ns"]
                and isinstance(ev.get("args"), dict)):
            raise ValueError(f"{path}: event {i} is malformed")
    return RankTimeline(rank, stages, events, int(data.get("dropped", 0)))


def load_run(directory: Path) -> list[RankTimeline]:
    """Every rank's file of a run directory, by rank."""
    try:
        is_dir = stat.S_ISDIR(directory.stat().st_mode)
    except OSError:  # missing, or a name too long to be one
        is_dir = False
    if not is_dir:
        raise ValueError(f"{directory} is not a directory (give the trace_dir of a run)")
    files = sorted(directory.glob(FILE_PATTERN.format(rank="*")))
    if not files:
        raise ValueError(f"no {FILE_PATTERN.format(rank='N')} files in {directory}: did the "
                         "run set trace_steps?")
    ranks = [load_rank_file(f) for f in files]
    seen = [r.rank for r in ranks]
    if len(set(seen)) != len(seen):
        raise ValueError(f"{directory}: two files claim the same rank ({sorted(seen)})")
    return sorted(ranks, key=lambda r: r.rank)


def merge(ranks: list[RankTimeline]) -> dict[str, Any]:
    """One Chrome trace: a process per rank, a track (thread) per stage and one for the rank's own events."""
    starts = [ev["start_ns"] for r in ranks for ev in r.events]
    origin = min(starts) if starts else 0
    events: list[dict[str, Any]] = []
    for r in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r.rank, "args": {"name": f"rank {r.rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r.rank,
                       "args": {"sort_index": r.rank}})
        for stage in r.stages:
            events.append({"name": "thread_name", "ph": "M", "pid": r.rank, "tid": stage,
                           "args": {"name": f"stage {stage}"}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": r.rank, "tid": stage,
                           "args": {"sort_index": stage}})
        events.append({"name": "thread_name", "ph": "M", "pid": r.rank, "tid": RANK_TRACK,
                       "args": {"name": f"rank {r.rank}: send/recv waits, plans"}})
        for ev in r.events:
            events.append({"name": ev["name"], "cat": ev["cat"], "ph": "X", "pid": r.rank, "tid": ev["track"],
                           "ts": (ev["start_ns"] - origin) / 1e3,
                           "dur": (ev["end_ns"] - ev["start_ns"]) / 1e3,
                           "args": ev["args"]})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _union_ns(spans: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


@dataclass(frozen=True)
class StageFractions:
    stage: int
    rank: int
    busy: float
    bubble: float
    waiting: float


def stage_fractions(ranks: list[RankTimeline]) -> list[StageFractions]:
    """Per stage, its share of the window (first event to last, all
    ranks) busy, in the bubble, and waiting."""
    bounds = [(ev["start_ns"], ev["end_ns"]) for r in ranks for ev in r.events]
    if not bounds:
        return []
    window = max(e for _, e in bounds) - min(s for s, _ in bounds)
    out = []
    for r in ranks:
        waits = [(ev["start_ns"], ev["end_ns"]) for ev in r.events if ev["cat"] == COMM]
        waiting = _union_ns(waits) / window if window else 0.0
        for stage in r.stages:
            work = [(ev["start_ns"], ev["end_ns"]) for ev in r.events if ev["cat"] == COMPUTE
                    and ev["track"] == stage]
            busy = _union_ns(work) / window if window else 0.0
            out.append(StageFractions(stage, r.rank, busy, 1.0 - busy, min(waiting, 1.0 - busy)))
    return sorted(out, key=lambda f: f.stage)


_COLOURS = {"vpipe.forward": "#4c72b0", "vpipe.backward": "#dd8452", "vpipe.p2p_wait": "#bbbbbb",
            "vpipe.recompute": "#c44e52", "vpipe.swap_out": "#55a868", "vpipe.prefetch": "#8172b3",
            "vpipe.swap_in_now": "#937860", "vpipe.apply_plan": "#000000"}


def draw(ranks: list[RankTimeline], path: Path | BinaryIO) -> None:
    """The merged timeline as a picture: a row per stage (its forwards, backwards
    and memory work) and per rank (its waits and plan applications), milliseconds
    from the first event. Needs matplotlib (the plot extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--png needs matplotlib: pip install 'vpipe[plot]'") from None
    starts = [ev["start_ns"] for r in ranks for ev in r.events]
    origin = min(starts) if starts else 0
    rows: list[tuple[str, list[dict[str, Any]]]] = []
    for r in ranks:
        for stage in r.stages:
            rows.append((f"stage {stage}", [ev for ev in r.events if ev["track"] == stage]))
        rows.append((f"rank {r.rank} waits", [ev for ev in r.events if ev["track"] == RANK_TRACK]))
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.2))
    for y, (_, events) in enumerate(reversed(rows)):
        for ev in sorted(events, key=lambda e: e["cat"] == MEMORY):  # memory work on top of its compute span
            thin = ev["cat"] == MEMORY
            ax.broken_barh([((ev["start_ns"] - origin) / 1e6, (ev["end_ns"] - ev["start_ns"]) / 1e6)],
                           (y - (0.15 if thin else 0.35), 0.3 if thin else 0.7),
                           facecolors=_COLOURS.get(ev["name"], "#999999"), edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [name for name, _ in reversed(rows)])
    ax.set_xlabel("ms from the window's first event")
    seen = sorted({ev["name"] for r in ranks for ev in r.events})
    ax.legend(handles=[matplotlib.patches.Patch(color=_COLOURS.get(n, "#999999"), label=n[len("vpipe."):])
                       for n in seen], loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(seen),
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


# ====================================================================== vpipe trace
def cmd_trace(args: argparse.Namespace, argv: object = None) -> int:
    ranks = load_run(Path(args.run_dir))
    out = Path(args.output)
    if out.exists() and not out.is_file():
        raise ValueError(f"-o {out}: not a file")
    png = Path(args.png) if args.png else None
    if png is not None and not png.resolve().parent.is_dir():
        raise ValueError(f"--png {png}: {png.resolve().parent} is not a directory")
    if png is not None and png.is_dir():
        raise ValueError(f"--png {png}: a directory, not a file to write")
    for path, what in ((out, "-o"), *(((png, "--png"),) if png is not None else ())):
        check_output_file(path, what)  # a link planted there: refused before anything is written
    trace = merge(ranks)
    # a planted link refused, one of this user's replaced
    write_output(out, json.dumps(trace).encode("utf-8"), "-o")
    if png is not None:
        with output_file(png, "--png") as picture:
            draw(ranks, picture)
        print(f"wrote {png}")
    events = sum(len(r.events) for r in ranks)
    print(f"wrote {out}: {events} events of {len(ranks)} ranks (open it in Perfetto or chrome://tracing)")
    print("stage  rank   busy  bubble  (waiting)")
    for f in stage_fractions(ranks):
        print(f"{f.stage:5d}  {f.rank:4d}  {f.busy:5.0%}  {f.bubble:6.0%}  ({f.waiting:.0%})")
    for r in ranks:
        if r.dropped:
            print(f"rank {r.rank}: {r.dropped} events not recorded (the window held more than {MAX_EVENTS})")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("trace",
                       help="merge a run's per-rank timelines into one Chrome trace; print each stage's "
                                     "busy, bubble and waiting fractions")
    p.add_argument("run_dir", help="the run's trace_dir (holding timeline-rank*.json)")
    p.add_argument("-o", "--output", default="trace.json",
                   help="the Chrome trace to write (default trace.json)")
    p.add_argument("--png", default=None, help="also draw the timeline as a picture here (needs matplotlib)")
    p.set_defaults(func=cmd_trace)
