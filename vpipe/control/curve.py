"""Optional CURVE authentication and encryption of the control plane.

On several hosts the control sockets listen on a network interface, where anyone who can
reach the port could otherwise inject stats or plans. With CURVE on, every inbox is a
CURVE server that admits only clients whose public key is listed (a ZAP handler on the
process's zmq context, :mod:`vpipe.control.zap`), and every outbox is a CURVE client that
only connects to a server whose public key is listed, so both ends are authenticated and
the traffic is encrypted.

Configured by environment variables, so ``torchrun`` passes it to every rank and the
planner daemon inherits it (read with the others into :class:`~vpipe.settings.Settings`,
once, where vpipe starts); both or neither must be set:

``VPIPE_CURVE_SECRET_FILE``
    this host's key pair (``NAME.key_secret`` from ``vpipe keys``, mode 0600); its public
    key is always trusted.
``VPIPE_CURVE_PUBLIC_KEYS``
    the public keys admitted: files and/or directories of ``*.key`` files, separated by
    ``os.pathsep`` (``:``).

A rank publishes its server's public key in the TCPStore next to its endpoint
(``vpipe/ctl/key/<rank>``); the store is not trusted for this: a key that is not listed
is refused.

Without those, a run still authenticates its control plane, at no cost to the user: a key
pair made for the run (``VPIPE_CURVE_RUN_SECRET``: by ``vpipe train``'s launcher, or under
torchrun by stage 0, handed to the other ranks through a private file, never through the
rendezvous store: see ``run_key.py``) is shared by its
ranks and its planner daemon, and is the only key they admit. A process without it cannot
complete a handshake, so it cannot inject stats, plans or a ``hello``. To attach a planner
daemon by hand, the last stage writes the secret to a file only its user can read
(``VPIPE_CURVE_RUN_SECRET_FILE``) and logs the command that uses it. CURVE is off only
where this libzmq lacks it, or across hosts without a key given (with a warning).

One attach's keys are a :class:`RunKeys`: the settings, the secret agreed at attach, and
the private file made for a daemon started by hand. It hands them to the sockets and, as an
environment of their own, to the daemon it starts; nothing is written to this process's
environment, so a second attach in the process agrees on a key of its own.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq

from vpipe.control.keys import KeyFileError, public_keys_from, read_secret_file
from vpipe.settings import Settings, process_settings

log = logging.getLogger("vpipe.control")

__all__ = ["SECRET_ENV", "PUBLIC_ENV", "RUN_SECRET_ENV", "RUN_SECRET_FILE_ENV", "CurveConfig", "RunKeys",
           "log_due",
           "new_run_secret", "private_key_file", "remove_private_key_file", "remove_private_key_files"]

SECRET_ENV = "VPIPE_CURVE_SECRET_FILE"
PUBLIC_ENV = "VPIPE_CURVE_PUBLIC_KEYS"
RUN_SECRET_ENV = "VPIPE_CURVE_RUN_SECRET"
RUN_SECRET_FILE_ENV = "VPIPE_CURVE_RUN_SECRET_FILE"


def new_run_secret() -> str | None:
    """A fresh CURVE secret key (Z85) for one run, or None when this libzmq has no CURVE."""
    if not zmq.has("curve"):
        return None
    return zmq.curve_keypair()[1].decode("ascii")


_PRIVATE_FOLDERS: list[str] = []  # the key folders this process made, removed at exit
# whether their removal at exit is registered (once per process, however many attach)
_AT_EXIT: list[bool] = []


_FOLDER_PREFIX = "vpipe-run-"


def private_key_file(secret: str) -> str:
    """Write ``secret`` to a new file, 0600 in a new 0700 directory, both removed when this process exits.

    A process killed outright (SIGTERM, SIGKILL, a crash) cannot remove its folder; the folder's
    name holds its pid, and every new one first removes this user's folders whose process is gone.
    """
    _remove_orphaned_folders()
    folder = tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")  # mode 0700
    if not _AT_EXIT:
        atexit.register(remove_private_key_files)
        _AT_EXIT.append(True)
    _PRIVATE_FOLDERS.append(folder)
    path = os.path.join(folder, "control.key_secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return path


def _remove_orphaned_folders() -> None:
    """Remove this user's key folders (``vpipe-run-PID-*``) whose process no longer runs."""
    base = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(base) if n.startswith(_FOLDER_PREFIX)]
    except OSError:
        return
    for name in names:
        pid_text = name[len(_FOLDER_PREFIX):].partition("-")[0]
        path = os.path.join(base, name)
        try:
            info = os.lstat(path)
            if not (pid_text.isdigit() and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()):
                continue
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def remove_private_key_file(path: str) -> None:
    """Remove the key folder :func:`private_key_file` made for ``path`` (and only it)."""
    folder = os.path.dirname(path)
    if folder in _PRIVATE_FOLDERS:
        _PRIVATE_FOLDERS.remove(folder)
        shutil.rmtree(folder, ignore_errors=True)


def remove_private_key_files() -> None:
    """Remove every key folder this process made (at exit, including the fast exits that skip ``atexit``).

    The list is the process's, not an attach's: whoever made a folder, none may outlive the process."""
    while _PRIVATE_FOLDERS:
        shutil.rmtree(_PRIVATE_FOLDERS.pop(), ignore_errors=True)


