"""The ``VPIPE_*`` environment checked where vpipe starts: at ``attach`` (the process's settings, read once:
:func:`~vpipe.settings.process_settings`), and by the launcher (the environment it builds for its ranks)
before any rank starts.

A bad value used to surface deep in a rank, as a traceback on every rank
(``VPIPE_PLANNER_TIMEOUT=abc``), or not at all (``nan``, ``inf`` and ``-1`` passed as
timeouts). :func:`check_environment` takes every variable as one
:class:`~vpipe.settings.Settings` (which parses and range-checks each), then checks what
needs this host: the output directories and log file can be written, the control host is
an address here, the CURVE key files can be read. The first bad one is
:class:`SettingError`: one line naming the variable, its value and what is allowed. The
settings it returns are what the caller hands on; nothing reads the environment again.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping

from vpipe.control.curve import RunKeys
from vpipe.output_paths import check_output_dir, check_output_file
from vpipe.settings import MAX_SECONDS, WILDCARDS, SettingError, Settings, process_settings

__all__ = ["SettingError", "check_environment", "check_settings", "SECONDS", "MAX_SECONDS"]

# timeouts in seconds: every one must be a finite number above 0 and below a week
SECONDS = ("VPIPE_PLANNER_TIMEOUT", "VPIPE_MIGRATION_TIMEOUT", "VPIPE_AGREE_TIMEOUT")

_FIELDS = {variable: name for name, variable in Settings().variables().items()}
_NOT_HERE = "expected an IP address of this host (or 0.0.0.0 for every interface)"


def _local_address(value: str) -> None:
    """An address of this host (or a wildcard): binding there is what the control plane will do."""
    if value in WILDCARDS:
        return
    family = socket.AF_INET6 if ipaddress.ip_address(value).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((value, 0))
        except OSError:
            raise ValueError(_NOT_HERE) from None


def _checks(settings: Settings) -> list[tuple[str, str | None, Callable[[str], object]]]:
    """(variable, its value when set, what checks it on this host)."""
    return [
        ("VPIPE_METRICS_DIR", settings.metrics_dir, lambda v: check_output_dir(v, "the metrics directory")),
        ("VPIPE_TRACE_DIR", settings.trace_dir, lambda v: check_output_dir(v, "the trace directory")),
        ("VPIPE_LOG_FILE", settings.log_file, lambda v: check_output_file(v, "the log file")),
        ("VPIPE_CONTROL_HOST", settings.control_host, _local_address),
    ]


def check_settings(settings: Settings) -> Settings:
    """Raise :class:`SettingError` for the first setting (one its variable set) that this host cannot use;
    returns ``settings``."""
    defaults = Settings()
    for name, value, check in _checks(settings):
        if not value or value == getattr(defaults, _FIELDS[name]):
            # unset: nothing to check yet (what attach makes of the default is checked where it is made)
            continue
        try:
            check(value)
        except ValueError as e:
            reason = str(e).removeprefix(f"{name}: ").removeprefix(f"{name}={value!r}: ")
            raise SettingError(f"{name}={value!r:.80}: {reason}") from None
    try:
        RunKeys(settings).curve()  # the key files exist, are private and hold keys
    except ValueError as e:
        raise SettingError(str(e)) from None
    return settings


def check_environment(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings ``environ`` sets (default: this process's, read once), every one checked
    (again, at each call: an output directory may have gone since); :class:`SettingError`
    for the first variable set to a value vpipe cannot use."""
    return check_settings(process_settings() if environ is None else Settings.read(environ))
