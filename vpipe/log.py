"""Run logs: one JSON object per line, decisions included, shared by all ranks of a run.

Every rank appends to the same file (``O_APPEND`` writes of whole lines do not interleave
on a local file system), opened without following a link another user could have planted
(:func:`vpipe.files.open_append`). A record has ``t`` (unix time), ``rank``, ``logger``, ``level``
and ``msg``; decisions (logger ``vpipe.decisions``) also carry ``event`` and the numbers
that justify them, which is what ``vpipe logs`` and ``vpipe plot`` read back.

The last stage's per-step records (logger ``vpipe.steps``) go to a configured run log
without :mod:`logging`'s machinery, a few at a time in one append: a logging record cost
more than the rest of vpipe's work in a small model's step (:class:`RunLogHandler`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from vpipe.files import check_output_file, open_append, read_regular

DECISIONS = "vpipe.decisions"
decision_log = logging.getLogger(DECISIONS)
MAX_LOG_BYTES = 2 << 30  # what `vpipe logs` / `vpipe plot` read of a run log at most (millions of steps)
STEPS = "vpipe.steps"
step_log = logging.getLogger(STEPS)

__all__ = ["configure", "decision", "step_record", "read_log", "RunLogHandler", "StderrHandler", "DECISIONS", "STEPS"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class JsonLineFormatter(logging.Formatter):
    def __init__(self, rank: int | None) -> None:
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        exc = self.formatException(record.exc_info) if record.exc_info else None
        return json_line(record.created, self.rank, record.name, record.levelname,
                         getattr(record, "vpipe_fields", None), record.getMessage(), exc)


def json_line(t: float, rank: int | None, logger: str, level: str, fields: dict[str, Any] | None, msg: str,
              exc: str | None = None) -> str:
    """One record of the run log: its common keys, the record's numbers, its message."""
    entry: dict[str, Any] = {"t": round(t, 6), "rank": rank, "logger": logger, "level": level}
    if fields:
        entry.update(_jsonable(fields))
    entry["msg"] = msg
    if exc is not None:
        entry["exc"] = exc
    return json.dumps(entry, separators=(",", ":"))


class StderrHandler(logging.StreamHandler):
    """vpipe's own handler to standard error (the planner daemon's without a log file): like a run log, the next
    :func:`configure` replaces it."""


class RunLogHandler(logging.FileHandler):
    """The run log's handler. It also takes the last stage's per-step records straight, without a logging record
    (building one cost more than the rest of vpipe's work in a small model's step), and appends them
    :attr:`STEP_BATCH` at a time, or sooner when it flushes: after any other record, at close and at exit."""

    STEP_BATCH = 16

    def __init__(self, log_file: str | os.PathLike[str], rank: int | None) -> None:
        super().__init__(log_file, mode="a", encoding="utf-8")
        self.setFormatter(JsonLineFormatter(rank))
        self.rank = rank
        self._steps: list[tuple[float, int, float, dict[str, Any]]] = []
        # why the log stopped taking records (a full disk ...): reported once per file and process
        self.failed: str | None = _failed_files.get(self.baseFilename)

    def _open(self) -> Any:
        """The log opened for appending, never through another user's link (FileCheckError names it)."""
        fd = open_append(self.baseFilename, "log file")
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)

    def add_step(self, step: int, step_s: float, fields: dict[str, Any]) -> None:
        # formatted when the batch is written: one step's turn only appends (its code runs cold between steps)
        if self.failed is not None:
            return
        self._steps.append((time.time(), step, step_s, fields))
        if len(self._steps) >= self.STEP_BATCH:
            self.flush()

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed is None:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        """A write that failed (full disk, I/O error) ends the log, never the run: one line says so."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            self._give_up(error)
        else:
            super().handleError(record)

    def flush(self) -> None:
        self.acquire()
        try:
            if self.failed is not None:
                self._steps.clear()
                return
            super().flush()
            stream = self.stream
            if self._steps and stream is not None and not stream.closed:
                lines = [json_line(t, self.rank, STEPS, "INFO", {"step": step, "step_s": step_s, **fields},
                                   f"step {step} took {step_s:.4f} s") for t, step, step_s, fields in self._steps]
                data = ("\n".join(lines) + "\n").encode("utf-8")
                os.write(stream.fileno(), data)  # one append: whole lines, never split between two writes
            self._steps.clear()
        except OSError as e:
            self._give_up(e)
        finally:
            self.release()

    def close(self) -> None:
        try:
            super().close()
        except OSError as e:  # the last flush
            self._give_up(e)

    def _give_up(self, error: OSError) -> None:
        self._steps.clear()
        if self.failed is not None:
            return
        self.failed = _failed_files[self.baseFilename] = error.strerror or str(error)
        who = "" if self.rank is None else f" [rank {self.rank}]"
        try:
            sys.stderr.write(f"vpipe{who}: cannot write the run log {self.baseFilename} ({self.failed}); "
                             "training goes on, and its further log records are dropped\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


_run_log: RunLogHandler | None = None
_failed_files: dict[str, str] = {}  # run logs that failed a write in this process, and why


def configure(log_file: str | os.PathLike[str] | None, rank: int | None = None, level: int = logging.INFO) -> None:
    """Send vpipe's loggers (decisions included) to ``log_file`` as JSON lines."""
    global _run_log
    root = logging.getLogger("vpipe")
    root.setLevel(level)
    _run_log = None
    for handler in list(root.handlers):
        if isinstance(handler, (RunLogHandler, StderrHandler)):  # vpipe's own: replaced
            root.removeHandler(handler)
            handler.close()
    if log_file is None:
        return
    check_output_file(log_file, "log file")  # a FIFO would block the open, a directory fail it
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    handler = RunLogHandler(log_file, rank)
    root.addHandler(handler)
    if step_log.isEnabledFor(logging.INFO):
        _run_log = handler


def decision(event: str, message: str = "", **fields: Any) -> None:
    """Log one decision (``imbalance``, ``plan``, ``migration_start`` ...) with its numbers."""
    decision_log.info(message or event, extra={"vpipe_fields": {"event": event, **fields}})


def step_record(step: int, step_s: float, **fields: Any) -> None:
    """Log one finished training step (the last stage logs them: its pace is the pipeline's)."""
    if _run_log is not None:  # straight to the run log
        _run_log.add_step(step, step_s, fields)
    elif step_log.isEnabledFor(logging.INFO):
        step_log.info("step %d took %.4f s", step, step_s,
                      extra={"vpipe_fields": {"step": step, "step_s": step_s, **fields}})


def read_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a run log, oldest first; lines that are not JSON objects are skipped."""
    records = []
    lines = read_regular(path, MAX_LOG_BYTES, "log file").decode("utf-8", errors="replace").splitlines()
    for line in lines:
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # not a record, or nested beyond any record
            continue
        if isinstance(entry, dict):
            records.append(entry)
    records.sort(key=lambda r: r.get("t", 0) if isinstance(r.get("t"), (int, float)) else 0)
    return records
