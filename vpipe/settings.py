"""Every ``VPIPE_*`` variable, read in this one module into one value: :class:`Settings`.

vpipe reads its process's environment once: :func:`process_settings`, the first time anyone
asks (``vpipe.attach`` through :func:`vpipe.rank.environment.check_environment`, a
:class:`~vpipe.VpipeConfig` made by hand, the planner daemon's command, a rank of the
reference trainer), and the same value every time after, so a variable changed while the
process runs changes nothing and two attaches in one process see the same settings. Each
variable becomes one parsed, checked field of a frozen :class:`Settings`, which is handed
on to the parts that use it; nothing below reads the environment again, and nothing in the
library writes it. (A launcher reads the environment it builds for its children with
:meth:`Settings.read`.) A value vpipe cannot use is :class:`SettingError`: one line naming
the variable, its value and what is allowed; it is not kept, so the next ask reads again.
An unset or empty variable is its default.

What can be checked without touching the host is checked here (numbers, ranges, names,
the fault grammar); what needs the host (a directory that can be written, an address of
this host, CURVE key files that can be read) is the check at start's, in
:mod:`vpipe.rank.environment`. Torch-free, low in the map: the tensor manager and the
control plane import it.
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any

from vpipe.faults import Faults

__all__ = ["Settings", "SettingError", "process_settings", "VARIABLES", "PREFETCH_ALLOC_ENV",
           "PREFETCH_ALLOCS",
           "AUTH_VALUES", "METRIC_KINDS", "parse_metric_kinds", "MAX_SECONDS", "WILDCARDS"]

PREFETCH_ALLOC_ENV = "VPIPE_PREFETCH_ALLOC"
# where prefetched copies are allocated: the copy stream's or the compute's
PREFETCH_ALLOCS = ("copy", "compute")
AUTH_VALUES = ("auto", "required", "none")  # VPIPE_CONTROL_AUTH (vpipe.control.run_key says what each does)
METRIC_KINDS = ("tensorboard", "wandb")
MAX_SECONDS = 7 * 24 * 3600.0  # a timeout longer than a week is a mistake, not a setting
WILDCARDS = ("0.0.0.0", "::", "*")  # VPIPE_CONTROL_HOST values that bind every interface


class SettingError(ValueError):
    """A ``VPIPE_*`` variable whose value vpipe cannot use."""


def parse_metric_kinds(text: str | None) -> tuple[str, ...]:
    """``"tensorboard"``, ``"wandb"``, ``"tensorboard,wandb"`` -> the kinds; None or "" -> none."""
    if not text:
        return ()
    kinds = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [k for k in kinds if k not in METRIC_KINDS]
    if unknown or not kinds:
        raise ValueError(f"metrics must name {' and/or '.join(METRIC_KINDS)} (comma-separated), got {text!r}")
    return kinds


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_SECONDS:  # nan fails too
        raise ValueError(f"expected a number of seconds above 0 and at most {MAX_SECONDS:.0f}")
    return seconds


def _trace_steps(value: str) -> tuple[int, int]:
    parts = value.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[1]) < 1:
        raise ValueError("expected START,COUNT: the first step to record and how many (integers, COUNT >= 1)")
    return int(parts[0]), int(parts[1])


def _one_of(allowed: tuple[str, ...]) -> Callable[[str], str]:
    def parse(value: str) -> str:
        value = value.strip()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value
    return parse


def _address(value: str) -> str:
    value = value.strip()
    if value not in WILDCARDS:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError("expected an IP address of this host (or 0.0.0.0 for every interface)") from None
    return value


def _metrics(value: str) -> str:
    parse_metric_kinds(value)
    return value


def _paths(value: str) -> tuple[str, ...]:
    return tuple(p for p in value.split(os.pathsep) if p.strip())


def _variable(name: str, parse: Callable[[str], Any] = str) -> dict[str, Any]:
    return {"variable": name, "parse": parse}


@dataclass(frozen=True)
class Settings:
    """The ``VPIPE_*`` variables, parsed: one field per variable (its name in the field's metadata).

    ``Settings()`` is every default (an empty environment); :meth:`read` is what an environment sets;
    :func:`process_settings` is what this process's environment set when first asked.
    """

    # seconds the last stage waits for a silent planner daemon before it calls it lost
    planner_timeout_s: float = field(default=5.0, metadata=_variable("VPIPE_PLANNER_TIMEOUT", _seconds))
    # VpipeConfig.migration_timeout_s's default: how long a move waits for its neighbour
    migration_timeout_s: float = field(default=30.0, metadata=_variable("VPIPE_MIGRATION_TIMEOUT", _seconds))
    # VpipeConfig.agree_timeout_s's default: how long attach (and a layer edit) waits for every rank
    agree_timeout_s: float = field(default=120.0, metadata=_variable("VPIPE_AGREE_TIMEOUT", _seconds))
    # VpipeConfig.log_file's default: JSON lines of every decision
    log_file: str | None = field(default=None, metadata=_variable("VPIPE_LOG_FILE"))
    # VpipeConfig.trace_steps's default: (start, count) of the timeline window
    trace_steps: tuple[int, int] | None = field(default=None,
                                                metadata=_variable("VPIPE_TRACE_STEPS", _trace_steps))
    trace_dir: str = field(default="vpipe-trace", metadata=_variable("VPIPE_TRACE_DIR"))
    # VpipeConfig.metrics's default: "tensorboard", "wandb" or both, comma-separated
    metrics: str | None = field(default=None, metadata=_variable("VPIPE_METRICS", _metrics))
    metrics_dir: str = field(default="vpipe-metrics", metadata=_variable("VPIPE_METRICS_DIR"))
    # faults injected for reliability tests (vpipe.faults)
    faults: Faults = field(default_factory=Faults, metadata=_variable("VPIPE_FAULTS", Faults.parse))
    # where the tensor manager allocates prefetched copies: the copy stream's memory, or the compute stream's
    prefetch_alloc: str = field(default="copy", metadata=_variable(PREFETCH_ALLOC_ENV,
                                                                   _one_of(PREFETCH_ALLOCS)))
    # auto, required or none: whether an unauthenticated control plane is refused (vpipe.control.run_key)
    control_auth: str = field(default="auto", metadata=_variable("VPIPE_CONTROL_AUTH", _one_of(AUTH_VALUES)))
    # the address control sockets bind ("": loopback, or the interface routing to MASTER_ADDR)
    control_host: str = field(default="", metadata=_variable("VPIPE_CONTROL_HOST", _address))
    # CURVE key files (vpipe.control.curve): this host's secret file and the public keys admitted
    curve_secret_file: str = field(default="", metadata=_variable("VPIPE_CURVE_SECRET_FILE", str.strip))
    curve_public_keys: tuple[str, ...] = field(default=(),
                                               metadata=_variable("VPIPE_CURVE_PUBLIC_KEYS", _paths))
    # the run's one CURVE secret (Z85), as the launcher hands it to its ranks, or a file holding it
    curve_run_secret: str = field(default="", metadata=_variable("VPIPE_CURVE_RUN_SECRET", str.strip))
    curve_run_secret_file: str = field(default="", metadata=_variable("VPIPE_CURVE_RUN_SECRET_FILE",
                                                                      str.strip))

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> Settings:
        """The settings ``environ`` sets (this process's: :func:`process_settings`, read once);
        :class:`SettingError` names the first variable set to a value vpipe cannot use."""
        return cls(**{f.name: _parse(f.metadata, environ[f.metadata["variable"]]) for f in fields(cls)
                      if environ.get(f.metadata["variable"])})

    def variables(self) -> dict[str, str]:
        """Field name -> its variable's name."""
        return {f.name: f.metadata["variable"] for f in fields(self)}


VARIABLES: tuple[str, ...] = tuple(f.metadata["variable"] for f in fields(Settings))


def _parse(metadata: Mapping[str, Any], value: str) -> Any:
    name = metadata["variable"]
    try:
        return metadata["parse"](value)
    except ValueError as e:
        reason = str(e).removeprefix(f"{name}: ").removeprefix(f"{name}={value!r}: ")
        raise SettingError(f"{name}={value!r:.80}: {reason}") from None


@cache
def process_settings() -> Settings:
    """This process's settings: its environment read the first time anyone asks, the same value after (a
    :class:`SettingError` is not kept: the next ask reads again). ``process_settings.cache_clear()`` forgets
    them, which only a test that sets the environment wants."""
    return Settings.read(os.environ)
