"""The run's control-plane key when neither the launcher nor the user gave one (``torchrun``).

The rendezvous store is no place for a secret: torchrun's store listens on every interface
and answers anyone who connects. So the key never goes through it. On one host, stage 0
makes the key and writes it to a file only its user can read (mode 0600 in a fresh 0700
directory under the temporary directory); the store carries the file's path alone. Every
other rank checks the directory and the file belong to its own user and are private before
it reads the key, reports that it has it, and stage 0 deletes the file once all have: it
exists only while ``attach`` agrees on the key. A reader of the store learns a path that it
cannot open (another user) or that no longer exists.

Across hosts (torchrun's ``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``) no file is shared, so
the user gives the key: ``VPIPE_CURVE_RUN_SECRET_FILE`` (one secret, e.g. a ``vpipe keys``
secret file copied to every host) or the key files of ``VPIPE_CURVE_SECRET_FILE`` and
``VPIPE_CURVE_PUBLIC_KEYS``. Without them the control plane runs unauthenticated, with a
warning on every rank; ``VPIPE_CONTROL_AUTH=required`` makes that an error instead.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Mapping
from typing import Any

import zmq

from vpipe.control.curve import (
    RUN_SECRET_FILE_ENV,
    RunKeys,
    new_run_secret,
    private_key_file,
    remove_private_key_file,
)
from vpipe.control.keys import KeyFileError, check_z85_key
from vpipe.files import FileCheckError, open_regular
from vpipe.settings import AUTH_VALUES

log = logging.getLogger("vpipe.control")

__all__ = ["AUTH_ENV", "AUTH_VALUES", "agree_run_key", "read_private_key", "several_hosts"]

AUTH_ENV = "VPIPE_CONTROL_AUTH"
FILE_KEY = "ctl/run-key-file"  # the path of stage 0's private key file (never the key)
READ_KEY = "ctl/run-key-read/{}"  # "ok", or why a rank could not read it
GONE_KEY = "ctl/run-key-gone"  # stage 0 deleted the file
_KEY_FILE_LIMIT = 4096


def several_hosts(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun says this run spans hosts (fewer local ranks than ranks: torchrun's variables, which
    the process's torch.distributed reads too)."""
    env = os.environ if environ is None else environ
    try:
        return int(env["LOCAL_WORLD_SIZE"]) < int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        return False


def agree_run_key(store: Any, *, rank: int, world_size: int, timeout_s: float, who: str,
                  keys: RunKeys | None = None) -> str:
    """Give this rank the run's key (collective): ``keys``, the attach's, holds it from then on (without
    ``keys``: the keys of this process's settings, which only a test wants). Returns how it was keyed:
    ``configured`` (by the launcher or the user), ``private-file``, or ``unauthenticated``.

    ``VPIPE_CONTROL_AUTH`` (``keys.settings.control_auth``): ``auto`` (default) keys every run it
    can and refuses a run of several hosts without a key; ``required`` refuses any
    unauthenticated control plane; ``none`` lets one run unauthenticated (several hosts without
    keys, on a network the user trusts), with a warning."""
    keys = keys if keys is not None else RunKeys.of_process()
    mode = keys.settings.control_auth
    if keys.by_files or keys.given:
        return "configured"
    hosts = several_hosts()
    why = ("this libzmq was built without CURVE" if not zmq.has("curve") else
           "the run spans several hosts and no key was given" if hosts else None)
    if why is not None:
        hint = (f"give every rank one key ({RUN_SECRET_FILE_ENV}=a `vpipe keys` secret file) or key files "
                f"(VPIPE_CURVE_SECRET_FILE and VPIPE_CURVE_PUBLIC_KEYS)")
        if mode == "required" or (hosts and mode == "auto"):
            allow = "" if mode == "required" else f", or set {AUTH_ENV}=none to run it unauthenticated"
            raise RuntimeError(f"{who}: the control plane would be unauthenticated ({why}) "
                               f"and {AUTH_ENV}={mode}; {hint}{allow}")
        log.warning("%s: THE CONTROL PLANE IS UNAUTHENTICATED (%s): anyone who can reach its ports can send "
                    "plans; %s, or set %s=required to refuse", who, why, hint, AUTH_ENV)
        return "unauthenticated"
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        secret = _share(store, world_size, deadline, who)
    else:
        secret = _receive(store, rank, deadline, who)
    keys.agree(secret)
    return "private-file"


def _share(store: Any, world_size: int, deadline: float, who: str) -> str:
    secret = new_run_secret()
    assert secret is not None  # zmq has CURVE (checked above)
    path = private_key_file(secret)
    try:
        store.set(FILE_KEY, path)
        answers = {r: _wait(store, READ_KEY.format(r), deadline, who).decode("utf-8", "replace")
                   for r in range(1, world_size)}
    finally:
        remove_private_key_file(path)
    store.set(GONE_KEY, "1")
    failed = {r: a for r, a in answers.items() if a != "ok"}
    if failed:
        rank, reason = next(iter(failed.items()))
        raise RuntimeError(f"{who}: rank(s) {sorted(failed)} could not read the run's control-plane key "
                           f"(rank {rank}: {reason})")
    return secret


def _receive(store: Any, rank: int, deadline: float, who: str) -> str:
    path = _wait(store, FILE_KEY, deadline, who).decode("utf-8", "replace")
    try:
        secret = read_private_key(path)
    except KeyFileError as e:
        store.set(READ_KEY.format(rank), str(e))
        raise RuntimeError(f"{who}: cannot read the run's control-plane key from stage 0 ({e}); on several "
                           f"hosts give every rank a key ({RUN_SECRET_FILE_ENV})") from None
    store.set(READ_KEY.format(rank), "ok")
    _wait(store, GONE_KEY, deadline, who)  # nobody goes on while the file exists
    return secret


def _wait(store: Any, key: str, deadline: float, who: str) -> bytes:
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"vpipe.attach on {who}: the other ranks did not agree on the "
                               f"control-plane key in time (waiting for {key}); every rank must call it")
        time.sleep(0.01)
    return store.get(key)


def read_private_key(path: str) -> str:
    """The key in stage 0's file, if the file and its directory are
    this user's and private; KeyFileError else."""
    uid = os.geteuid()
    folder = os.path.dirname(path) or "."
    try:
        info = os.lstat(folder)
    except OSError as e:
        raise KeyFileError(f"run key directory {folder}: {e.strerror or e}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        raise KeyFileError(f"run key directory {folder} is not a private directory of this user "
                           f"(owner {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})")
    try:
        fd = open_regular(path, "run key file", nofollow=True)
    except FileCheckError as e:
        raise KeyFileError(str(e)) from None
    try:
        info = os.fstat(fd)
        if info.st_uid != uid or info.st_mode & 0o077:
            raise KeyFileError(f"run key file {path} is not private to this user "
                               f"(owner {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})")
        data = os.read(fd, _KEY_FILE_LIMIT).strip()
    finally:
        os.close(fd)
    try:
        return check_z85_key(data, f"run key file {path}").decode("ascii")
    except ValueError as e:
        raise KeyFileError(str(e)) from None