def log_due(n: int, first: int = 100, every: int = 1000) -> bool:
    """Log the ``n``-th occurrence? The first ``first`` ones, then one in ``every``: floods stay short."""
    return n <= first or n % every == 0


@dataclass(frozen=True)
class CurveConfig:
    """This process's CURVE key pair and the public keys it trusts (all Z85)."""

    public: bytes
    secret: bytes
    trusted: frozenset[bytes]

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike[str], public_keys: list[str]) -> CurveConfig:
        """Read and check the key files; :class:`KeyFileError` names the file that is wrong."""
        if not zmq.has("curve"):
            raise KeyFileError(
                "this libzmq was built without CURVE support; the control plane cannot encrypt"
            )
        public, secret = read_secret_file(secret_file)
        trusted = set(public_keys_from(public_keys))
        trusted.add(public)
        return cls(public=public, secret=secret, trusted=frozenset(trusted))

    def check_server_key(self, key: bytes | str | None, peer: str) -> bytes:
        """``key`` if it is a trusted public key; ValueError naming ``peer`` otherwise."""
        if key is None:
            raise ValueError(f"{peer} published no CURVE key, but CURVE is on here ({SECRET_ENV}): "
                             f"start every process of the run with the same CURVE settings")
        data = key.encode("ascii", "replace") if isinstance(key, str) else bytes(key)
        if data not in self.trusted:
            raise ValueError(f"{peer} presents CURVE key {data[:40].decode('ascii', 'replace')!r}, which is "
                             f"not among the trusted keys ({PUBLIC_ENV}); refusing to connect")
        return data

    def make_server(self, socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.public)

    def make_client(self, socket: zmq.Socket, server_key: bytes) -> None:
        socket.setsockopt(zmq.CURVE_SERVERKEY, server_key)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


class RunKeys:
    """One attach's (or one command's) CURVE keys: the key files the settings name, or the run's
    secret (given in the settings, or agreed at attach by
    :func:`~vpipe.control.run_key.agree_run_key`), and the private file holding it that a daemon
    started by hand reads (made when first asked for, removed by :meth:`close`)."""

    def __init__(self, settings: Settings, secret: str | None = None) -> None:
        self.settings = settings
        self._agreed = secret
        self._file: str | None = None

    @classmethod
    def of_process(cls) -> RunKeys:
        """Keys of this process's settings (read once), for a part made without an attach's keys."""
        return cls(process_settings())

    @property
    def by_files(self) -> bool:
        """Whether the user set up CURVE with key files (then no run key is made)."""
        return bool(self.settings.curve_secret_file or self.settings.curve_public_keys)

    @property
    def given(self) -> bool:
        """Whether the launcher or the user gave the run's secret (or a file holding it)."""
        return bool(self.settings.curve_run_secret or self.settings.curve_run_secret_file)

    @property
    def secret(self) -> str:
        """The run's secret as text: agreed at attach, or given; "" when neither."""
        return self._agreed or self.settings.curve_run_secret

    def agree(self, secret: str) -> None:
        """The secret the ranks agreed on at attach: this run's from now on."""
        self._agreed = secret

    def curve(self) -> CurveConfig | None:
        """The CURVE configuration these keys make, None when CURVE is off; errors name the problem."""
        settings = self.settings
        if not self.by_files:
            return self._run_config()
        if not settings.curve_secret_file:
            raise KeyFileError(f"{PUBLIC_ENV} is set but {SECRET_ENV} is not: CURVE needs "
                               "this host's secret key file")
        if not settings.curve_public_keys:
            raise KeyFileError(f"{SECRET_ENV} is set but {PUBLIC_ENV} is not: CURVE needs the "
                               "public keys to admit")
        return CurveConfig.from_files(Path(settings.curve_secret_file), list(settings.curve_public_keys))

    def _run_config(self) -> CurveConfig | None:
        secret_text = self.secret
        # a bare key or a `vpipe keys` secret file
        if not secret_text and self.settings.curve_run_secret_file:
            secret_text = read_secret_file(self.settings.curve_run_secret_file)[1].decode("ascii")
        if not secret_text or not zmq.has("curve"):
            return None
        try:
            secret = secret_text.encode("ascii")
            public = zmq.curve_public(secret)
        except (UnicodeEncodeError, ValueError, zmq.ZMQError) as e:
            raise KeyFileError(f"{RUN_SECRET_ENV} is not a CURVE secret key ({e})") from None
        return CurveConfig(public=public, secret=secret, trusted=frozenset({public}))

    def secret_file(self) -> str | None:
        """A file only this user can read holding the run's secret, for a daemon started by hand: the one the
        settings name, else one made now (once); None without a run secret."""
        if self.settings.curve_run_secret_file:
            return self.settings.curve_run_secret_file
        if self._file is None and self.secret:
            self._file = private_key_file(self.secret)
        return self._file

    def child_env(self) -> dict[str, str]:
        """What a process this one starts (the planner daemon) needs in its environment to hold the same keys,
        beyond what it inherits: the secret agreed at attach."""
        return {RUN_SECRET_ENV: self._agreed} if self._agreed else {}

    def close(self) -> None:
        """Remove the key file :meth:`secret_file` made (not another attach's)."""
        if self._file is not None:
            remove_private_key_file(self._file)
            self._file = None
