"""The ``VPIPE_*`` environment, checked in one place where vpipe starts: at ``attach``, and by the ``vpipe``
command before any rank starts.

Each variable is read where it is used, but a bad value used to surface there, deep in a rank,
as a traceback on every rank (``VPIPE_PLANNER_TIMEOUT=abc``), or not at all (``nan``, ``inf``
and ``-1`` passed as timeouts). :func:`check_environment` parses every variable that is set,
with the same parsers the users of each one call, and range-checks it; the first bad one is
:class:`SettingError`: one line naming the variable, its value and what is allowed.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
from collections.abc import Callable, Mapping

from vpipe import faults
from vpipe.control.curve import curve_from_env
from vpipe.control.netaddr import control_host
from vpipe.control.run_key import auth_required
from vpipe.files import check_output_dir, check_output_file
from vpipe.rank.metrics import parse_metric_kinds
from vpipe.settings import PREFETCH_ALLOC_ENV, PREFETCH_ALLOCS

__all__ = ["SettingError", "check_environment", "SECONDS", "MAX_SECONDS"]

# timeouts in seconds: every one must be a finite number above 0 and below a week
SECONDS = ("VPIPE_PLANNER_TIMEOUT", "VPIPE_MIGRATION_TIMEOUT", "VPIPE_AGREE_TIMEOUT")
MAX_SECONDS = 7 * 24 * 3600.0


class SettingError(ValueError):
    """A ``VPIPE_*`` variable whose value vpipe cannot use."""


def _seconds(value: str) -> None:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_SECONDS:  # nan fails too
        raise ValueError(f"expected a number of seconds above 0 and at most {MAX_SECONDS:.0f}")


def _trace_steps(value: str) -> None:
    parts = value.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[1]) < 1:
        raise ValueError("expected START,COUNT: the first step to record and how many (integers, COUNT >= 1)")


def _one_of(allowed: tuple[str, ...]) -> Callable[[str], None]:
    def check(value: str) -> None:
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
    return check


def _local_address(value: str) -> None:
    """An address of this host (or a wildcard): binding there is what the control plane will do."""
    try:
        bind, _ = control_host(environ={"VPIPE_CONTROL_HOST": value})
    except ValueError:
        bind = ""
    if not bind:
        raise ValueError("expected an IP address of this host (or 0.0.0.0 for every interface)")
    family = socket.AF_INET6 if ipaddress.ip_address(bind).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((bind, 0))
        except OSError:
            raise ValueError("expected an IP address of this host (or 0.0.0.0 for every interface)") from None


def _checks() -> dict[str, Callable[[str], None]]:
    return {
        **{name: _seconds for name in SECONDS},
        "VPIPE_TRACE_STEPS": _trace_steps,
        "VPIPE_METRICS": lambda v: None if parse_metric_kinds(v) else None,
        "VPIPE_METRICS_DIR": lambda v: check_output_dir(v, "the metrics directory"),
        "VPIPE_TRACE_DIR": lambda v: check_output_dir(v, "the trace directory"),
        "VPIPE_LOG_FILE": lambda v: check_output_file(v, "the log file"),
        faults.ENV: lambda v: None if faults.parse(v) else None,
        PREFETCH_ALLOC_ENV: _one_of(PREFETCH_ALLOCS),
        "VPIPE_CONTROL_AUTH": lambda v: None if auth_required({"VPIPE_CONTROL_AUTH": v}) else None,
        "VPIPE_CONTROL_HOST": _local_address,
    }


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`SettingError` for the first ``VPIPE_*`` variable that is set to a value vpipe cannot use."""
    env = os.environ if environ is None else environ
    for name, check in _checks().items():
        value = env.get(name)
        if value is None or value == "":
            continue
        try:
            check(value)
        except ValueError as e:
            reason = str(e).removeprefix(f"{name}: ").removeprefix(f"{name}={value!r}: ")
            raise SettingError(f"{name}={value!r:.80}: {reason}") from None
    try:
        curve_from_env(dict(env))
    except ValueError as e:
        raise SettingError(str(e)) from None
