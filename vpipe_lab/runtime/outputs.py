"""What a run writes besides checkpoints and results: checked before any rank starts, and one run's alone.

vpipe's own outputs on the ranks (the timeline of ``VPIPE_TRACE_STEPS`` in ``VPIPE_TRACE_DIR``,
the metrics of ``VPIPE_METRICS`` in ``VPIPE_METRICS_DIR``) are set in the environment the ranks
inherit; a directory there that is a file, or cannot be written, ends the command with one line
and exit code 2, where each rank used to fail at attach (metrics) or lose its trace in silence.

Two runs given the same ``--out-dir``, ``--log-file`` or trace directory used to replace each
other's results and timelines and interleave their logs in silence. So a run holds them as it
holds its ``--checkpoint-dir``: an exclusive ``flock`` on ``DIR/.vpipe-lock`` (opened without
following a link, recording the holder's pid), or on the log file itself, tried by the launcher
(``vpipe train`` and ``vpipe nas``) and held by rank 0 for the whole run; a second run is
refused in one line, exit 2. Torch-free: the command line imports it.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from vpipe.files import FileCheckError, make_dirs, open_append, open_lock
from vpipe.output_paths import check_output_dir, check_output_file
from vpipe.settings import Settings, process_settings
from vpipe_lab.runtime.config import RunConfig

__all__ = ["check_vpipe_outputs", "run_log_file", "claim_outputs", "lock_directory", "keep",
           "OutputInUseError",
           "LOCK_NAME"]

LOCK_NAME = ".vpipe-lock"
# (device, inode) of a lock this process holds -> its descriptor, to the end
_held: dict[tuple[int, int], int] = {}


class OutputInUseError(ValueError):
    """An output another run is writing now, or one whose lock cannot be taken safely: one line naming it."""


def run_log_file(flag: str | None, settings: Settings | None = None) -> str | None:
    """The run log a run writes: ``--log-file``, else ``VPIPE_LOG_FILE`` (which the launcher checked, and
    nothing wrote to before). ``settings``: this process's (read once) unless given."""
    if flag is not None:
        return flag
    value = (process_settings() if settings is None else settings).log_file
    if value:
        check_output_file(value, "VPIPE_LOG_FILE")  # named as the user set it
    return value


def check_vpipe_outputs(vpipe: bool, settings: Settings | None = None) -> None:
    """FileCheckError (a ValueError: one line) for a trace or metrics directory vpipe will write on the ranks
    that is not a writable directory (or one that can be made). Nothing to check when the run has no vpipe."""
    if not vpipe:
        return
    settings = process_settings() if settings is None else settings
    if settings.trace_steps is not None:
        check_output_dir(settings.trace_dir, "VPIPE_TRACE_DIR")
    if settings.metrics:
        check_output_dir(settings.metrics_dir, "VPIPE_METRICS_DIR")


def claim_outputs(cfg: RunConfig, *, hold: bool, settings: Settings | None = None) -> None:
    """OutputInUseError when another run holds ``cfg``'s ``--out-dir``, ``--log-file``
    or (with ``--vpipe`` and ``VPIPE_TRACE_STEPS``) trace directory. The launcher
    looks (``hold=False``); rank 0 keeps them for the run."""
    if cfg.out_dir:
        keep(lock_directory(Path(cfg.out_dir), "--out-dir"), hold)
    settings = process_settings() if settings is None else settings
    if cfg.vpipe and settings.trace_steps is not None:
        keep(lock_directory(Path(settings.trace_dir), "VPIPE_TRACE_DIR"), hold)
    if cfg.log_file:
        keep(_lock_log(cfg.log_file), hold, pid=False)


def lock_directory(root: Path, what: str, error: type[ValueError] = OutputInUseError) -> int:
    """A descriptor of ``root/.vpipe-lock``, locked by this process (which may hold it already, through
    another descriptor: one directory given twice); ``root`` is made ``0700`` if missing. :func:`keep`
    holds or releases it. ``error`` (one line naming ``what``) when another run holds it, a link was
    planted where it goes, or ``root`` cannot be written."""
    try:
        make_dirs(root, what)  # never through a link another user planted
    except FileCheckError as e:
        raise error(str(e)) from None
    except OSError as e:
        raise error(f"{what} {root} is not writable: {e.strerror or e}") from None
    try:
        fd = open_lock(root / LOCK_NAME)
    except FileCheckError as e:  # a link (or a hard link) planted where the lock goes
        raise error(f"{what} {root}: its {e}: remove it, or give this run a directory of its own") from None
    except OSError as e:
        raise error(f"{what} {root} is not writable: {e.strerror or e}") from None
    if not _lock(fd):
        owner = os.read(fd, 64).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise error(f"{what} {root} is in use by another run (pid {owner}); give each run a "
                    "directory of its own")
    return fd


def _lock_log(log_file: str) -> int | None:
    """The run log locked by this process itself (a device, ``/dev/null``, is everyone's: not locked)."""
    make_dirs(os.path.dirname(os.path.abspath(log_file)), "--log-file")  # as the run log will
    fd = open_append(log_file, "--log-file")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    if not _lock(fd):
        os.close(fd)
        raise OutputInUseError(f"--log-file {log_file} is being written by another run; give "
                               "each run a log file of its own")
    return fd


def _lock(fd: int) -> bool:
    """Whether this process holds (or now took) the exclusive lock of ``fd``'s file."""
    info = os.fstat(fd)
    if (info.st_dev, info.st_ino) in _held:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def keep(fd: int | None, hold: bool, *, pid: bool = True) -> None:
    """Hold the lock of ``fd`` until this process ends (``pid``: its pid written in the lock file, for the
    message another run gets), or let it go (the launcher's look)."""
    if fd is None:
        return
    info = os.fstat(fd)
    key = (info.st_dev, info.st_ino)
    if not hold or key in _held:  # a look, or a lock this process held already (flock stays with the first)
        os.close(fd)
        return
    if pid:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    _held[key] = fd
