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
from typing import Any

from vpipe.files import make_dirs, open_append, read_regular
from vpipe.output_paths import check_output_file

DECISIONS = "vpipe.decisions"
decision_log = logging.getLogger(DECISIONS)
MAX_LOG_BYTES = 2 << 30  # what `vpipe logs` / `vpipe plot` read of a run log at most (millions of steps)
STEPS = "vpipe.steps"
step_log = logging.getLogger(STEPS)

__all__ = ["RunLog", "configure", "log_to_stderr", "decision", "step_record", "read_log", "RunLogHandler",
           "DECISIONS", "STEPS"]


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


class RunLogHandler(logging.FileHandler):
    """The run log's handler. It also takes the last stage's per-step records straight, without a logging
    record (building one cost more than the rest of vpipe's work in a small model's step), and appends them
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
                                   f"step {step} took {step_s:.4f} s")
                         for t, step, step_s, fields in self._steps]
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


_failed_files: dict[str, str] = {}  # run logs that failed a write in this process, and why (said once each)

# Python's logging is one tree per process: every handler on the "vpipe" logger gets every vpipe record,
# whichever attach made it. So the state here is keyed by its owners: one handler per (file, rank), shared by
# the RunLogs that name it (two would write each record twice) and removed when the last of them closes; step
# records go straight to each open one (what logging would do, without its cost).
_open: dict[tuple[str, int | None], tuple[RunLogHandler, list[RunLog]]] = {}
_configured: list[Any] = []  # what configure() set up: the command's own (a process runs one command)
_level_before: list[int] = []  # the "vpipe" logger's level before the first open run log set it


class RunLog:
    """One owner's run log (an attach's, a command's): vpipe's records as JSON lines in ``log_file``, until
    :meth:`close`, which removes this owner's part and nothing of another's."""

    def __init__(self, log_file: str | os.PathLike[str], rank: int | None = None,
                 level: int = logging.INFO) -> None:
        check_output_file(log_file, "log file")  # a FIFO would block the open, a directory fail it
        make_dirs(os.path.dirname(os.path.abspath(log_file)), "log file")  # 0700, through no planted link
        key = (os.path.abspath(log_file), rank)
        logger = logging.getLogger("vpipe")
        if not _open:  # the first run log open: the level it sets goes again with the last one
            _level_before[:] = [logger.level]
        if key not in _open:
            handler = RunLogHandler(log_file, rank)
            _open[key] = (handler, [])
            logger.addHandler(handler)
        logger.setLevel(level)
        self.handler, owners = _open[key]
        owners.append(self)
        self._key: tuple[str, int | None] | None = key

    def close(self) -> None:
        """Stop logging to the file for this owner (the file's handler goes when its last owner closes, and
        with the last run log the logger's level before the first)."""
        key, self._key = self._key, None
        if key is None or key not in _open:
            return
        handler, owners = _open[key]
        owners.remove(self)
        if not owners:
            del _open[key]
            logging.getLogger("vpipe").removeHandler(handler)
            handler.close()
            if not _open and _level_before:
                logging.getLogger("vpipe").setLevel(_level_before.pop())


def configure(log_file: str | os.PathLike[str] | None, rank: int | None = None,
              level: int = logging.INFO) -> None:
    """The command's logging: vpipe's loggers (decisions included) to ``log_file`` as
    JSON lines, in place of what the command configured before (None: nowhere). An
    attach's own run log (:class:`RunLog`) is left alone."""
    _unconfigure()
    logging.getLogger("vpipe").setLevel(level)
    if log_file is not None:
        _configured.append(RunLog(log_file, rank, level))


def log_to_stderr(prefix: str) -> None:
    """The command's logging to stderr, each line after ``prefix`` (in place of what it configured before)."""
    _unconfigure()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prefix}%(message)s"))
    logging.getLogger("vpipe").addHandler(handler)
    logging.getLogger("vpipe").setLevel(logging.INFO)
    _configured.append(handler)


def _unconfigure() -> None:
    while _configured:
        done = _configured.pop()
        if isinstance(done, RunLog):
            done.close()
        else:
            logging.getLogger("vpipe").removeHandler(done)
            done.close()


def decision(event: str, message: str = "", **fields: Any) -> None:
    """Log one decision (``imbalance``, ``plan``, ``migration_start`` ...) with its numbers."""
    decision_log.info(message or event, extra={"vpipe_fields": {"event": event, **fields}})


def step_record(step: int, step_s: float, **fields: Any) -> None:
    """Log one finished training step (the last stage logs them: its pace is the pipeline's)."""
    if not step_log.isEnabledFor(logging.INFO):
        return
    if _open:  # straight to the run logs
        for handler, _ in list(_open.values()):
            handler.add_step(step, step_s, fields)
    else:
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
